"""The trainer's policy: a Megatron-Core `GPTModel` loaded from a Hugging Face checkpoint (`hf_config.FAMILIES`).

`MegatronPolicy.from_hf` builds the model for the current `megatron.core.parallel_state` (TP size from
it), loads and shards the Hugging Face weights, and scores token sequences: `token_logprobs` returns the
log-probability of every next token under the full-vocabulary (optionally vLLM-processed) softmax,
computed with `distributed.vocab_parallel_logprobs` so TP-sharded logits are never gathered.
`hf_weights()` yields the current weights under Hugging Face names with TP shards gathered: the payload of
a rollout-engine refit and of a Hugging Face export.

Pipeline parallelism: `from_hf` builds the right stage (pre/post process, layer offsets) and the
weight conversion handles stages. `score_microbatches` runs Megatron's schedule (`models.schedule`)
and so works for every layout; `logits`/`token_logprobs` call the model directly and need PP = 1.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nemo_rollout_correction.distributed.cpu_compat import cuda_to_cpu
from nemo_rollout_correction.distributed.tensor_gather import group_rank, group_size
from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs
from nemo_rollout_correction.models import logit_positions, prefix_sharing
from nemo_rollout_correction.models.hf_llama import (
    ModelArch,
    SafetensorsCheckpoint,
    build_gpt_model,
    iter_hf_weights,
    load_hf_weights,
    read_arch,
    transformer_config,
)
from nemo_rollout_correction.models.lora import LoraConfig, apply_lora, has_lora
from nemo_rollout_correction.models.lora_export import hf_adapter_tensors
from nemo_rollout_correction.models.megatron_cpu import causal_attention_mask, seed_model_parallel
from nemo_rollout_correction.models.packing import PackedRows
from nemo_rollout_correction.models.routing_replay import RoutingReplay, check_moe_for_replay, routing_replay_fields
from nemo_rollout_correction.models.schedule import run_microbatches

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"float32"|"bfloat16"|"float16"` (or a torch dtype) -> torch dtype; ValueError names the allowed values."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class MegatronPolicy:
    """A Megatron-Core GPT policy plus the metadata needed to score tokens and export weights."""

    model: nn.Module
    arch: ModelArch
    hf_dir: Path
    tp_group: Any = None
    pp_size: int = 1
    is_last_stage: bool = True
    """Whether this rank holds the last pipeline stage (the output layer: logits and logprobs)."""
    lm_head_fp32: bool = False
    """Whether the output layer runs in fp32 (`use_fp32_lm_head`)."""
    routing: RoutingReplay | None = None
    """Rollout routing replay of this MoE model (`from_hf(routing_replay=True)`), else None."""
    cuts_logits: bool = False
    """Whether forwards can compute logits from a sequence position on (`models.logit_positions`; not under
    sequence parallelism): `score_microbatches(starts=...)`, `run_microbatches(output_starts=...)`."""
    prefix_sharing_unsupported: str | None = "not built by from_hf"
    """Why forwards cannot run shared-prefix packs (`models.prefix_sharing`: the local spec's attention only), or
    None when they can (`shares_prefixes`)."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether packs with shared prefixes (`PackedRows.of(share_prefixes=True)`) can be forwarded."""
        return self.prefix_sharing_unsupported is None

    @property
    def device(self) -> torch.device:
        """The device of this rank's parameters (where its logprobs are computed)."""
        return next(self.model.parameters()).device

    @property
    def layer_spec(self) -> str:
        """The Megatron-Core layer spec this model was built with, and why (`models.hf_llama.choose_layer_spec`)."""
        choice = getattr(self.model, "nrc_layer_spec", None)
        return "unknown" if choice is None else f"{choice.name} ({choice.reason})"

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size (1 without torch.distributed)."""
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        """This rank's index in the tensor-parallel group."""
        return group_rank(self.tp_group)

    @classmethod
    def from_hf(cls, hf_dir: str | Path, *, params_dtype: str | torch.dtype = "float32", seed: int = 1234,
                use_transformer_engine: bool | None = None, routing_replay: bool = False,
                lora: LoraConfig | None = None) -> MegatronPolicy:
        """Build this rank's model stage for `parallel_state`'s TP/PP sizes and load the HF weights.

        `megatron.core.parallel_state` must be initialised (also for one process). Every rank reads from the
        Hugging Face safetensors files only the tensor slices its own shard needs (on a cluster they sit on
        a shared filesystem). `routing_replay=True` (MoE only) builds the routers with Megatron's `RouterReplay`
        and wires `models.routing_replay.RoutingReplay` into the model (`self.routing`). `lora` with rank > 0
        freezes the loaded weights and attaches LoRA adapters (`models.lora.apply_lora`, A seeded by `seed`).
        """
        from megatron.core import parallel_state as ps

        hf_dir = Path(hf_dir)
        arch = read_arch(hf_dir)
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        cp = ps.get_context_parallel_world_size()
        dtype = parse_dtype(params_dtype)
        seed_model_parallel(seed)
        if routing_replay:
            check_moe_for_replay(arch.num_experts, arch.architecture)
        config = transformer_config(arch, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                    context_parallel_size=cp, params_dtype=dtype,
                                    **(routing_replay_fields() if routing_replay else {}))
        last = bool(ps.is_pipeline_last_stage())
        # With PP > 1 and tied embeddings Megatron syncs the last stage's embedding copy at construction,
        # via Tensor.cuda(): the CPU mode keeps it on the CPU.
        with cuda_to_cpu():
            model = build_gpt_model(arch, config, pre_process=ps.is_pipeline_first_stage(), post_process=last,
                                    use_transformer_engine=use_transformer_engine)
        with SafetensorsCheckpoint(hf_dir) as checkpoint:
            load_hf_weights(model, checkpoint, arch, tp_rank=ps.get_tensor_model_parallel_rank(), tp=tp)
        if lora is not None and lora.enabled:
            apply_lora(model, lora, seed=seed)
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        routing = RoutingReplay.for_model(model) if routing_replay else None
        sharing = None if prefix_sharing.install(model) else prefix_sharing.unsupported_by(model)
        return cls(model=model, arch=arch, hf_dir=hf_dir, tp_group=group, pp_size=pp, is_last_stage=last,
                   routing=routing, cuts_logits=logit_positions.install(model), prefix_sharing_unsupported=sharing)

    def use_fp32_lm_head(self) -> MegatronPolicy:
        """Compute the output layer (and so the logits and logprobs) in fp32 under a bf16/fp16 policy.

        TRL's `cast_lm_head_to_fp32` idea: the final hidden states and the output weight (the tied
        embedding, or the untied output layer) are cast to fp32 before the vocabulary projection, so the
        logits are not rounded to 8 (bf16) mantissa bits before the softmax. The parameters stay in their
        dtype and receive their gradients through the casts; nothing changes for an fp32 policy. Idempotent;
        a no-op on pipeline stages without the output layer. Returns self.
        """
        if self.lm_head_fp32:
            return self
        for name, module in self.model.named_modules():
            if name.split(".")[-1] == "output_layer":
                _forward_in_fp32(module)
        self.lm_head_fp32 = True
        return self

    def logits(self, input_ids: Tensor) -> Tensor:
        """Vocab-sharded logits `[batch, seq, vocab / tp]` for right-padded `input_ids` `[batch, seq]`.

        Causal attention makes right padding harmless: positions before a sequence's end never attend
        to its padding.
        """
        if self.pp_size != 1:
            raise RuntimeError("logits() runs the whole model: use Megatron's pipeline schedule when PP > 1")
        batch, seq = input_ids.shape
        device = next(self.model.parameters()).device
        input_ids = input_ids.to(device)
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
        out: Tensor = self.model(input_ids=input_ids, position_ids=position_ids,
                                 attention_mask=causal_attention_mask(seq, device=device))
        return out

    def logprobs_from_logits(self, logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0,
                             top_k: int | None = None, top_p: float | None = None, start: int = 0) -> Tensor:
        """`[batch, seq - 1]` float32: logprob of `input_ids[:, t + 1]` given its prefix, from `[b, s - start, V/tp]`
        logits of positions `start..s-1` (`models.logit_positions`); the first `start` columns are 0 (not computed)."""
        if logits.shape[1] != input_ids.shape[1] - start:
            raise ValueError(f"logits cover {logits.shape[1]} positions, expected {input_ids.shape[1]} - start {start}")
        logprobs = self.label_logprobs(logits[:, :-1], input_ids[:, start + 1:], temperature=temperature,
                                       top_k=top_k, top_p=top_p)
        return torch.nn.functional.pad(logprobs, (start, 0)) if start else logprobs

    def token_logprobs(self, input_ids: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                       top_p: float | None = None) -> Tensor:
        """`[batch, seq - 1]` float32 logprobs of each next token (vLLM's processed distribution when
        temperature/top-k/top-p are given), identical on every TP rank; differentiable."""
        return self.logprobs_from_logits(self.logits(input_ids), input_ids, temperature=temperature, top_k=top_k,
                                         top_p=top_p)

    def label_logprobs(self, logits: Tensor, labels: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                       top_p: float | None = None) -> Tensor:
        """`[batch, seq]` float32: logprob of `labels[:, t]` under the logits at position t (no shift).

        The context-parallel form: a CP rank's logits cover scattered positions, so the next-token
        labels are cut out of the full sequence beforehand, with the same indices as the inputs.
        """
        return vocab_parallel_logprobs(logits, labels.to(logits.device), self.tp_group, temperature=temperature,
                                       top_k=top_k, top_p=top_p)

    def packed_logprobs(self, logits: Tensor, packed: PackedRows, *, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None) -> Tensor:
        """`[rows, width - 1]` float32 logprobs of a packed microbatch's next tokens, laid out as
        `logprobs_from_logits` lays out the padded rows' (zeros where no logit was computed: `PackedRows.unpack`),
        from the pack's logits `[1, K, V/tp]` (`logit_index` positions) or `[1, total, V/tp]` (all positions)."""
        if logits.shape[1] == packed.total:
            logits = logits[:, packed.logit_index.to(logits.device)]
        logprobs = self.label_logprobs(logits, packed.labels, temperature=temperature, top_k=top_k, top_p=top_p)
        return packed.unpack(logprobs)

    @torch.no_grad()
    def score_microbatches(self, input_ids: list[Tensor], *, labels: list[Tensor] | None = None,
                           position_ids: list[Tensor] | None = None, temperature: float = 1.0,
                           top_k: int | None = None, top_p: float | None = None,
                           starts: list[int] | None = None,
                           packed: list[PackedRows] | None = None) -> list[Tensor] | None:
        """No-grad logprobs per microbatch through Megatron's schedule (any TP/PP/CP layout).

        Without `labels`: `[rows, width - 1]`, as `token_logprobs` computes them. With `labels` (context
        parallelism: this CP rank's next-token ids, `[rows, width]`, and their `position_ids`):
        `[rows, width]` from `label_logprobs`. Every stage of a pipeline must call it with the same
        microbatches; the last stage gets the list, the other stages None. `starts` (no labels, `cuts_logits`): per
        microbatch the first position whose logits are computed; the logprobs before it are 0. `packed` (no
        labels): each microbatch's rows packed (`models.packing`), logprobs as `packed_logprobs` lays them out.
        """
        out: list[Tensor] = []
        if starts is not None and (labels is not None or not self.cuts_logits) and any(starts):
            raise ValueError("starts needs next-token scoring (no labels) on a policy that cuts_logits")

        def hook(index: int, logits: Tensor) -> Tensor:
            if packed is not None:
                out.append(self.packed_logprobs(logits, packed[index], temperature=temperature, top_k=top_k,
                                                top_p=top_p))
            elif labels is None:  # next-token shift inside the microbatch
                start = starts[index] if starts is not None else 0
                out.append(self.logprobs_from_logits(logits, input_ids[index], temperature=temperature, top_k=top_k,
                                                     top_p=top_p, start=start))
            else:
                out.append(self.label_logprobs(logits, labels[index], temperature=temperature, top_k=top_k,
                                               top_p=top_p))
            return logits.new_zeros(())

        run_microbatches(self.model, input_ids, hook, forward_only=True, position_ids=position_ids,
                         output_starts=starts, packed=packed)
        return out if self.is_last_stage else None

    def hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face name, full tensor) for this pipeline stage; every TP rank must iterate (collectives)."""
        return iter_hf_weights(self.model, self.arch, tp_group=self.tp_group, dtype=dtype)

    @property
    def lora(self) -> bool:
        """Whether LoRA adapters are attached (`from_hf(lora=...)`): `hf_weights` then yields merged weights."""
        return has_lora(self.model)

    def hf_adapter_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The LoRA adapters in PEFT names, TP shards gathered (`models.lora_export`); every TP rank must call it."""
        return hf_adapter_tensors(self.model, self.arch, tp_group=self.tp_group, dtype=dtype)

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """`hf_weights()` collected into a dict of CPU tensors."""
        return {name: tensor.detach().to("cpu").clone() for name, tensor in self.hf_weights(dtype)}

    def save_hf(self, out_dir: str | Path, *, write: bool = True) -> Path | None:
        """Export the current weights as a Hugging Face checkpoint (config and tokenizer copied from `hf_dir`).

        Every TP rank must call it (gathers); only ranks with `write=True` write. Needs PP = 1.
        """
        state = self.hf_state_dict()
        if not write:
            return None
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for item in self.hf_dir.iterdir():
            weights = item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json"
            if item.is_file() and not weights:
                shutil.copy2(item, out / item.name)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["torch_dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "")
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return out


def _forward_in_fp32(layer: nn.Module) -> None:
    """Wrap a Megatron ColumnParallelLinear's forward so input and weight enter the matmul as fp32.

    Megatron-Core 0.16 has no per-layer precision switch for the output layer (its dtype follows
    `params_dtype`), hence the wrapper; it keeps Megatron's own forward (TP all-gather, sequence parallel).
    """
    original = layer.forward

    def forward(input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None) -> Any:
        w = weight if weight is not None else layer.weight
        return original(input_.float(), weight=w.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = forward


__all__ = ["MegatronPolicy", "parse_dtype"]

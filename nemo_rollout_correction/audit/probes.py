"""`nrc audit`'s probes beyond the sampled tokens: whole distributions on fixed tokens, and where the sides part.

Two comparisons on the audit's own rollouts (prompt + sampled response, fixed token ids):

1. **Distributions** (`DivergenceAccumulator`): at every response position, the engine's next-token distribution
   (vLLM `prompt_logprobs=k`: the sequence is sent back as a prompt, `max_tokens=1`) against the trainer's
   (the Megatron policy's full logits, log-softmax in float32). vLLM returns prompt logprobs *before* any
   sampling processor (temperature 1, no top-k/top-p, whatever `rollout.temperature` is), so this compares the
   two raw model distributions. With `k = -1` (`audit.vocab_top_k=-1`, the engine started with
   `max_logprobs=-1`) vLLM returns the whole vocabulary and the TV distance and KL(engine || trainer) are exact.
   With `k > 0` it returns the top k (plus the actual token): both distributions are then coarsened to those
   tokens plus one "rest" bucket holding the remaining mass (1 - the listed mass, each side its own), and
   TV and KL are computed over that partition. By the data-processing inequality these are lower bounds of
   the full-vocabulary values (equal when the rest carries little mass).
   The first response token is reported separately: it is scored at the end of the prompt's prefill (another
   kernel path in the engine than decoding) and it starts every response.

2. **Layers** (`layer_differences`): the same token ids through the Megatron policy and through a Hugging Face
   `transformers` forward of the same checkpoint files, in the engine's dtype (a proxy for the engine, whose
   layers cannot be hooked from outside), with forward hooks on the embedding, every decoder layer and the
   final norm. Per layer: max |difference| and the RMS of the difference relative to the RMS of the HF
   activations, over the sequences' real (non-pad) tokens. The first layer whose relative difference leaves
   the float32 noise level is where the two sides part (a conversion error shows up at one layer; precision
   grows slowly through the stack).

Both need the whole model in one process (no TP/PP/CP): the audit skips them, saying why, otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "DivergenceAccumulator",
    "LayerDiff",
    "VocabDivergence",
    "engine_prompt_logprobs",
    "first_token_stats",
    "layer_differences",
    "parting_layer",
    "position_divergence",
    "trainer_vocab_divergence",
]

EnginePosition = tuple[Tensor, Tensor]
"""One position's engine distribution: token ids `[n]` int64 and their logprobs `[n]` float32."""


@dataclass
class VocabDivergence:
    """Distribution-level mismatch over the response positions (module docstring, 1)."""

    top_k: int  # -1: the whole vocabulary (exact); else the engine's top k + the actual token + the rest
    num_positions: int
    tv_mean: float
    tv_max: float
    kl_mean: float  # KL(engine || trainer), nats per position
    kl_max: float
    first_token_tv_mean: float
    first_token_kl_mean: float
    rest_mass_mean: float  # the engine's mass outside its listed tokens (0 with the whole vocabulary)
    first_token: dict[str, float] = field(default_factory=dict)
    """Sampled-token view of the first response token: `max_abs_logprob_diff`, `mean_abs_logprob_diff`, `k3_kl`."""

    @property
    def support(self) -> str:
        """What TV and KL are computed over."""
        return "whole vocabulary" if self.top_k < 0 else f"engine top-{self.top_k} + sampled token + rest bucket"


def engine_prompt_logprobs(engine: Any, sequences: Sequence[Sequence[int]], top_k: int) -> list[list[EnginePosition]]:
    """The engine's next-token distributions along fixed `sequences` (vLLM `prompt_logprobs`).

    Returns, per sequence, one entry per position t = 1 .. len - 1: the distribution of token t given tokens
    < t. `top_k=-1` asks for the whole vocabulary (the engine must run with `max_logprobs=-1`).
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top_k, detokenize=False)
    outputs = engine.llm.generate([{"prompt_token_ids": list(map(int, s))} for s in sequences], params,
                                  use_tqdm=False)
    result = []
    for out in outputs:
        positions = []
        for entry in (out.prompt_logprobs or [])[1:]:
            ids = torch.tensor(list(entry.keys()), dtype=torch.int64)
            values = torch.tensor([float(v.logprob) for v in entry.values()], dtype=torch.float32)
            positions.append((ids, values))
        result.append(positions)
    return result


def position_divergence(trainer_logprobs: Tensor, engine: EnginePosition, *, whole_vocab: bool
                        ) -> tuple[float, float, float]:
    """(TV, KL(engine || trainer), engine rest mass) at one position; `trainer_logprobs` `[V]` float32."""
    ids, engine_lp = engine
    q = engine_lp.double().exp()
    lp = trainer_logprobs.double()
    if whole_vocab:
        p = lp.exp()
        q_full = torch.zeros_like(p)
        q_full[ids] = q
        lq = torch.full_like(p, -math.inf)
        lq[ids] = engine_lp.double()
        tv = 0.5 * float((p - q_full).abs().sum())
        kl = float(torch.where(q_full > 0, q_full * (lq - lp), torch.zeros_like(p)).sum())
        return tv, kl, max(0.0, 1.0 - float(q.sum()))
    p_s = lp[ids].exp()
    rest_q = max(0.0, 1.0 - float(q.sum()))
    rest_p = max(0.0, 1.0 - float(p_s.sum()))
    tv = 0.5 * (float((p_s - q).abs().sum()) + abs(rest_p - rest_q))
    kl = float((q * (engine_lp.double() - lp[ids])).sum())
    if rest_q > 0:
        kl += rest_q * (math.log(rest_q) - math.log(max(rest_p, 1e-300)))
    return tv, kl, rest_q


class DivergenceAccumulator:
    """`position_divergence` over the response positions of sequences added one microbatch at a time."""

    def __init__(self, top_k: int, vocab_size: int) -> None:
        self.top_k, self.vocab_size = top_k, vocab_size
        self.tvs: list[float] = []
        self.kls: list[float] = []
        self.rests: list[float] = []
        self.first_tv: list[float] = []
        self.first_kl: list[float] = []

    def add(self, trainer_logprobs: Tensor, positions: Sequence[EnginePosition], response_start: int) -> None:
        """One sequence: `trainer_logprobs` `[len - 1, V]` float32 log-softmax of the trainer's logits (row t
        predicts token t + 1), `positions` its `engine_prompt_logprobs` entries, `response_start` the prompt
        length (the index of the first response token)."""
        for t in range(response_start, len(positions) + 1):  # token t is predicted at row t - 1
            ids = positions[t - 1][0]
            whole = self.top_k < 0 or ids.numel() >= self.vocab_size
            tv, kl, rest = position_divergence(trainer_logprobs[t - 1], positions[t - 1], whole_vocab=whole)
            self.tvs.append(tv)
            self.kls.append(kl)
            self.rests.append(rest)
            if t == response_start:
                self.first_tv.append(tv)
                self.first_kl.append(kl)

    def result(self) -> VocabDivergence:
        """The aggregate over every position added."""

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else math.nan

        return VocabDivergence(top_k=self.top_k, num_positions=len(self.tvs), tv_mean=mean(self.tvs),
                               tv_max=max(self.tvs, default=math.nan), kl_mean=mean(self.kls),
                               kl_max=max(self.kls, default=math.nan), first_token_tv_mean=mean(self.first_tv),
                               first_token_kl_mean=mean(self.first_kl), rest_mass_mean=mean(self.rests))


@torch.no_grad()
def trainer_vocab_divergence(policy: Any, sequences: Sequence[Sequence[int]],
                             engine: Sequence[Sequence[EnginePosition]], response_starts: Sequence[int], *,
                             top_k: int, vocab_size: int, pad_token_id: int,
                             micro_batch_size: int) -> VocabDivergence:
    """The trainer's whole next-token distributions (log-softmax of its float32-cast logits, temperature 1)
    along `sequences` against the engine's (`engine_prompt_logprobs`), microbatch by microbatch. One process."""
    acc = DivergenceAccumulator(top_k, vocab_size)
    policy.model.eval()
    for lo in range(0, len(sequences), micro_batch_size):
        rows = list(sequences[lo:lo + micro_batch_size])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.int64)
        logprobs = torch.log_softmax(policy.logits(ids).float(), dim=-1).cpu()
        for i, r in enumerate(rows):
            acc.add(logprobs[i, :len(r) - 1], engine[lo + i], response_starts[lo + i])
    return acc.result()


def first_token_stats(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """The sampled-token mismatch of the first response token only (`[S, L - 1]` inputs)."""
    first = loss_mask & (loss_mask.cumsum(-1) == 1)
    log_ratio = (old_logprobs - rollout_logprobs)[first].double()
    log_ratio = log_ratio[torch.isfinite(log_ratio)]
    if log_ratio.numel() == 0:
        return {}
    return {"max_abs_logprob_diff": float(log_ratio.abs().max()),
            "mean_abs_logprob_diff": float(log_ratio.abs().mean()),
            "k3_kl": float((log_ratio.exp() - 1 - log_ratio).mean())}


@dataclass
class LayerDiff:
    """Trainer vs Hugging Face activations at one point of the network (module docstring, 2)."""

    name: str
    max_abs_diff: float
    rel_rms_diff: float


def _capture(modules: Sequence[tuple[str, nn.Module]], seq_first: bool) -> tuple[dict[str, Tensor], list[Any]]:
    store: dict[str, Tensor] = {}
    handles = []
    for name, module in modules:
        def hook(_mod: nn.Module, _inputs: Any, output: Any, name: str = name) -> None:
            out = output[0] if isinstance(output, tuple | list) else output
            out = out.detach().float()
            store[name] = out.transpose(0, 1).contiguous() if seq_first else out  # -> [batch, seq, hidden]
        handles.append(module.register_forward_hook(hook))
    return store, handles


def _megatron_points(model: nn.Module) -> list[tuple[str, nn.Module]]:
    named = dict(model.named_modules())
    layers = sorted((int(n.rsplit(".", 1)[1]), m) for n, m in named.items()
                    if n.startswith("decoder.layers.") and n.count(".") == 2)
    return [("embedding", named["embedding"]), *[(f"layer_{i}", m) for i, m in layers],
            ("final_norm", named["decoder.final_layernorm"])]


def _hf_points(model: Any) -> list[tuple[str, nn.Module]]:
    base = model.model  # *ForCausalLM.model: the decoder stack (Llama, Qwen, Mistral, Mixtral, Qwen3-MoE)
    return [("embedding", base.embed_tokens), *[(f"layer_{i}", m) for i, m in enumerate(base.layers)],
            ("final_norm", base.norm)]


@torch.no_grad()
def layer_differences(policy: Any, hf_dir: Path, input_ids: Tensor, lengths: Sequence[int], *,
                      hf_dtype: str) -> list[LayerDiff]:
    """Per-layer activation differences, trainer (Megatron, `policy`) vs `transformers` (`hf_dir` in `hf_dtype`).

    `input_ids` `[batch, seq]` right-padded; `lengths[i]`: the real tokens of row i (only those compared). One
    process only (the whole Megatron model on this rank).
    """
    import transformers

    from nemo_rollout_correction.models.policy import parse_dtype

    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=parse_dtype(hf_dtype))
    hf.eval()
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    trainer_store, handles = _capture(_megatron_points(policy.model), seq_first=True)
    hf_store, hf_handles = _capture(_hf_points(hf), seq_first=False)
    try:
        policy.model.eval()
        policy.logits(input_ids)
        hf(input_ids=input_ids, attention_mask=mask.long())
    finally:
        for h in handles + hf_handles:
            h.remove()
    out = []
    for name, _ in _megatron_points(policy.model):
        a, b = trainer_store[name][mask], hf_store[name][mask]
        diff = (a - b).double()
        rms_ref = float(b.double().pow(2).mean().sqrt())
        out.append(LayerDiff(name, float(diff.abs().max()), float(diff.pow(2).mean().sqrt()) / max(rms_ref, 1e-30)))
    return out


def parting_layer(layers: Sequence[LayerDiff], *, rel_tol: float = 1e-4) -> str | None:
    """The first point whose relative RMS difference exceeds `rel_tol` (float32 noise is ~1e-6), or None."""
    return next((layer.name for layer in layers if layer.rel_rms_diff > rel_tol), None)

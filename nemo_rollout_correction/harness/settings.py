"""Shared by `nrc train` and `nrc audit`: engine, sampling and replay settings from the config, tokenisation."""

from __future__ import annotations

import dataclasses
from typing import Any

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.vocab_parallel import active_filters
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions


def sampling_options(cfg: TrainConfig) -> SamplingOptions:
    """The rollout section's sampling settings."""
    r = cfg.rollout
    return SamplingOptions(
        n=r.num_samples_per_prompt, max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )


def replay_options(cfg: TrainConfig) -> dict[str, Any]:
    """vLLM's sampling transformations for the trainer to replay when scoring (disabled filters -> None)."""
    r = cfg.rollout
    top_k, top_p = active_filters(r.top_k, r.top_p)
    return {"temperature": r.temperature, "top_k": top_k, "top_p": top_p}


def engine_options(cfg: TrainConfig, model_dir: str, dtype: str | None = None, *, per_dp_group_gpu: bool = False,
                   data_parallel_size: int = 1) -> EngineOptions:
    """The rollout section's engine settings for `model_dir` (dtype overridable).

    `per_dp_group_gpu`: the GPU form of `rollout.placement=per_dp_group` (UNVERIFIED: no GPU vLLM here). Every
    rank of the job builds its shard of one engine per data-parallel group: vLLM tensor parallel over the
    group's `policy.tensor_parallel_size` ranks with `distributed_executor_backend="external_launcher"`, which
    joins the job's torch.distributed world (env:// from torchrun) and needs vLLM's world, tp x pp x dp, to be
    that world, so vLLM's `data_parallel_size` is the job's data-parallel size (its dp rank, RANK // tp, is the
    Megatron dp rank when pp = cp = 1); sleep mode frees the engine's GPU memory during training.
    """
    r = cfg.rollout
    if per_dp_group_gpu:
        return dataclasses.replace(
            engine_options(cfg, model_dir, dtype),
            tensor_parallel_size=cfg.policy.tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=True,
            # the worker side of `WeightTransferRefit` (rollout/refit/; CUDA IPC from the colocated trainer)
            extra={"weight_transfer_config": {"backend": "ipc"},
                   **({"data_parallel_size": data_parallel_size} if data_parallel_size > 1 else {})},
        )
    return EngineOptions(
        model_dir=model_dir,
        dtype=dtype or r.dtype,
        max_model_len=r.max_model_len,
        gpu_memory_utilization=r.gpu_memory_utilization,
        cpu_kvcache_space_gib=r.cpu_kvcache_space_gib,
        enforce_eager=r.enforce_eager,
        seed=cfg.rollout_seed,
        tensor_parallel_size=r.tensor_parallel_size,
        batch_invariant=r.batch_invariant,
        capture_routing=r.routing_replay == "r3",
        generate_timeout_s=r.generate_timeout_s,
        verify_refit=r.verify_refit,
        in_process=r.in_process,
        # policy.lora with rollout.lora_sync=adapter: the engine serves base + adapter, refits push the adapter only
        lora_rank=cfg.policy.lora.rank if adapter_sync(cfg) else 0,
        lora_alpha=cfg.policy.lora.alpha,
        quantization=r.quantization,
    )


def adapter_sync(cfg: TrainConfig) -> bool:
    """Whether weight syncs push the LoRA adapter only (`policy.lora.rank` > 0 and `rollout.lora_sync=adapter`);
    otherwise a LoRA policy pushes its merged weights `W + s B A` through the full refit."""
    return cfg.policy.lora.enabled and cfg.rollout.lora_sync == "adapter"


def tokenize_prompt(tokenizer: Any, text: str, use_chat_template: bool) -> list[int]:
    """Prompt token ids: the tokenizer's chat template (user turn + generation prompt) when asked and available."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def pad_token_id(tokenizer: Any) -> int:
    """The pad id (eos when the tokenizer has no pad token)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


__all__ = [
    "engine_options",
    "pad_token_id",
    "replay_options",
    "sampling_options",
    "tokenize_prompt",
]

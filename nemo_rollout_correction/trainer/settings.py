"""Shared by `nrc train` and `nrc audit`: engine/sampling/replay settings, tokenisation, rollout broadcast."""

from __future__ import annotations

import dataclasses
from typing import Any

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.runtime import broadcast_object
from nemo_rollout_correction.distributed.vocab_parallel import active_filters
from nemo_rollout_correction.rollout.vllm_engine import EngineOptions, RolloutBatch, RolloutSample, SamplingOptions


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


def engine_options(cfg: TrainConfig, model_dir: str, dtype: str | None = None) -> EngineOptions:
    """The rollout section's engine settings for `model_dir` (dtype overridable)."""
    r = cfg.rollout
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
    )


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


def broadcast_rollouts(batch: RolloutBatch | None, extra: Any = None) -> tuple[RolloutBatch, Any]:
    """Share the engine rank's rollouts (and `extra`, e.g. rewards) with every rank of the job.

    The engine rank (global rank 0) passes its batch; every other rank passes None. Samples travel as
    plain dicts (one `broadcast_object_list`); without torch.distributed this is the identity.
    """
    payload: Any = None
    if batch is not None:
        payload = ([dataclasses.asdict(s) for s in batch.samples], batch.n, batch.seconds, extra)
    received: Any = broadcast_object(payload, src=0)
    samples, n, seconds, extra = received
    return RolloutBatch([RolloutSample(**s) for s in samples], n=n, seconds=seconds), extra


__all__ = ["broadcast_rollouts", "engine_options", "pad_token_id", "replay_options", "sampling_options",
           "tokenize_prompt"]

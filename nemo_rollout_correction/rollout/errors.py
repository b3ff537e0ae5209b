"""The rollout engine's errors: one for an engine that failed, one for a refit that did not take."""

from __future__ import annotations


class RolloutEngineError(RuntimeError):
    """The rollout engine failed to start or to generate (the message says which and why)."""


class RefitVerificationError(RolloutEngineError):
    """After a weight sync the engine does not hold the trainer's weights (the message names engine and tensor)."""


__all__ = ["RefitVerificationError", "RolloutEngineError"]

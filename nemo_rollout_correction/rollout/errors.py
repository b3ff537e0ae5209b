"""The rollout engine's errors: one for an engine that failed, one for an engine process that died, one for a
refit that did not take."""

from __future__ import annotations


class RolloutEngineError(RuntimeError):
    """The rollout engine failed to start or to generate (the message says which and why)."""


class EngineProcessDiedError(RolloutEngineError):
    """An engine process of vLLM `engine` ended during `what`. `signals` maps the pid of each dead process killed
    by a signal to that signal's number (9, SIGKILL, is most likely the kernel's out-of-memory killer)."""

    def __init__(self, engine: str, what: str, dead: list[str], signals: dict[int, int]) -> None:
        self.engine, self.what, self.signals = engine, what, signals
        super().__init__(f"vLLM {engine}: its engine process died during {what} ({'; '.join(dead)}); "
                         "the run cannot go on without it")


class RefitVerificationError(RolloutEngineError):
    """After a weight sync the engine does not hold the trainer's weights (the message names engine and tensor)."""


__all__ = ["EngineProcessDiedError", "RefitVerificationError", "RolloutEngineError"]

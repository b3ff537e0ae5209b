"""Reward functions for tests/unit/test_reward_pool.py, at module level so spawned workers can import them."""

from __future__ import annotations

import os
import time
from typing import Any


def length_times_index(completions: list[str], records: list[Any], **_: Any) -> list[float]:
    """Depends on the completion and its record; sleeps a little so parallel calls finish out of order."""
    out = []
    for completion, record in zip(completions, records, strict=True):
        time.sleep(0.05 * (record.metadata["i"] % 3))
        out.append(len(completion) * 10.0 + record.metadata["i"])
    return out


def raises_on_bad(completions: list[str], **_: Any) -> list[float]:
    """ValueError on the completion 'bad', else 1.0."""
    for completion in completions:
        if completion == "bad":
            raise ValueError(f"cannot score {completion!r}")
    return [1.0] * len(completions)


def sleeps_on_slow(completions: list[str], **_: Any) -> list[float]:
    """Hangs (60 s) on the completion 'slow', else 0.5."""
    for completion in completions:
        if completion == "slow":
            time.sleep(60)
    return [0.5] * len(completions)


def dies_on_crash(completions: list[str], **_: Any) -> list[float]:
    """Kills its own process on the completion 'crash' (as a segfault in native code would)."""
    for completion in completions:
        if completion == "crash":
            os._exit(3)
    return [0.0] * len(completions)


def nan_on_bad(completions: list[str], **_: Any) -> list[float]:
    """NaN for 'bad', else 1.0."""
    return [float("nan") if c == "bad" else 1.0 for c in completions]


def pid_reward(completions: list[str], **_: Any) -> list[float]:
    """The worker's pid (to see that calls ran in other processes)."""
    return [float(os.getpid())] * len(completions)

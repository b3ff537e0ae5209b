"""Reward functions for bench_rewards.py, at module level so pool workers can import them."""

from __future__ import annotations

import time
from typing import Any


def sleep_reward(completions: list[str], records: list[Any], **_: Any) -> list[float]:
    """Waits `cost_ms` per completion (an I/O-bound reward: a verifier service, a sandbox)."""
    out = []
    for completion, record in zip(completions, records, strict=True):
        time.sleep(record.metadata["cost_ms"] / 1000)
        out.append(float(len(completion) + record.metadata["i"]))
    return out


def cpu_reward(completions: list[str], records: list[Any], **_: Any) -> list[float]:
    """Busy Python for `cost_ms` per completion (a CPU-bound reward: parsing, symbolic checking)."""
    out = []
    for completion, record in zip(completions, records, strict=True):
        end = time.perf_counter() + record.metadata["cost_ms"] / 1000
        count = 0
        while time.perf_counter() < end:
            count += 1
        out.append(float(len(completion) + record.metadata["i"]))
    return out

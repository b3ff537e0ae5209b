"""A multi-turn reward for tests/integration/test_multi_turn_async.py, at module level so reward workers can load it
(`task.reward_fn=<this file>:env_reward_plus_parity`)."""

from __future__ import annotations

import hashlib
from typing import Any


def env_reward_plus_parity(completions: list[str], records: list[Any], **_: Any) -> list[float]:
    """The environment's reward (`record.metadata["env_reward"]`: a KeyError if the multi-turn rollout's records did
    not reach the worker) plus 0 or 1 from a hash of the trajectory's text, so a random model's groups have reward
    variance (DAPO keeps them) while the environment reward alone would be 0 everywhere."""
    return [float(r.metadata["env_reward"]) + float(hashlib.sha1(c.encode()).digest()[0] % 2)
            for c, r in zip(completions, records, strict=True)]

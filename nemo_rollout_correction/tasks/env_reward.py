"""The reward of a multi-turn task, light enough for a reward worker: standard library only at import time.

A multi-turn rollout stores each trajectory's environment reward (the sum of what its environment returned) in
`record.metadata[ENV_REWARD_KEY]`; :func:`environment_reward` returns it. It lives apart from
tasks/environments.py (the environments and the fleet's seam, which import torch and the engine's batch types)
because `task.reward_workers >= 1` loads the reward function by name in freshly spawned processes: importing this
module there costs milliseconds, importing environments.py costs torch's import, which on a loaded machine can take
a large part of the pool's startup bound (`RewardPool(startup_timeout_s=...)`). tests/unit/test_env_reward.py checks
that a fresh interpreter importing it loads no torch, megatron or vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: tasks/prompts.py imports numpy
    from nemo_rollout_correction.tasks.prompts import PromptRecord

__all__ = ["ENV_REWARD_KEY", "environment_reward"]

ENV_REWARD_KEY = "env_reward"
"""The `PromptRecord.metadata` key holding a multi-turn trajectory's environment reward."""


def environment_reward(records: Sequence[PromptRecord], **unused: Any) -> list[float]:
    """The reward of a multi-turn task: each trajectory's environment reward (`record.metadata["env_reward"]`,
    set by the multi-turn rollout). Raises ValueError for a record without it (not from a multi-turn rollout)."""
    del unused
    out: list[float] = []
    for index, record in enumerate(records):
        if ENV_REWARD_KEY not in record.metadata:
            raise ValueError(f"environment_reward: record {index} has no metadata[{ENV_REWARD_KEY!r}]; it scores "
                             "multi-turn rollouts only (a task with an environment)")
        out.append(float(record.metadata[ENV_REWARD_KEY]))
    return out

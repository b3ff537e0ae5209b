"""nemo_rollout_correction: measure and correct the rollout/training probability mismatch.

The public names below are imported on first use (PEP 562 `__getattr__`), not when the package is: importing
any submodule imports this package first, and a light submodule (the multi-turn reward a spawned reward worker
loads, tasks/env_reward.py) must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_rollout_correction.core.config import RolloutCorrectionConfig
    from nemo_rollout_correction.core.correction import RolloutCorrectionOutput, compute_rollout_correction

__all__ = ["RolloutCorrectionConfig", "RolloutCorrectionOutput", "compute_rollout_correction"]
__version__ = "0.1.0"

_LAZY = {"RolloutCorrectionConfig": "nemo_rollout_correction.core.config",
         "RolloutCorrectionOutput": "nemo_rollout_correction.core.correction",
         "compute_rollout_correction": "nemo_rollout_correction.core.correction"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

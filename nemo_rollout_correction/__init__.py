"""nemo_rollout_correction: measure and correct the rollout/training probability mismatch."""

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import RolloutCorrectionOutput, compute_rollout_correction

__all__ = ["RolloutCorrectionConfig", "RolloutCorrectionOutput", "compute_rollout_correction"]
__version__ = "0.1.0"

"""MLflow tracking for training runs: outage-tolerant logging, replay, review plots and tables.

Imports are light: mlflow, matplotlib and pyarrow load only when a tracker starts or a review
artifact is written, so `import nemo_rollout_correction.tracking` works without the `mlflow` extra.
"""

from .errors import TrackingUnavailableError
from .mlflow_tracker import MlflowTracker, default_tracking_uri
from .params import flatten_config
from .replay import ReplayResult, pending_records, replay_buffer

__all__ = [
    "MlflowTracker",
    "ReplayResult",
    "TrackingUnavailableError",
    "default_tracking_uri",
    "flatten_config",
    "pending_records",
    "replay_buffer",
]

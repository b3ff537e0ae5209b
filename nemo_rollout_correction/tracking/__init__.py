"""MLflow tracking for training runs: outage-tolerant logging, replay, review plots and tables.

Three modules: `tracker` (MlflowTracker, config flattening, run tags, system metrics), `delivery` (the
on-disk journal, delivery to the store, the background sender, replay) and `review` (plots, the
worst-sequences table, the review step); `replay` is the command line of a later delivery, `store_lock`
the lock that lets runs started at once share one sqlite store.

Imports are light: mlflow, matplotlib and pyarrow load only when a tracker starts or a review
artifact is written, so `import nemo_rollout_correction.tracking` works without the `mlflow` extra.
"""

from nemo_rollout_correction.tracking.delivery import (
    ReplayResult,
    TrackingUnavailableError,
    pending_records,
    replay_buffer,
)
from nemo_rollout_correction.tracking.tracker import MlflowTracker, default_tracking_uri, flatten_config

__all__ = [
    "MlflowTracker",
    "ReplayResult",
    "TrackingUnavailableError",
    "default_tracking_uri",
    "flatten_config",
    "pending_records",
    "replay_buffer",
]

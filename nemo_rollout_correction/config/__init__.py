"""Typed configuration of `nrc train`, `nrc audit` and `nrc launch` (schema + Hydra loader).

    from nemo_rollout_correction.config import load_config
    cfg = load_config(["model=tiny_llama", "rollout_correction=decoupled_geo_rs", "policy.lr=3e-6"])
    cfg.policy.lr, cfg.to_rollout_correction_config()

Layer: above models/rollout, below trainer/tracking; imports only nemo_rollout_correction.core.
"""

from nemo_rollout_correction.config.loader import (
    available_groups,
    config_show,
    default_conf_dir,
    from_dict,
    load_config,
    load_yaml,
    to_dict,
    to_flat_dict,
    to_yaml,
)
from nemo_rollout_correction.config.schema import (
    AuditConfig,
    CheckpointConfig,
    ConfigError,
    GRPOConfig,
    LauncherConfig,
    ModelConfig,
    PolicyConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
)

__all__ = [
    "AuditConfig",
    "CheckpointConfig",
    "ConfigError",
    "GRPOConfig",
    "LauncherConfig",
    "ModelConfig",
    "PolicyConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "available_groups",
    "config_show",
    "default_conf_dir",
    "from_dict",
    "load_config",
    "load_yaml",
    "to_dict",
    "to_flat_dict",
    "to_yaml",
]

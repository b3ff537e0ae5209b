"""Typed configuration of `nrc train`, `nrc audit` and `nrc launch` (schema + Hydra loader).

    from nemo_rollout_correction.config import load_config
    cfg = load_config(["model=tiny_llama", "rollout_correction=decoupled_geo_rs", "policy.lr=3e-6"])
    cfg.policy.lr, cfg.rollout_correction

Layer: above models/rollout, below trainer/tracking. The loader's names are imported on first use
(PEP 562), so `config.schema` and `config.redaction` work without the `config` extra (hydra-core, pyyaml):
the launcher and the tracker import them.
"""

from typing import TYPE_CHECKING, Any

from nemo_rollout_correction.config.schema import (
    AuditConfig,
    CheckpointConfig,
    ConfigError,
    EvalConfig,
    ExportConfig,
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
    "EvalConfig",
    "ExportConfig",
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

_LOADER_NAMES = frozenset({"available_groups", "config_show", "default_conf_dir", "from_dict", "load_config",
                           "load_yaml", "to_dict", "to_flat_dict", "to_yaml"})

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        from nemo_rollout_correction.config import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

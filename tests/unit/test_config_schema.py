"""The schema dataclasses: ranges and cross-field rules on direct construction, help on every field."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.config import (
    ConfigError,
    GRPOConfig,
    LauncherConfig,
    ModelConfig,
    PolicyConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
)
from nemo_rollout_correction.config.convert import build, dotted_keys, suggest_key
from nemo_rollout_correction.core.aggregation import LOSS_AGG_MODES


@pytest.mark.parametrize(("cls", "kwargs", "fragment"), [
    (PolicyConfig, {"tensor_parallel_size": 0}, "policy.tensor_parallel_size=0 is not allowed: must be >= 1"),
    (PolicyConfig, {"context_parallel_size": -2}, "policy.context_parallel_size=-2"),
    (PolicyConfig, {"lr": 0.0}, "policy.lr=0.0"),
    (PolicyConfig, {"adam_beta2": 1.0}, "policy.adam_beta2=1.0 is not allowed: must be in [0, 1)"),
    (PolicyConfig, {"grad_clip": -1.0}, "policy.grad_clip=-1.0"),
    (RolloutConfig, {"top_p": 0.0}, "rollout.top_p=0.0 is not allowed: must be in (0, 1]"),
    (RolloutConfig, {"top_p": 1.5}, "rollout.top_p=1.5"),
    (RolloutConfig, {"temperature": 0.0}, "rollout.temperature=0.0"),
    (RolloutConfig, {"top_k": 0}, "rollout.top_k=0 is not allowed: must be -1 (disabled) or >= 1"),
    (RolloutConfig, {"gpu_memory_utilization": 0.0}, "rollout.gpu_memory_utilization=0.0"),
    (RolloutConfig, {"gpu_memory_utilization": 1.2}, "rollout.gpu_memory_utilization=1.2"),
    (GRPOConfig, {"clip_ratio_low": 1.0}, "grpo.clip_ratio_low=1.0"),
    (GRPOConfig, {"kl_coef": -0.1}, "grpo.kl_coef=-0.1"),
    (TaskConfig, {"reward_fn": "no_callable"}, "task.reward_fn='no_callable'"),
    (TaskConfig, {"num_prompts": 2}, "task.num_prompts=2 is not allowed: must be >= task.prompts_per_step (4)"),
    (TaskConfig, {"name": "dataset"}, "task.dataset_path=null"),
    (LauncherConfig, {"time": "1h"}, "launcher.time='1h'"),
    (LauncherConfig, {"container_mounts": ["/data"]}, "launcher.container_mounts[0]='/data'"),
    (LauncherConfig, {"nodes": 2}, "use launcher=slurm"),
    (RunConfig, {"num_steps": 0}, "run.num_steps=0"),
    (RunConfig, {"name": " "}, "run.name=' '"),
    (ModelConfig, {"source": "llama"}, "model.source='llama'"),
])
def test_range_errors_name_key_value_and_rule(cls: type, kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("cls", "kwargs"), [
    (ModelConfig, {"source": "/models/my-llama"}),
    (ModelConfig, {"source": "./ckpt"}),
    (RolloutConfig, {"top_k": 50, "top_p": 0.9, "temperature": 0.7}),
    (PolicyConfig, {"grad_clip": 0.0}),
    (LauncherConfig, {"name": "slurm", "nodes": 4, "time": "2-00:00:00", "container_mounts": ["/a:/b:ro"]}),
    (TaskConfig, {"name": "dataset", "dataset_path": "p.jsonl", "num_prompts": 1}),
])
def test_valid_edge_values_are_accepted(cls: type, kwargs: dict[str, Any]) -> None:
    cls(**kwargs)


def test_cross_section_rules() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.num_samples_per_prompt=1 .*>= 2"):
        TrainConfig(rollout=RolloutConfig(num_samples_per_prompt=1))
    cfg = TrainConfig(policy=PolicyConfig(tensor_parallel_size=2, micro_batch_size=4),
                      launcher=LauncherConfig(nproc_per_node=4))
    assert cfg.data_parallel_size(4) == 2
    cfg.check_world_size(8)  # dp 4: 16 rollouts / (4 x 4)
    with pytest.raises(ConfigError, match="world size 5 is not divisible"):
        cfg.check_world_size(5)
    with pytest.raises(ConfigError, match=r"= 4 x 16 = 64"):
        cfg.check_world_size(32)  # dp 16: 16 rollouts cannot fill 16 ranks x 4


def test_resolved_views() -> None:
    cfg = TrainConfig(run=RunConfig(output_dir="/out", seed=5))
    assert cfg.rollout_seed == 5
    assert cfg.tracking_uri == "sqlite:////out/mlflow.db"
    assert cfg.checkpoint_dir == "/out/checkpoints"
    assert cfg.rollout_correction == RolloutCorrectionConfig.from_preset("token_tis")


def test_every_field_has_help() -> None:
    for section in dataclasses.fields(TrainConfig):
        assert section.metadata.get("help"), section.name
        cls = typing.get_type_hints(TrainConfig)[section.name]
        if issubclass(cls, RolloutCorrectionConfig):  # + `alert`, a sub-section with help on every key
            for f in dataclasses.fields(typing.get_type_hints(cls)["alert"]):
                assert f.metadata.get("help", "").strip(), f"{section.name}.alert.{f.name} has no help"
            continue  # core's class documents each field with an attribute docstring (see docgen)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help", "").strip(), f"{section.name}.{f.name} has no help"


def test_literals_come_from_core() -> None:
    tp = typing.get_type_hints(GRPOConfig)["loss_agg_mode"]
    assert typing.get_args(tp) == LOSS_AGG_MODES


def test_model_source_accepts_exactly_the_builtin_model_sources() -> None:
    from nemo_rollout_correction.models import sources

    for name in sources.BUILTIN_SOURCES:
        assert ModelConfig(source=name).source == name
    with pytest.raises(ConfigError, match=r"did you mean 'tiny-llama'"):
        ModelConfig(source="tiny-lama")


def test_task_names_are_the_task_literal() -> None:
    from nemo_rollout_correction.tasks import builtin

    assert typing.get_args(typing.get_type_hints(TaskConfig)["name"]) == builtin.TASK_NAMES


def test_build_accepts_partial_data_and_rejects_bad_types() -> None:
    cfg = build(TrainConfig, {"policy": {"lr": 1}})
    assert cfg.policy.lr == 1.0 and isinstance(cfg.policy.lr, float)
    with pytest.raises(ConfigError, match=r"policy\.tensor_parallel_size expects int, got True \(bool\)"):
        build(TrainConfig, {"policy": {"tensor_parallel_size": True}})
    with pytest.raises(ConfigError, match=r"rollout_correction\.rollout_rs_threshold expects str \| float \| null"):
        build(TrainConfig, {"rollout_correction": {"rollout_rs_threshold": [1]}})
    rc = build(TrainConfig, {"rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": 2}})
    assert rc.rollout_correction.rollout_rs_threshold == 2.0


def test_suggest_key_at_several_depths() -> None:
    assert suggest_key("rollot", TrainConfig) == "rollout"
    assert suggest_key("rollout.temprature", TrainConfig) == "rollout.temperature"
    assert suggest_key("task.dataset_pth", TrainConfig) == "task.dataset_path"
    assert suggest_key("grpo.micro_batch_size", TrainConfig) == "policy.micro_batch_size"
    assert suggest_key("policy.qqq", TrainConfig) is None
    assert len(list(dotted_keys(TrainConfig))) == len(set(dotted_keys(TrainConfig)))

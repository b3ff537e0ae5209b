"""Config flattening and MLflow name/size rules (tracking/tracker.py): pure functions, hand-derived expectations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from default_lane import require

from nemo_rollout_correction.tracking.tracker import (
    MAX_KEY_LENGTH,
    MAX_PARAM_VALUE_LENGTH,
    TRUNCATION_MARKER,
    check_metric_name,
    flatten_config,
    is_valid_name,
    sanitize_key,
    to_float,
    truncate_value,
)


def test_flatten_nested_dotted_keys_and_json_leaves() -> None:
    config = {
        "run": {"name": "grpo", "seed": 1234, "resume": False},
        "policy": {"lr": 1e-5, "micro_batch_size": 8},
        "tracking": {"tracking_uri": None},
        "launcher": {"container_mounts": ["/a:/a", "/b:/b"], "extra": {}},
        "rollout_correction": {"rollout_is": "token", "bounds": {"upper": 2.0}},
    }
    assert flatten_config(config) == {
        "run.name": "grpo",
        "run.seed": "1234",
        "run.resume": "false",
        "policy.lr": "1e-05",
        "policy.micro_batch_size": "8",
        "tracking.tracking_uri": "null",
        "launcher.container_mounts": '["/a:/a", "/b:/b"]',
        "launcher.extra": "{}",
        "rollout_correction.rollout_is": "token",
        "rollout_correction.bounds.upper": "2.0",
    }


def test_omegaconf_containers_flatten_like_plain_ones() -> None:
    omegaconf = require("omegaconf", "config")
    config = omegaconf.OmegaConf.create({"launcher": {"container_mounts": ["/a:/a"], "partition": None}})
    assert flatten_config(config) == {"launcher.container_mounts": '["/a:/a"]', "launcher.partition": "null"}


def test_long_values_are_truncated_to_the_mlflow_limit_with_a_marker() -> None:
    flat = flatten_config({"prompt": "x" * 10_000})
    assert len(flat["prompt"]) == MAX_PARAM_VALUE_LENGTH
    assert flat["prompt"].endswith(TRUNCATION_MARKER)
    assert truncate_value("short", 10) == "short"


def test_sanitize_key_keeps_valid_keys_and_fixes_invalid_ones() -> None:
    assert sanitize_key("policy.lr") == "policy.lr"
    assert sanitize_key("weird key:ok/x") == "weird key:ok/x"
    assert sanitize_key("a$b#c") == "a_b_c"
    assert sanitize_key("/abs//path/../x") == "abs/path/_/x"
    long_a, long_b = "a" * 300, "a" * 299 + "b"
    assert len(sanitize_key(long_a)) == MAX_KEY_LENGTH
    assert sanitize_key(long_a) != sanitize_key(long_b)  # hash suffix keeps long keys apart
    for key in ("a$b#c", "/abs//path/../x", long_a):
        assert is_valid_name(sanitize_key(key))


@pytest.mark.parametrize("name", ["reward/mean", "rollout_corr/is_weight_p99", "timing/step s", "a:b-c.d"])
def test_valid_metric_names_pass(name: str) -> None:
    assert check_metric_name(name) == name


@pytest.mark.parametrize("name", ["", "a//b", "/a", "../a", "a/", "a$b", "x" * 251, 3])
def test_invalid_metric_names_raise_naming_the_key(name: object) -> None:
    with pytest.raises(ValueError, match="invalid metric name"):
        check_metric_name(name)


def test_to_float_accepts_numbers_numpy_and_tensors_and_names_bad_values() -> None:
    assert to_float("a", 3) == 3.0
    assert to_float("a", np.float32(0.5)) == 0.5
    assert to_float("a", torch.tensor(2.5)) == 2.5
    assert to_float("a", True) == 1.0
    assert np.isnan(to_float("a", float("nan")))
    with pytest.raises(TypeError, match="metric 'loss/total'"):
        to_float("loss/total", "high")
    with pytest.raises(TypeError, match="metric 'v'"):
        to_float("v", torch.ones(3))

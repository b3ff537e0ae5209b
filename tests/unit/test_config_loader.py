"""load_config: Hydra composition of conf/ plus our strict conversion and one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.config import (
    ConfigError,
    TrainConfig,
    available_groups,
    config_show,
    from_dict,
    load_config,
    load_yaml,
    to_dict,
    to_flat_dict,
    to_yaml,
)
from nemo_rollout_correction.config.convert import dotted_keys
from nemo_rollout_correction.config.mismatch_alert import RolloutCorrectionSection

CONF = Path(__file__).resolve().parents[2] / "conf"


def _error(overrides: list[str], config_dir: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, config_dir)
    message = str(info.value)
    assert "\n" not in message, f"error is not one line: {message!r}"
    return message


# ---- defaults, overrides, groups ------------------------------------------------------------


def test_defaults_are_the_schema_defaults_with_output_dir_resolved() -> None:
    cfg = load_config([])
    expected = TrainConfig()
    expected = dataclasses.replace(expected, run=dataclasses.replace(expected.run, output_dir="runs/grpo-default"))
    assert cfg == expected
    assert cfg.rollout_correction == RolloutCorrectionConfig.from_preset("token_tis")
    assert cfg.model.source == "smollm2-135m" and cfg.task.name == "length_target" and cfg.launcher.name == "local"


def test_default_run_has_the_production_mismatch() -> None:
    # The default run must show the problem the package exists for: a bf16 engine against the fp32 trainer.
    cfg = load_config([])
    assert cfg.rollout.dtype == "bfloat16"
    assert cfg.model.dtype == "float32"  # the trainer


def test_overrides_set_typed_values() -> None:
    cfg = load_config([
        "policy.lr=3e-6",
        "policy.grad_clip=2",  # an int for a float key becomes a float
        "rollout.seed=7",
        "run.name=2024",  # a number for a text key is its text
        "rollout.dtype=float16",
        "tracking.tracking_uri=http://127.0.0.1:5000",
        "launcher.container_mounts=[/data:/data,/ckpt:/ckpt:ro]",
        "task.reward_fn=my_pkg.rewards:exact_match",
    ])
    assert cfg.policy.lr == 3e-6
    assert cfg.policy.grad_clip == 2.0 and isinstance(cfg.policy.grad_clip, float)
    assert cfg.rollout.seed == 7 and cfg.rollout_seed == 7
    assert cfg.run.name == "2024" and cfg.run.output_dir == "runs/2024"
    assert cfg.rollout.dtype == "float16"
    assert cfg.tracking_uri == "http://127.0.0.1:5000"
    assert cfg.launcher.container_mounts == ["/data:/data", "/ckpt:/ckpt:ro"]
    assert cfg.task.reward_fn == "my_pkg.rewards:exact_match"


def test_group_selection() -> None:
    cfg = load_config(["model=tiny_llama", "task=length_target", "parallelism=tp2", "launcher=slurm"])
    assert cfg.model.source == "tiny-llama"
    assert cfg.task.name == "length_target"
    assert (cfg.policy.tensor_parallel_size, cfg.launcher.nproc_per_node, cfg.launcher.name) == (2, 2, "slurm")
    assert cfg.data_parallel_size(cfg.launcher.world_size) == 1


@pytest.mark.parametrize(("option", "tp", "world", "dp"),
                         [("single", 1, 1, 1), ("tp2", 2, 2, 1), ("dp2", 1, 2, 2), ("tp2_dp2", 2, 4, 2)])
def test_parallelism_options(option: str, tp: int, world: int, dp: int) -> None:
    cfg = load_config([f"parallelism={option}"])
    assert cfg.policy.tensor_parallel_size == tp
    assert cfg.launcher.world_size == world
    assert cfg.data_parallel_size(world) == dp


def test_every_group_option_in_conf_loads() -> None:
    groups = available_groups()
    assert set(groups) == {"launcher", "model", "parallelism", "rollout_correction", "task"}
    for group, options in groups.items():
        if group == "rollout_correction":
            continue  # every preset: test_every_rollout_correction_preset_equals_the_python_preset
        for option in options:
            extra = ["task.dataset_path=data/prompts.jsonl"] if (group, option) == ("task", "dataset") else []
            cfg = load_config([f"{group}={option}", *extra])
            if group == "task":
                assert cfg.task.name == option
            if group == "launcher":
                assert cfg.launcher.name == option


@pytest.mark.parametrize("name", RolloutCorrectionConfig.preset_names())
def test_every_rollout_correction_preset_equals_the_python_preset(name: str) -> None:
    loaded = load_config([f"rollout_correction={name}"]).rollout_correction
    expected = RolloutCorrectionConfig.from_preset(name)
    for field_name in RolloutCorrectionConfig.field_names():
        assert getattr(loaded, field_name) == getattr(expected, field_name), (name, field_name)
    assert loaded == expected
    assert loaded.rejection_criteria == expected.rejection_criteria


def test_preset_then_single_field_override() -> None:
    cfg = load_config(["rollout_correction=decoupled_geo_rs", "rollout_correction.rollout_is=token",
                       "rollout_correction.rollout_is_threshold=3"])
    expected = RolloutCorrectionConfig.from_preset("decoupled_geo_rs", rollout_is="token", rollout_is_threshold=3.0)
    assert cfg.rollout_correction == expected
    assert cfg.rollout_correction.rollout_rs_threshold == "0.999_1.001"  # stays text, not a number


def test_interpolation_of_output_dir_and_derived_paths() -> None:
    cfg = load_config(["run.name=geo"])
    assert cfg.run.output_dir == "runs/geo"
    assert cfg.tracking_uri == "sqlite:///runs/geo/mlflow.db"
    assert cfg.checkpoint_dir == "runs/geo/checkpoints"
    cfg = load_config(["run.name=geo", "run.output_dir=/scratch/${run.name}/out", "checkpoint.dir=/ckpt"])
    assert cfg.run.output_dir == "/scratch/geo/out"
    assert cfg.checkpoint_dir == "/ckpt"
    assert cfg.rollout_seed == cfg.run.seed


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "bad", "suggestion"), [
    ("policy.tensor_paralel_size=2", "policy.tensor_paralel_size", "policy.tensor_parallel_size"),
    ("polciy.lr=1e-6", "polciy.lr", "policy.lr"),
    ("policy.temperature=0.5", "policy.temperature", "rollout.temperature"),  # the right key, wrong section
    ("rollout_corection=token_tis", "rollout_corection", "rollout_correction"),
    ("+rollout_correction.rollout_is_treshold=3", "rollout_correction.rollout_is_treshold",
     "rollout_correction.rollout_is_threshold"),
    ("+launcher.nprocs_per_node=2", "launcher.nprocs_per_node", "launcher.nproc_per_node"),
])
def test_unknown_key_names_it_and_suggests_the_closest(override: str, bad: str, suggestion: str) -> None:
    message = _error([override])
    assert f"unknown key '{bad}'" in message
    assert f"did you mean '{suggestion}'?" in message


def test_unknown_key_without_a_close_match_lists_the_section() -> None:
    message = _error(["+policy.zzz=1"])
    assert "unknown key 'policy.zzz'" in message and "did you mean" not in message
    assert "micro_batch_size" in message


@pytest.mark.parametrize(("override", "fragments"), [
    ("policy.lr=abc", ["policy.lr expects float", "'abc'"]),
    ("policy.micro_batch_size=2.5", ["policy.micro_batch_size expects int", "2.5"]),
    ("run.resume=yes", ["run.resume expects bool", "'yes'"]),
    ("run.name=true", ["run.name expects str", "True", "run.name='true'"]),
    ("launcher.container_mounts=5", ["launcher.container_mounts expects list[str]", "5"]),
    ("rollout.seed=[1]", ["rollout.seed expects int | null", "[1]"]),
])
def test_wrong_type_names_key_expected_type_and_value(override: str, fragments: list[str]) -> None:
    message = _error([override])
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(("override", "fragments"), [
    ("rollout.dtype=fp16", ["rollout.dtype='fp16'", "'float32', 'bfloat16', 'float16'"]),
    ("grpo.loss_agg_mode=token_mean", ["grpo.loss_agg_mode", "did you mean 'token-mean'?"]),
    ("rollout_correction.rollout_is=tokn", ["rollout_correction.rollout_is='tokn'", "'geometric'"]),
    ("task.name=math", ["task.name='math'", "'arithmetic', 'length_target', 'dataset'"]),
])
def test_disallowed_literal_lists_the_allowed_values(override: str, fragments: list[str]) -> None:
    message = _error([override])
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(("override", "fragments"), [
    ("rollout_correction=token_tsi", ["unknown rollout_correction option 'token_tsi'", "did you mean 'token_tis'",
                                      "decoupled_geo_rs"]),
    ("model=tiny-llama", ["unknown model option 'tiny-llama'", "did you mean 'tiny_llama'"]),
    ("parallelism=tp4", ["unknown parallelism option 'tp4'", "tp2_dp2"]),
])
def test_misspelled_group_option_lists_close_matches(override: str, fragments: list[str]) -> None:
    message = _error([override])
    for fragment in fragments:
        assert fragment in message, message


def test_bad_override_syntax_is_one_line_naming_the_override() -> None:
    message = _error(["run.name=ok", "policy.lr=[1,2"])
    assert message.startswith("cannot parse override 'policy.lr=[1,2'")


def test_hydra_value_errors_become_one_line_config_errors() -> None:
    assert "rollout_correction=null" in _error(["rollout_correction=null"])


def test_bad_interpolation_names_the_key() -> None:
    message = _error(["run.output_dir=/x/${run.nam}"])
    assert message.startswith("run.output_dir:") and "run.nam" in message


@pytest.mark.parametrize(("overrides", "fragments"), [
    (["rollout.num_samples_per_prompt=1"], ["rollout.num_samples_per_prompt=1", ">= 2"]),
    (["task=dataset"], ["task.dataset_path=null", "task.dataset_path=/path/to/prompts.jsonl"]),
    (["policy.micro_batch_size=5"], ["16 rollouts per step", "policy.micro_batch_size x data-parallel size = 5 x 1"]),
    (["parallelism=dp2", "policy.micro_batch_size=32"], ["= 32 x 2 = 64"]),
    (["parallelism=tp2", "launcher.nproc_per_node=3"], ["world size 3", "= 2"]),
    (["rollout_correction.rollout_is_threshold=0.5"], ["rollout_correction:", "rollout_is_threshold"]),
    (["rollout.max_new_tokens=600"], ["rollout.max_new_tokens=600", "rollout.max_model_len (512)"]),
    (["model.source=smolm2"], ["model.source='smolm2'", "did you mean 'smollm2-135m'?"]),
])
def test_cross_field_rules_through_the_loader(overrides: list[str], fragments: list[str]) -> None:
    message = _error(overrides)
    for fragment in fragments:
        assert fragment in message, message


def test_every_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# ---- serialisation ---------------------------------------------------------------------------


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(["model=tiny_llama", "rollout_correction=decoupled_k3_rs_seq_tis", "run.name=rt",
                       "launcher.container_mounts=[/a:/b]", "rollout.seed=3", "policy.lr=2e-6"])
    text = to_yaml(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert load_yaml(path) == cfg
    assert from_dict(yaml.safe_load(text)) == cfg
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)


def test_flat_dict_has_every_dotted_key() -> None:
    flat = to_flat_dict(load_config(["launcher.container_mounts=[/a:/b,/c:/d]"]))
    assert list(flat) == list(dotted_keys(TrainConfig))
    assert yaml.safe_load(flat["launcher.container_mounts"]) == ["/a:/b", "/c:/d"]
    assert flat["policy.lr"] == 3e-5


def test_from_dict_is_strict_and_fills_defaults() -> None:
    cfg = from_dict({"run": {"name": "x"}, "rollout_correction": {"rollout_is": "sequence"}})
    assert cfg.run.output_dir == "runs/x"
    assert cfg.rollout_correction.rollout_is == "sequence"
    with pytest.raises(ConfigError, match=r"unknown key 'run\.nmae'; did you mean 'run\.name'\?"):
        from_dict({"run": {"nmae": "x"}})
    with pytest.raises(ConfigError, match="run is a section"):
        from_dict({"run": 3})


def test_config_show_prints_the_resolved_yaml() -> None:
    text = config_show(["run.name=geo", "rollout_correction=geo_rs"])
    data = yaml.safe_load(text)
    assert data["run"]["output_dir"] == "runs/geo"
    assert data["rollout_correction"] == RolloutCorrectionSection.from_preset("geo_rs").to_dict()  # + `alert`


# ---- user config directory -------------------------------------------------------------------


def test_user_dir_adds_and_replaces_group_options(tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "mine.yaml").write_text("name: length_target\ntarget_length: 7\n")
    (tmp_path / "task" / "arithmetic.yaml").write_text("name: arithmetic\nmax_operand: 99\n")
    assert load_config(["task=arithmetic"], tmp_path).task.max_operand == 99  # replaces conf/task/arithmetic.yaml
    mine = load_config(["task=mine"], tmp_path).task
    assert (mine.name, mine.target_length) == ("length_target", 7)
    assert "did you mean 'mine'" in _error(["task=mien"], tmp_path)
    assert load_config(["task=arithmetic"]).task.max_operand == 10  # conf/ alone is unaffected


def test_user_dir_with_its_own_root(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        "defaults:\n  - nrc_defaults\n  - model: tiny_llama\n  - _self_\nrun:\n  name: mine\n"
    )
    cfg = load_config([], tmp_path)
    assert (cfg.run.name, cfg.run.output_dir, cfg.model.source) == ("mine", "runs/mine", "tiny-llama")
    assert "+rollout_correction=<option>" in _error(["rollout_correction=geo_rs"], tmp_path)
    assert load_config(["+rollout_correction=geo_rs"], tmp_path).rollout_correction.rollout_rs == "seq_mean_k1"
    (tmp_path / "config.yaml").write_text("run:\n  nmae: typo\n")
    assert "did you mean 'run.name'" in _error([], tmp_path)


def test_missing_user_dir() -> None:
    assert "does not exist" in _error([], Path("/nonexistent/nrc-conf"))

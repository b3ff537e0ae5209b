"""Resume safety (trainer.resume_check) on real configs from the loader: one message naming every differing key."""

from __future__ import annotations

import pytest

from nemo_rollout_correction.config.loader import load_config, to_dict
from nemo_rollout_correction.config.redaction import redact_tree
from nemo_rollout_correction.trainer.resume_check import check_resume, incompatible_keys


def _cfg(*overrides: str) -> dict[str, object]:
    tree: dict[str, object] = redact_tree(to_dict(load_config(["model=tiny_llama", *overrides])))
    return tree


def test_same_config_resumes() -> None:
    check_resume("ck/step_2", _cfg(), _cfg())


def test_layout_length_and_bookkeeping_may_change() -> None:
    saved = _cfg("policy.tensor_parallel_size=2", "launcher.nproc_per_node=2", "run.num_steps=2",
                 "checkpoint.keep_last=1")
    now = _cfg("policy.pipeline_parallel_size=2", "launcher.nproc_per_node=4", "policy.micro_batch_size=4",
               "run.num_steps=8", "tracking.enabled=false", "checkpoint.every_n_steps=1", "run.log_every=3",
               "checkpoint.save_optimizer=false", "checkpoint.async_save=true", "rollout.placement=rank0",
               "policy.max_tokens_per_microbatch=256")
    assert incompatible_keys(saved, now) == {}
    # a checkpoint of the padded path (policy.sequence_packing=false, the default before packing was) resumes packed
    assert incompatible_keys(_cfg("policy.sequence_packing=false"), _cfg()) == {}


def test_model_task_and_objective_changes_are_named_in_one_message() -> None:
    saved = _cfg()
    now = _cfg("model.dtype=bfloat16", "task.prompts_per_step=8", "policy.lr=1e-3", "rollout_correction=seq_is")
    differing = incompatible_keys(saved, now)
    assert {"model.dtype", "task.prompts_per_step", "policy.lr"} <= differing.keys()
    assert any(key.startswith("rollout_correction.") for key in differing)
    assert differing["model.dtype"] == ("float32", "bfloat16")
    with pytest.raises(ValueError) as err:
        check_resume("ck/step_2", saved, now)
    message = str(err.value)
    assert message.startswith(f"cannot resume from ck/step_2: {len(differing)} config key(s) differ")
    for key in differing:
        assert key in message
    assert "checkpoint 'float32', now 'bfloat16'" in message


def test_another_model_source_refuses() -> None:
    saved, now = _cfg(), _cfg("model.source=/data/other_model")
    assert incompatible_keys(saved, now) == {"model.source": ("tiny-llama", "/data/other_model")}


def test_switching_the_distributed_optimizer_needs_a_weights_only_checkpoint() -> None:
    saved, now = _cfg(), _cfg("policy.use_distributed_optimizer=true")
    assert list(incompatible_keys(saved, now, has_optimizer=True)) == ["policy.use_distributed_optimizer"]
    assert incompatible_keys(saved, now, has_optimizer=False) == {}


def test_a_key_missing_on_one_side_counts() -> None:
    saved = _cfg()
    now = {**saved, "grpo": {**saved["grpo"], "new_knob": 1}}  # type: ignore[dict-item]
    assert incompatible_keys(saved, now) == {"grpo.new_knob": ("<absent>", 1)}


def test_a_key_newer_than_the_checkpoint_reads_as_its_default() -> None:
    """A checkpoint written before `grpo.new_knob` existed resumes while the knob keeps its default, and refuses
    (naming it) when the resuming run sets another value."""
    now = _cfg()
    saved = {**now, "grpo": {k: v for k, v in now["grpo"].items() if k != "num_mini_batches"}}  # type: ignore[attr-defined]
    defaults = _cfg()
    assert incompatible_keys(saved, now) == {"grpo.num_mini_batches": ("<absent>", 1)}
    assert incompatible_keys(saved, now, defaults=defaults) == {}
    changed = _cfg("grpo.num_mini_batches=2", "policy.micro_batch_size=4")
    assert incompatible_keys(saved, changed, defaults=defaults)["grpo.num_mini_batches"] == (1, 2)

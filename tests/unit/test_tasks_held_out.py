"""The built-in tasks' held-out splits: disjoint from training, seeded, and training unchanged without one."""

from __future__ import annotations

import pytest

from nemo_rollout_correction.tasks.builtin import (
    LENGTH_TARGET_HELD_OUT_INSTRUCTIONS,
    LENGTH_TARGET_INSTRUCTIONS,
    arithmetic_records,
    arithmetic_split,
    build_task,
)


@pytest.mark.parametrize("max_operand", [10, 1000])  # enumerated and rejection-sampled problem spaces
def test_arithmetic_held_out_is_disjoint_and_seeded(max_operand: int) -> None:
    train, held = arithmetic_split(256, 16, max_operand=max_operand, seed=3)
    assert len(train) == 256 and len(held) == 16
    assert len({r.prompt for r in held}) == 16
    assert not {r.prompt for r in held} & {r.prompt for r in train}
    again = arithmetic_split(256, 16, max_operand=max_operand, seed=3)
    assert [r.prompt for r in again[1]] == [r.prompt for r in held]
    assert [r.prompt for r in arithmetic_split(256, 16, max_operand=max_operand, seed=4)[1]] != [r.prompt for r in held]
    assert all(int(r.answer or "") == (r.metadata["a"] + r.metadata["b"] if r.metadata["op"] == "+"
                                       else r.metadata["a"] - r.metadata["b"]) for r in held)


def test_arithmetic_training_is_unchanged_without_a_split() -> None:
    for max_operand in (10, 1000):
        assert arithmetic_split(64, 0, max_operand=max_operand, seed=1)[0] == arithmetic_records(64, max_operand, 1)
    # a small split that leaves more problems than num_prompts keeps the same training prompts
    assert arithmetic_split(40, 16, max_operand=10, seed=1)[0] == arithmetic_records(40, 10, 1)


def test_arithmetic_split_refuses_to_hold_out_everything() -> None:
    # max_operand=1: 4 sums and 3 differences
    with pytest.raises(ValueError, match=r"eval.num_prompts=7 .* none of the 7 distinct"):
        arithmetic_split(8, 7, max_operand=1, seed=0)
    assert {r.prompt for r in arithmetic_split(8, 6, max_operand=1, seed=0)[0]} == {
        r.prompt for r in arithmetic_split(8, 6, max_operand=1, seed=0)[0][:1]}  # one problem left, cycled
    assert len(arithmetic_split(8, 20, max_operand=5, seed=0)[1]) == 20


def test_build_task_held_out_splits() -> None:
    task = build_task("arithmetic", num_prompts=32, seed=2, num_eval_prompts=8)
    assert len(task.eval_records) == 8 and task.success_threshold == 1.0
    assert not {r.prompt for r in task.eval_records} & {r.prompt for r in task.records}
    lt = build_task("length_target", num_prompts=64, seed=2, num_eval_prompts=5)
    assert lt.success_threshold is None and len(lt.eval_records) == 5
    assert {r.prompt for r in lt.eval_records} <= set(LENGTH_TARGET_HELD_OUT_INSTRUCTIONS)
    assert not set(LENGTH_TARGET_HELD_OUT_INSTRUCTIONS) & set(LENGTH_TARGET_INSTRUCTIONS)
    assert build_task("arithmetic", num_prompts=4).eval_records == []
    with pytest.raises(ValueError, match="length_target holds out 16"):
        build_task("length_target", num_prompts=4, num_eval_prompts=17)
    with pytest.raises(ValueError, match=r"set eval\.dataset"):
        build_task("dataset", dataset_path="x.jsonl", num_eval_prompts=4)

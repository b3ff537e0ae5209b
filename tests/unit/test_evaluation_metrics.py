"""The `eval/*` metrics of trainer/evaluation.py from hand-made rewards, and the run summary's eval/export lines."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nemo_rollout_correction.trainer.console import RunSummary
from nemo_rollout_correction.trainer.evaluation import format_eval, held_out_records, summarize


def test_summarize_pass_at_k_and_means() -> None:
    # 3 prompts x 4 samples, prompt-major: 1, 0 and 4 correct (reward >= 1)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    lengths = [4, 4, 8, 8, 2, 2, 2, 2, 6, 6, 6, 6]
    m = summarize(rewards, lengths, [False] * 11 + [True], num_prompts=3, num_samples=4, success_threshold=1.0)
    assert m["eval/reward_mean"] == pytest.approx(5 / 12)
    assert m["eval/response_length_mean"] == pytest.approx(56 / 12)
    assert m["eval/truncated_fraction"] == pytest.approx(1 / 12)
    assert m["eval/pass_at_1"] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert m["eval/pass_at_4"] == pytest.approx((1 + 0 + 1) / 3)  # pass@n: any correct sample
    line = format_eval({**m, "eval/seconds": 1.5})
    assert "pass_at_1 0.417" in line and "pass_at_4 0.667" in line


def test_summarize_without_a_notion_of_correctness() -> None:
    m = summarize([-1.0, -3.0], [5, 7], [False, False], num_prompts=1, num_samples=2, success_threshold=None)
    assert not any(key.startswith("eval/pass_at_") for key in m)
    assert m["eval/reward_mean"] == -2.0
    with pytest.raises(ValueError, match="3 rewards for 1 prompts x 2 samples"):
        summarize([0.0] * 3, [1] * 3, [False] * 3, num_prompts=1, num_samples=2, success_threshold=None)


def test_held_out_records_needs_prompts() -> None:
    with pytest.raises(ValueError, match=r"set eval\.dataset"):
        held_out_records(None, [], 4)


def test_held_out_records_from_eval_dataset_take_the_files_first_prompts(tmp_path: Path) -> None:
    import json

    from nemo_rollout_correction.tasks.prompts import PromptRecord

    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "solution": str(i)}) + "\n" for i in range(5)))
    task_split = [PromptRecord(prompt="from the task", answer="x")]
    records = held_out_records(str(path), task_split, 3, prompt_key="question", answer_key="solution")
    assert [(r.prompt, r.answer) for r in records] == [("q0", "0"), ("q1", "1"), ("q2", "2")]
    assert held_out_records(None, task_split, 3) == task_split  # no eval.dataset: the task's held-out split


def test_run_summary_prints_last_eval_and_export() -> None:
    summary = RunSummary.from_history([{"reward/mean": 0.1}, {"reward/mean": 0.3}], output_dir="runs/x",
                                      checkpoint_dir="runs/x/checkpoints", log_path=None, mlflow_run_id=None,
                                      tracking_uri=None, hf_export_dir="runs/x/hf",
                                      last_eval=(2, {"eval/reward_mean": 0.25, "eval/pass_at_1": 0.5}))
    text = "\n".join(summary.lines())
    assert "last eval       step 2: reward 0.250, pass_at_1 0.500" in text
    assert "Hugging Face    runs/x/hf" in text
    bare = RunSummary.from_history([], output_dir="o", checkpoint_dir="c", log_path=None, mlflow_run_id=None,
                                   tracking_uri=None)
    assert not any("last eval" in line or "Hugging Face" in line for line in bare.lines())
    assert math.isnan(bare.reward_first)

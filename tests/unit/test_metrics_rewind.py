"""A resumed run rewinds `metrics.jsonl` to its checkpoint: rows of the steps the crashed run recorded after its last
checkpoint (and that the resumed run runs again) move aside, so each step is in the file once and nothing is lost."""

from __future__ import annotations

import json
from pathlib import Path

from nemo_rollout_correction.trainer.observer import NullObserver
from nemo_rollout_correction.trainer.step_report import StepReport


def _report(path: Path, is_main: bool = True) -> StepReport:
    return StepReport(None, NullObserver(), path, is_main=is_main, ppo_epochs=1, num_engines=1)  # type: ignore[arg-type]


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rows_after_the_checkpoint_move_aside_and_the_resumed_steps_follow(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    report = _report(path)
    for step in range(1, 7):
        report.write(step, {"reward/mean": float(step)})
    path.write_text(path.read_text() + '{"step": 7, "rew')  # the crash tore the last row
    line = report.rewind(4)
    assert line == ("[nrc train] metrics.jsonl: 3 rows recorded after the step-4 checkpoint moved to "
                    "metrics.after_step_4.jsonl (those steps run again)")
    assert _steps(path) == [1, 2, 3, 4]
    aside = tmp_path / "metrics.after_step_4.jsonl"
    assert aside.read_text().splitlines()[:2] == [json.dumps({"step": 5, "reward/mean": 5.0}),
                                                  json.dumps({"step": 6, "reward/mean": 6.0})]
    report.write(5, {"reward/mean": 50.0})
    assert _steps(path) == [1, 2, 3, 4, 5]


def test_nothing_to_rewind_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert _report(path).rewind(3) is None  # no file yet (a checkpoint of another output_dir)
    _report(path).write(1, {"a": 1.0})
    before = path.read_text()
    assert _report(path).rewind(1) is None and path.read_text() == before
    assert _report(path, is_main=False).rewind(0) is None and path.read_text() == before  # not the logging rank
    assert not list(tmp_path.glob("metrics.after_step_*"))

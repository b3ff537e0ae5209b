"""trainer/run_dir.py: the run directory's lock (held -> refused naming the holder; a dead holder's file -> stale,
taken) and a previous run in it (found, refused naming steps and checkpoints, continued, or moved aside)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemo_rollout_correction.trainer.run_dir import (
    LOCK_NAME,
    PreviousRunFound,
    RunDirBusy,
    claim_run_dir,
    find_previous_run,
    lock_run_dir,
)


def _hold_in_child(out: Path) -> subprocess.Popen[str]:
    """A child process that takes the lock, says so on stdout and holds it until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from nemo_rollout_correction.trainer.run_dir import lock_run_dir
        lock = lock_run_dir(Path({str(out)!r}))
        print("held", flush=True)
        sys.stdin.read()
        lock.release()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_held_lock_refuses_naming_pid_and_host(tmp_path: Path) -> None:
    child = _hold_in_child(tmp_path)
    try:
        with pytest.raises(RunDirBusy) as err:
            lock_run_dir(tmp_path)
        assert f"PID {child.pid} on host {socket.gethostname()}" in str(err.value)
        assert "\n" not in str(err.value)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    lock = lock_run_dir(tmp_path)  # released by the holder: free, and no stale holder (the release emptied it)
    assert lock.stale is None
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""


def test_the_lock_of_a_killed_process_is_free_and_reported_stale(tmp_path: Path) -> None:
    child = _hold_in_child(tmp_path)
    child.kill()  # no release: the OS drops the flock, the file still names the dead holder
    child.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == child.pid
    lines: list[str] = []
    lock = claim_run_dir(tmp_path, tmp_path / "checkpoints", resume=False, overwrite=False, log=lines.append)
    try:
        assert lock.stale is not None and lock.stale["pid"] == child.pid
        assert len(lines) == 1 and f"stale lock in {tmp_path}: PID {child.pid}" in lines[0]
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def _previous_run(out: Path, steps: list[int], checkpoints: dict[int, bool]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps))
    for step, complete in checkpoints.items():
        step_dir = out / "checkpoints" / f"step_{step}"
        step_dir.mkdir(parents=True)
        if complete:
            (step_dir / "meta.json").write_text("{}")
    (out / "nrc.log").write_text("old log\n")
    (out / "mlflow.db").write_text("store")


def test_a_previous_run_is_refused_naming_its_steps_and_checkpoints(tmp_path: Path) -> None:
    _previous_run(tmp_path, [1, 2, 3, 4, 1, 2], {2: True, 4: True, 6: False})
    with pytest.raises(PreviousRunFound) as err:
        claim_run_dir(tmp_path, tmp_path / "checkpoints", resume=False, overwrite=False, log=print)
    line = str(err.value)
    assert "metrics.jsonl with steps 1-4, 1-2" in line
    assert "checkpoints step_2, step_4, step_6 (incomplete: step_6)" in line
    assert "run.resume=true continues it from step_4" in line and "run.overwrite=true moves" in line
    assert "\n" not in line
    lock_run_dir(tmp_path).release()  # the refusal let go of the lock


def test_resume_continues_and_overwrite_moves_the_previous_run_aside(tmp_path: Path) -> None:
    _previous_run(tmp_path, [1, 2], {2: True})
    lines: list[str] = []
    claim_run_dir(tmp_path, tmp_path / "checkpoints", resume=True, overwrite=False, log=lines.append).release()
    assert lines == [] and (tmp_path / "metrics.jsonl").exists()

    claim_run_dir(tmp_path, tmp_path / "checkpoints", resume=False, overwrite=True, log=lines.append).release()
    (moved,) = tmp_path.glob("previous-*")
    assert len(lines) == 1 and f"to {moved}" in lines[0] and "steps 1-2" in lines[0]
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoints", "metrics.jsonl", "nrc.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "mlflow.db", moved.name]
    assert find_previous_run(tmp_path, tmp_path / "checkpoints") is None


def test_resume_without_a_complete_checkpoint_moves_the_metrics_aside(tmp_path: Path) -> None:
    _previous_run(tmp_path, [1, 2, 3], {})
    lines: list[str] = []
    claim_run_dir(tmp_path, tmp_path / "checkpoints", resume=True, overwrite=False, log=lines.append).release()
    assert "without a complete checkpoint: moved" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoint_dir_outside_the_run_dir_keeps_its_previous_steps_beside_them(tmp_path: Path) -> None:
    out, ckpts = tmp_path / "run", tmp_path / "ckpts"
    (ckpts / "step_3").mkdir(parents=True)
    (ckpts / "step_3" / "meta.json").write_text("{}")
    with pytest.raises(PreviousRunFound, match=f"checkpoints step_3 in {ckpts}"):
        claim_run_dir(out, ckpts, resume=False, overwrite=False, log=print)
    claim_run_dir(out, ckpts, resume=False, overwrite=True, log=print).release()
    (moved,) = ckpts.glob("previous-*")
    assert [p.name for p in moved.iterdir()] == ["step_3"] and not (ckpts / "step_3").exists()

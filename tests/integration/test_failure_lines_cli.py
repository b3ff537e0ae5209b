"""Every expected failure of `nrc train` is one clear line, and the MLflow run ends FAILED with it (issue 36, item 4;
cli/failures.py). The real CLI, failing before any model work: a port in use (`MASTER_PORT` taken, before the
process group exists: rank 0 still records a FAILED MLflow run) and a missing model directory (`model.source`).
Disk full and an engine killed by the OOM killer: tests/unit/test_failure_lines.py; their CLI versions are slow (a
training run): disk full below (a tmpfs as `checkpoint.dir`, filled after the first checkpoint), the engine killed
with SIGKILL in tests/integration/test_cluster_grade_cli.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nrc_cli import TINY_FAST, cli_env
from tmpfs import mounted_tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NRC_TRAIN = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", "model=tiny_llama",
             "tracking.system_metrics=false"]


def _one_line(stderr: str, start: str) -> str:
    """The one line of `stderr` that starts with `start`; no traceback on the terminal."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith(start)]
    return line


def test_a_port_in_use_is_named_with_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*NRC_TRAIN, f"run.output_dir={tmp_path / 'run'}"], cwd=tmp_path,
                              env={**cli_env(), "MASTER_PORT": str(port)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "nrc train: port ")
    assert line == (f"nrc train: port {port} (MASTER_PORT) on 127.0.0.1 is in use by another process, so "
                    "torch.distributed cannot listen on it: unset MASTER_PORT (a run started directly picks a free "
                    "port) or set it to a free port (`ss -ltnp` shows who holds this one)")
    _assert_failed_run(tmp_path / "run", line.removeprefix("nrc train: "))


def test_a_missing_model_directory_is_named_with_the_choices(tmp_path: Path) -> None:
    out, missing = tmp_path / "run", tmp_path / "no" / "such" / "model"
    proc = subprocess.run([*NRC_TRAIN, f"model.source={missing}", f"run.output_dir={out}"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    want = (f"model source '{missing}': no such builtin name or directory ({missing} does not exist). Use one of the "
            "builtin sources ['smollm2-135m', 'tiny-llama'] or a path to a Hugging Face checkpoint directory "
            "containing config.json")
    assert _one_line(proc.stderr, "nrc train: failed") == f"nrc train: failed at step 0: {want}"
    _assert_failed_run(out, want)


def _assert_failed_run(out: Path, line: str) -> None:
    """The run's one MLflow run (the default sqlite store in the run directory) ended FAILED with `line`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["nrc.error"] == line


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (root only: skipped otherwise), unmounted at the end."""
    with mounted_tmpfs(tmp_path / "disk", 64) as mount:
        yield mount


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_names_the_path_the_space_and_the_kept_checkpoint(
        tmp_path: Path, small_disk: Path) -> None:
    from mlflow.tracking import MlflowClient

    out, ckpts = tmp_path / "run", small_disk / "checkpoints"
    proc = subprocess.Popen([*NRC_TRAIN, *TINY_FAST[1:], "run.num_steps=3", "checkpoint.every_n_steps=1",
                             f"checkpoint.dir={ckpts}", f"run.output_dir={out}"], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (ckpts / "step_1" / "meta.json").exists():  # the first checkpoint is complete: fill the disk
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    with pytest.raises(OSError), open(small_disk / "filler", "wb") as filler:
        while True:
            filler.write(b"\0" * 2**20)
            filler.flush()
    _, stderr = proc.communicate(timeout=600)

    assert proc.returncode == 1, stderr[-3000:]
    line = _one_line(stderr, "nrc train: failed")
    start = f"nrc train: failed at step 2: disk full: no space left on device writing {ckpts}/step_2"
    assert line.startswith(start), line
    assert " MiB free there; a checkpoint of this run takes " in line, line
    assert line.endswith(f"the last complete checkpoint {ckpts}/step_1 is kept: free space (or move checkpoint_dir to "
                         "a larger disk) and continue with run.resume=true"), line
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["nrc.error"] == line.split(": ", 2)[2]

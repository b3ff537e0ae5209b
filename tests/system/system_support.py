"""What the system tests share: root check, the repository root, a running Slurm cluster's client side."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def require_root(what: str) -> None:
    """Skip (or, under NRC_SYSTEM_REQUIRED=1, fail) unless this process is root."""
    if os.geteuid() == 0:
        return
    message = f"{what} needs root (it installs Debian packages and starts daemons)"
    if os.environ.get("NRC_SYSTEM_REQUIRED") == "1":
        pytest.fail(message + "; NRC_SYSTEM_REQUIRED=1")
    pytest.skip(message)


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster: its scratch directory and the environment its clients need (SLURM_CONF)."""

    directory: Path
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 60, check: bool = True, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sbatch, sacct, scontrol, ...) against this cluster; env: instead of self.env
        (it must name this cluster's SLURM_CONF)."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=env or self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{argv} exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc

    def sacct(self, job_id: str, fields: str = "jobid,jobname,state,exitcode,nodelist,ntasks") -> list[dict[str, str]]:
        """Accounting rows of a job and its steps (slurmdbd), as dicts of the requested fields."""
        names = fields.split(",")
        out = self.run("sacct", "-n", "-P", "-D", "-j", job_id, f"--format={fields}").stdout
        return [dict(zip(names, line.split("|"), strict=True)) for line in out.splitlines() if line]

    def wait_gone(self, job_id: str, timeout: float) -> None:
        """Wait until squeue no longer lists the job (completed, failed or cancelled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                proc = self.run("squeue", "-h", "-j", job_id, "-o", "%i", check=False)
            except subprocess.TimeoutExpired:  # slurmctld slow to answer (a load average of 100+ here): ask again
                continue
            # Only an answer counts: a squeue that failed (slurmctld busy, a socket timeout) also prints nothing, and
            # taking that for "gone" once ended a wait while a requeued job was still pending. MinJobAge=600 keeps a
            # finished job known, so a finished job is an empty listing with exit 0.
            if proc.returncode == 0 and not proc.stdout.strip():
                return
            time.sleep(2)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} still queued or running after {timeout:.0f} s; cancelled it")


@dataclass(frozen=True)
class CpuImage:
    """What ci/container_smoke.sh left: the CPU image (kept in podman's store), the podman settings it wrote for
    this machine (CONTAINERS_CONF), and the script's result (the tests assert on it)."""

    tag: str
    containers_conf: Path
    proc: subprocess.CompletedProcess[str]
    seconds: float

    def require_built(self) -> None:
        """Fail (with the script's output) unless the smoke run succeeded, i.e. the image is there."""
        if self.proc.returncode != 0:
            pytest.fail("ci/container_smoke.sh failed, so the image is missing:\n"
                        + self.proc.stdout[-3000:] + self.proc.stderr[-3000:])

"""System tests: a real Slurm cluster on this machine (ci/slurm_cluster.sh) and a real podman build.

They need root and Debian packages (the scripts install them), so they are marked `system` and run only
when selected: `python -m pytest -m system tests/system` (ci/test.sh does, after the default lane).
Without root they skip, unless NRC_SYSTEM_REQUIRED=1 (set by ci/test.sh), which turns the skip into a
failure so CI cannot pass without running them.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from system_support import ROOT, CpuImage, SlurmCluster, require_root

CLUSTER = ROOT / "ci" / "slurm_cluster.sh"
SMOKE = ROOT / "ci" / "container_smoke.sh"
IMAGE_TAG = "localhost/nrc:0.1.0-cpu"
# What ci/container_smoke.sh writes to its containers.conf for this machine class (runc, cgroupfs, ulimits).
KEPT_IMAGE_CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munge, MariaDB, slurmdbd, slurmctld and two slurmd nodes (n1, n2) on localhost, stopped at the end.

    Its own ports (NRC_SLURM_PORT, default 16917 here) so it does not meet a cluster started by hand on
    the script's default ports; munge's socket is machine-wide, so only one cluster runs at a time.
    """
    require_root("the Slurm cluster")
    directory = Path(os.environ.get("NRC_SLURM_TEST_DIR") or tmp_path_factory.mktemp("slurm"))
    env = {**os.environ, "NRC_SLURM_PORT": os.environ.get("NRC_SLURM_PORT", "16917")}
    started = time.monotonic()
    try:  # `down` also after a failed or interrupted `up`: it stops whatever has a PID file
        up = subprocess.run(["bash", str(CLUSTER), "up", str(directory)], capture_output=True, text=True, env=env,
                            timeout=900)
        assert up.returncode == 0, f"ci/slurm_cluster.sh up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        print(f"\nslurm cluster up in {time.monotonic() - started:.1f} s ({directory})")
        yield SlurmCluster(directory, {**env, "SLURM_CONF": str(directory / "slurm.conf")})
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(directory)], capture_output=True, text=True, env=env,
                       timeout=120, check=False)


@pytest.fixture(scope="session")
def cpu_image(tmp_path_factory: pytest.TempPathFactory) -> CpuImage:
    """containers/Dockerfile.cpu built with podman and run (ci/container_smoke.sh), once per session.

    The images are kept (NRC_KEEP_IMAGES=1): the Slurm test runs the image, and podman's layer cache makes the
    next build on this machine take minutes instead of tens of minutes (docs/deployment.md, "System tests").
    The environment passes through: the script reads the host pip's settings (CA bundle, find-links) from it.
    """
    require_root("the podman build")
    work = tmp_path_factory.mktemp("container-smoke")
    started = time.monotonic()
    if os.environ.get("NRC_CPU_IMAGE_KEPT") == "1":
        # By hand, to rerun the podman Slurm tests without the smoke run (minutes): the kept image as it is, which
        # `ci/container_smoke.sh --cached` must find current; the podman settings that script writes.
        proc = subprocess.run(["bash", str(SMOKE), "--cached"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NRC_IMAGE_TAG": IMAGE_TAG})
        conf = work / "smoke" / "containers.conf"
        conf.parent.mkdir()
        conf.write_text(KEPT_IMAGE_CONTAINERS_CONF)
        return CpuImage(IMAGE_TAG, conf, proc, time.monotonic() - started)
    proc = subprocess.run(["bash", str(SMOKE)], capture_output=True, text=True, timeout=3000,
                          env={**os.environ, "NRC_SMOKE_DIR": str(work / "smoke"), "NRC_KEEP_IMAGES": "1",
                               "NRC_IMAGE_TAG": IMAGE_TAG})
    seconds = time.monotonic() - started
    print(f"\nci/container_smoke.sh: {seconds:.1f} s")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("== container_smoke")))
    return CpuImage(IMAGE_TAG, work / "smoke" / "containers.conf", proc, seconds)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run these tests only when the marker expression names `system` (`-m system`): a plain `pytest` as root
    would otherwise install packages and start daemons on a developer's machine."""
    if "system" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="system test: select with -m system (needs root; see docs/deployment.md)")
    for item in items:
        if item.get_closest_marker("system") is not None:
            item.add_marker(skip)

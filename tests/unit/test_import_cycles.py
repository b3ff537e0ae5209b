"""No two modules of the package import each other, directly or through others (function-level imports count).

import-linter's layer contract (tests/unit/test_layering.py) orders the packages; inside a package two modules
could still form a loop, as tasks/rewards.py and tasks/reward_pool.py did (a function-level import whose only
use was an isinstance check). grimp is import-linter's own import graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter's graph library (the dev extra)")


def _cycles(package: str) -> list[tuple[str, str]]:
    graph = grimp.build_graph(package, include_external_packages=False)
    return [(importer, imported) for importer in sorted(graph.modules)
            for imported in sorted(graph.find_modules_directly_imported_by(importer))
            if graph.chain_exists(importer=imported, imported=importer)]


def test_no_module_imports_itself_back() -> None:
    assert _cycles("nemo_rollout_correction") == []


def test_the_check_finds_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "loopy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from loopy import b\n    return b\n")
    (package / "b.py").write_text("from loopy import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ("loopy.a", "loopy.b") in _cycles("loopy")

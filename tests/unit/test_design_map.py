"""docs/design.md's package map lists exactly the modules of the source tree.

Both ways: a module without a line fails (a new module gets its line in the same change), and so does a
line naming a module that does not exist (a removed or renamed module takes its line with it). Every line
carries a description.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nemo_rollout_correction"
DESIGN = ROOT / "docs" / "design.md"

_PACKAGE_LINE = re.compile(r"^  (\w+)/(?:\s+(\S.*))?$")
_MODULE_LINE = re.compile(r"^    (\w+\.py)(?:\s+(\S.*))?$")


def map_block(text: str) -> list[str]:
    """The lines of the fenced block that starts with `nemo_rollout_correction/` (the package map)."""
    lines = text.splitlines()
    start = lines.index("nemo_rollout_correction/")
    end = lines.index("```", start)
    return lines[start + 1:end]


def mapped_modules(block: list[str]) -> tuple[dict[str, str], list[str]]:
    """`{"core/masking.py": description}` from the map, and the lines that follow no known shape."""
    modules: dict[str, str] = {}
    problems: list[str] = []
    package: str | None = None
    for line in block:
        if not line.startswith("  "):  # the closing line of non-package directories
            continue
        if m := _PACKAGE_LINE.match(line):
            package = m.group(1)
        elif (m := _MODULE_LINE.match(line)) and package is not None:
            key = f"{package}/{m.group(1)}"
            if not m.group(2):
                problems.append(f"{key}: no description")
            if key in modules:
                problems.append(f"{key}: listed twice")
            modules[key] = m.group(2) or ""
        else:
            problems.append(f"unreadable map line: {line!r}")
    return modules, problems


def tree_modules() -> set[str]:
    """`package/module.py` for every module of every subpackage (`__init__.py` aside)."""
    return {f"{p.parent.name}/{p.name}" for p in PACKAGE.glob("*/*.py") if p.name != "__init__.py"}


def test_every_module_has_a_line_in_the_design_map_and_every_line_a_module() -> None:
    modules, problems = mapped_modules(map_block(DESIGN.read_text()))
    assert problems == []
    tree = tree_modules()
    assert sorted(tree - set(modules)) == [], "modules without a line in docs/design.md's package map"
    assert sorted(set(modules) - tree) == [], "lines in docs/design.md's package map without a module"


def test_every_package_of_the_tree_is_in_the_map() -> None:
    block = map_block(DESIGN.read_text())
    mapped = {m.group(1) for line in block if (m := _PACKAGE_LINE.match(line))}
    tree = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert mapped == tree


def test_the_map_reader_catches_missing_descriptions_and_strange_lines() -> None:
    # Guard against a reader that silently accepts everything.
    modules, problems = mapped_modules(["  core/   math", "    a.py   does a", "    b.py", "   c.py x"])
    assert modules == {"core/a.py": "does a", "core/b.py": ""}
    assert problems == ["core/b.py: no description", "unreadable map line: '   c.py x'"]

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

# A package line is indented two spaces per level (`  rollout/`, `    refit/` inside it), its modules two more.
_PACKAGE_LINE = re.compile(r"^((?:  )+)(\w+)/(?:\s+(\S.*))?$")
_MODULE_LINE = re.compile(r"^((?:  )+)(\w+\.py)(?:\s+(\S.*))?$")


def map_block(text: str) -> list[str]:
    """The lines of the fenced block that starts with `nemo_rollout_correction/` (the package map)."""
    lines = text.splitlines()
    start = lines.index("nemo_rollout_correction/")
    end = lines.index("```", start)
    return lines[start + 1:end]


def read_map(block: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """The packages of the map (`"rollout"`, `"rollout/refit"`), `{"core/masking.py": description}`, and the
    lines that follow no known shape."""
    packages: list[str] = []
    modules: dict[str, str] = {}
    problems: list[str] = []
    enclosing: list[str] = []  # the packages around the current line, outermost first
    for line in block:
        if not line.startswith("  "):  # the closing line of non-package directories
            continue
        package, module = _PACKAGE_LINE.match(line), _MODULE_LINE.match(line)
        level = len((package or module).group(1)) // 2 if package or module else 0
        if package and level <= len(enclosing) + 1:
            enclosing = [*enclosing[:level - 1], package.group(2)]
            packages.append("/".join(enclosing))
        elif module and 2 <= level <= len(enclosing) + 1:
            key = "/".join([*enclosing[:level - 1], module.group(2)])
            if not module.group(3):
                problems.append(f"{key}: no description")
            if key in modules:
                problems.append(f"{key}: listed twice")
            modules[key] = module.group(3) or ""
        else:
            problems.append(f"unreadable map line: {line!r}")
    return packages, modules, problems


def mapped_modules(block: list[str]) -> tuple[dict[str, str], list[str]]:
    """`{"core/masking.py": description}` (`"rollout/refit/base.py"` in a nested package) from the map, and the
    lines that follow no known shape."""
    _, modules, problems = read_map(block)
    return modules, problems


def tree_modules() -> set[str]:
    """`package/module.py` (`package/sub/module.py`) for every module of every subpackage (`__init__.py` aside)."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py" and p.parent != PACKAGE and "__pycache__" not in p.parts}


def test_every_module_has_a_line_in_the_design_map_and_every_line_a_module() -> None:
    modules, problems = mapped_modules(map_block(DESIGN.read_text()))
    assert problems == []
    tree = tree_modules()
    assert sorted(tree - set(modules)) == [], "modules without a line in docs/design.md's package map"
    assert sorted(set(modules) - tree) == [], "lines in docs/design.md's package map without a module"


def test_every_package_of_the_tree_is_in_the_map() -> None:
    mapped = set(read_map(map_block(DESIGN.read_text()))[0])
    tree = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*/__init__.py")}
    assert mapped == tree


def test_the_map_reader_catches_missing_descriptions_and_strange_lines() -> None:
    # Guard against a reader that silently accepts everything.
    modules, problems = mapped_modules(["  core/   math", "    a.py   does a", "    b.py", "   c.py x"])
    assert modules == {"core/a.py": "does a", "core/b.py": ""}
    assert problems == ["core/b.py: no description", "unreadable map line: '   c.py x'"]
    nested = ["  rollout/  engine", "    a.py  a", "    refit/  paths", "      b.py  b", "    c.py  c",
              "        d.py  too deep", "  e.py  outside any package"]
    packages, modules, problems = read_map(nested)
    assert packages == ["rollout", "rollout/refit"]
    assert modules == {"rollout/a.py": "a", "rollout/refit/b.py": "b", "rollout/c.py": "c"}
    assert problems == ["unreadable map line: '        d.py  too deep'", "unreadable map line: '  e.py  outside any "
                        "package'"]

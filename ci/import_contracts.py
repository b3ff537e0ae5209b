"""import-linter contract types of our own (registered under `contract_types` in pyproject.toml).

`forbidden_submodule`: no module of `source_modules` (packages of this project, with their descendants),
except those in `allowed_importers` (with theirs), uses any of `forbidden_modules`, which may be subpackages
of external packages such as `torch.distributed`.
import-linter's own `forbidden` contract refuses those ("subpackages of external packages are not
valid": grimp keeps external packages as one top-level node), and `import torch` followed by
`torch.distributed.all_reduce(...)` needs no import of the subpackage at all. So this contract reads
each module's syntax tree: an `import`, a `from ... import`, or an attribute chain naming a forbidden
module breaks it. `TYPE_CHECKING` imports count too: name the type through the allowed package instead.

`forbidden_reader`: no module of `source_modules` uses a reader named by `forbidden_names` (patterns over full
dotted names, e.g. `torch.load`, `megatron.core.dist_checkpointing*.load*`), except the modules in
`allowed_importers` and the single uses in `allowed_uses` (`module:name`, each justified where it is listed).
Names are resolved through the module's imports, so `import pickle as pk; pk.loads(...)` and
`from megatron.core import dist_checkpointing; dist_checkpointing.load(...)` count. It keeps every read of a
checkpoint behind one door (trainer/checkpoint_door.py, which checks every file as data first).
"""

from __future__ import annotations

import ast
import importlib.util
from fnmatch import fnmatchcase
from pathlib import Path

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def uses_of(source: str, forbidden: list[str]) -> list[tuple[int, str]]:
    """(line, name) of every import or attribute chain in `source` that names a module in `forbidden`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
        for name in names:
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                found.append((node.lineno, name))
                break
    return sorted(set(found))


def _import_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the full dotted name it is bound to by the module's absolute imports."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def reads_of(source: str, forbidden: list[str]) -> list[tuple[int, str]]:
    """(line, full name) of every import or name/attribute chain in `source` that resolves to a name matching one
    of the `forbidden` patterns (fnmatch, case-sensitive)."""
    tree = ast.parse(source)
    aliases = _import_aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, (ast.Attribute, ast.Name)):
            dotted = _dotted(node)
            if dotted:
                head, _, rest = dotted.partition(".")
                full = aliases.get(head, head)
                names = [f"{full}.{rest}" if rest else full]
        for name in names:
            if any(fnmatchcase(name, pattern) for pattern in forbidden):
                found.append((node.lineno, name))
                break
    return sorted(set(found))


def _module_file(root_dir: Path, root: str, module: str) -> Path:
    parts = module.split(".")[1:] if module != root else []
    path = root_dir.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


class ForbiddenSubmoduleContract(Contract):
    """The source packages never import (or reach by attribute) the forbidden modules."""

    type_name = "forbidden_submodule"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.ModuleField(), required=False, default=[])

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        forbidden = list(self.forbidden_modules)  # type: ignore[call-overload]
        allowed = {module.name for module in self.allowed_importers}  # type: ignore[attr-defined]
        violations: list[str] = []
        for source in self.source_modules:  # type: ignore[attr-defined]
            root = source.name.split(".")[0]
            spec = importlib.util.find_spec(root)
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(f"forbidden_submodule: cannot locate the package {root!r}")
            root_dir = Path(next(iter(spec.submodule_search_locations)))
            for module in sorted({source.name} | graph.find_descendants(source.name)):
                if any(module == a or module.startswith(a + ".") for a in allowed):
                    continue
                path = _module_file(root_dir, root, module)
                for line, name in uses_of(path.read_text(), forbidden):
                    violations.append(f"{module} (line {line}) uses {name}")
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(violation, bold=False)
            output.new_line()


class ForbiddenReaderContract(Contract):
    """Only the allowed modules (and the listed single uses) call the forbidden readers."""

    type_name = "forbidden_reader"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_names = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.ModuleField(), required=False, default=[])
    allowed_uses = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        forbidden = list(self.forbidden_names)  # type: ignore[call-overload]
        allowed = {module.name for module in self.allowed_importers}  # type: ignore[attr-defined]
        uses = {tuple(use.split(":", 1)) for use in self.allowed_uses}  # type: ignore[attr-defined]
        violations: list[str] = []
        for source in self.source_modules:  # type: ignore[attr-defined]
            root = source.name.split(".")[0]
            spec = importlib.util.find_spec(root)
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(f"forbidden_reader: cannot locate the package {root!r}")
            root_dir = Path(next(iter(spec.submodule_search_locations)))
            for module in sorted({source.name} | graph.find_descendants(source.name)):
                if module in allowed:
                    continue
                path = _module_file(root_dir, root, module)
                for line, name in reads_of(path.read_text(), forbidden):
                    if (module, name) not in uses:
                        violations.append(f"{module} (line {line}) uses {name}")
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(violation, bold=False)
            output.new_line()

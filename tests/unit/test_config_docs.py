"""docs/configuration.md is generated from the schema and must be current."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rollout_correction.config import TrainConfig, available_groups, docgen
from nemo_rollout_correction.config.convert import dotted_keys


def test_configuration_doc_is_current() -> None:
    assert docgen.DOC_PATH.read_text() == docgen.render(), (
        "docs/configuration.md is stale; run: python -m nemo_rollout_correction.config.docgen"
    )


def test_doc_lists_every_key_and_every_group_option() -> None:
    text = docgen.render()
    for key in dotted_keys(TrainConfig):
        assert f"| `{key}` |" in text, key
    for group, options in available_groups().items():
        for option in options:
            assert f"`{option}`" in text, (group, option)
    # rollout_correction help comes from core's attribute docstrings
    assert "Reject a whole sequence if any token ratio is below this" in text


def test_check_mode_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "configuration.md"
    monkeypatch.setattr(docgen, "DOC_PATH", doc)
    assert docgen.main(["--check"]) == 1  # missing
    assert docgen.main([]) == 0
    assert docgen.main(["--check"]) == 0
    doc.write_text(doc.read_text().replace("policy.lr", "policy.learning_rate"))
    assert docgen.main(["--check"]) == 1

"""The docs name only config keys, config group options and `nrc` commands that exist.

Every backticked `section.key` (and every `section.key=value` in a code block) in README.md and docs/*.md
whose section is a config section must be a key of the schema; every `group=option` must be a shipped
option; every `nrc <command>` must be a subcommand. docs/configuration.md is generated from the schema and
skipped. Nothing may point outside the repository (`../shared`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_rollout_correction.cli import build_parser
from nemo_rollout_correction.config import TrainConfig, available_groups, to_flat_dict

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = [p for p in PAGES if p.name != "configuration.md"]
KEYS = set(to_flat_dict(TrainConfig()))
KEYS |= {k.rsplit(".", 1)[0] for k in KEYS if k.count(".") >= 2}  # sub-sections (`rollout_correction.alert`)
SECTIONS = {k.split(".", 1)[0] for k in KEYS}
GROUPS = available_groups()
# `nrc launch` has its own parser (launch/main.py); the rest are argparse subcommands of `nrc`.
COMMANDS = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]

# Dotted names in the docs that are not our config keys, on purpose.
NOT_KEYS = {
    "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "policy.train_micro_batch_size",  # NeMo-RL's
    "model.safetensors", "audit.json",  # file names
    "task.records",  # a Python attribute in an example
}
_KEY = re.compile(r"(?<![\w./$-])\+?([a-z_]+)\.([a-z_][a-z0-9_]*)(?=[\s`=,)\]]|$)")
_GROUP = re.compile(r"(?<![\w./-])([a-z_]+)=([a-z0-9_]+)(?=[\s`]|$)")
_NRC = re.compile(r"(?<![\w/-])nrc ([a-z]+)\b")


def _spans(text: str) -> list[str]:
    """Inline code spans and fenced code blocks: where keys and commands are named."""
    blocks = re.findall(r"```.*?```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_documented_keys_groups_and_commands_exist(page: Path) -> None:
    bad: list[str] = []
    for span in _spans(page.read_text()):
        for section, key in _KEY.findall(span):
            if key == "py":  # a module's file name (`audit.py`, `grpo.py`), not a config key
                continue
            if section in SECTIONS and f"{section}.{key}" not in KEYS | NOT_KEYS:
                bad.append(f"key {section}.{key}")
        for group, option in _GROUP.findall(span):
            if group in GROUPS and option not in GROUPS[group] and option not in ("null",):
                bad.append(f"option {group}={option}")
        for command in _NRC.findall(span):
            if command not in COMMANDS:
                bad.append(f"command nrc {command}")
    assert not bad, f"{page.name} names what does not exist: {sorted(set(bad))}"


def test_docs_stay_inside_the_repository() -> None:
    for page in [*PAGES, ROOT / "docs" / "configuration.md"]:
        assert "../shared" not in page.read_text(), f"{page.name} points outside the repository"

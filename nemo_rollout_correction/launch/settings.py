"""The `launcher:` section of `nrc launch`: `config.schema.LauncherConfig`, composed or parsed from overrides.

There is one definition of the launcher's fields, defaults and rules: `LauncherConfig` in
config/schema.py (Hydra group `conf/launcher/`, documented in docs/configuration.md). `settings_for`
composes the whole `nrc train` config and returns its `launcher:` section, so `launcher=slurm` and the
`parallelism=...` groups (which set `launcher.nproc_per_node`) work as in `nrc train`. Without Hydra
(the `config` extra not installed) `settings_from_overrides` parses `launcher.<field>=<value>`
overrides into the same dataclass, which applies the same checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from nemo_rollout_correction.config.schema import ConfigError, LauncherConfig

PREFIX = "launcher."

__all__ = ["PREFIX", "is_launcher_override", "settings_for", "settings_from_overrides", "split_overrides"]


def _parse_value(key: str, raw: str, kind: str) -> Any:
    """Parse one override value for the field `key` whose annotation is `kind` (Hydra's syntax, by hand:
    this is the path for an install without Hydra)."""
    if "None" in kind and raw.strip().lower() in ("null", "none", "~"):
        return None
    if kind in ("int", "int | None"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"launcher.{key}={raw!r} is not allowed: must be an integer") from None
    if "list" in kind:
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [item.strip().strip("'\"") for item in text.split(",") if item.strip()]
    return raw


def split_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """Separate `launcher.<field>=<value>` overrides from the ones meant for `nrc train`.

    Returns (launcher field values, the remaining overrides in order). Lists use Hydra's syntax:
    `launcher.container_mounts=[/data:/data,/ckpt:/ckpt]`.
    """
    kinds = {f.name: str(f.type) for f in dataclasses.fields(LauncherConfig)}
    picked: dict[str, Any] = {}
    rest: list[str] = []
    for item in overrides:
        if not item.startswith(PREFIX):
            rest.append(item)
            continue
        key, sep, raw = item[len(PREFIX):].partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must be launcher.<field>=<value>")
        if key not in kinds:
            raise ConfigError(f"unknown launcher key {key!r} in {item!r}; allowed: {sorted(kinds)}")
        picked[key] = _parse_value(key, raw, kinds[key])
    return picked, rest


def settings_from_overrides(overrides: Sequence[str], base: LauncherConfig | None = None
                            ) -> tuple[LauncherConfig, list[str]]:
    """Apply the `launcher.*` overrides to `base` (default: the defaults); return it and the other overrides."""
    picked, rest = split_overrides(overrides)
    return dataclasses.replace(base or LauncherConfig(), **picked), rest


def settings_for(overrides: Sequence[str], config_dir: str | Path | None = None) -> LauncherConfig:
    """The launcher section of `nrc train [--config-dir DIR] <overrides>`.

    Composes the whole `nrc train` config (so a bad train override fails here, before a job is
    submitted) when the config layer (Hydra) is installed; otherwise parses `launcher.*` overrides
    (and then a `config_dir` cannot be read: that is an error).
    Raises ConfigError (a ValueError) naming the bad key.
    """
    try:
        from nemo_rollout_correction.config.loader import load_config
    except ImportError:  # the `config` extra (hydra-core) is not installed
        if config_dir is not None:
            raise ConfigError("--config-dir needs the config extra (hydra-core): pip install "
                              "'nemo_rollout_correction[config]'") from None
        return settings_from_overrides(overrides)[0]
    return load_config(list(overrides), config_dir).launcher


def is_launcher_override(item: str) -> bool:
    """`launcher.<field>=...`, `launcher=<option>` (the Hydra group) or a `parallelism=<option>` choice."""
    return item.startswith((PREFIX, "launcher=", "parallelism=", "+launcher", "~launcher"))

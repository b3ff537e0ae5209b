"""Compose conf/ with Hydra, then check the result strictly against the schema.

    load_config(["rollout_correction=decoupled_geo_rs", "policy.lr=3e-6", "run.name=geo"])

Hydra (compose API) does the composition: the defaults list of conf/config.yaml, group
selection (`model=tiny_llama`), `key=value` / `+key=value` overrides and `${...}`
interpolations. Every key and its schema default come from schema.py: the loader registers
them as the config `nrc_defaults` that conf/config.yaml lists first, so YAML files only hold
what differs and a key can never have a second, drifting default. The composed tree is then
converted by `convert.build`, which owns the error messages (unknown key with a suggestion,
wrong type, disallowed value). Every failure is a one-line `ConfigError`, never a traceback
from Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_rollout_correction.config.convert import build, suggest_key
from nemo_rollout_correction.config.schema import ConfigError, TrainConfig

__all__ = [
    "DEFAULTS_NAME",
    "available_groups",
    "config_show",
    "default_conf_dir",
    "defaults_dict",
    "from_dict",
    "load_config",
    "load_yaml",
    "to_dict",
    "to_flat_dict",
    "to_yaml",
]

DEFAULTS_NAME = "nrc_defaults"
"""Name under which the schema defaults are registered in Hydra's ConfigStore (first in conf/config.yaml)."""

_FALLBACK_ROOT = "nrc_root"

# Where the shipped conf/ lives: inside the package in a wheel or non-editable install (pyproject.toml maps
# the repository's conf/ to `nemo_rollout_correction/conf`), else in the source checkout beside the package
# (a PYTHONPATH or editable run from the repository).
_PACKAGE_CONF = Path(__file__).resolve().parents[1] / "conf"
_REPO_CONF = Path(__file__).resolve().parents[2] / "conf"


def default_conf_dir() -> Path:
    """The shipped conf/ directory (package data, or the source checkout's conf/); ConfigError if neither exists."""
    for candidate in (_PACKAGE_CONF, _REPO_CONF):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(f"no default config directory: neither {_PACKAGE_CONF} nor {_REPO_CONF} holds config.yaml "
                      "(a broken install: reinstall the package)")


def defaults_dict() -> dict[str, Any]:
    """Every key at its schema default, as nested plain data (`run.output_dir` keeps `${run.name}`)."""
    return to_dict(TrainConfig())


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg` as nested plain data (dicts, lists, str/int/float/bool/None): the inverse of `from_dict`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "to_dict"):  # RolloutCorrectionConfig: only its user-settable fields
            out[f.name] = section.to_dict()
        else:
            out[f.name] = {k: list(v) if isinstance(v, list) else v for k, v in dataclasses.asdict(section).items()}
    return out


def to_flat_dict(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg` as {dotted key: value}, e.g. for MLflow params (lists become their YAML flow text)."""
    flat: dict[str, Any] = {}

    def add(prefix: str, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, dict):  # a sub-section (`rollout_correction.alert`)
                add(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = yaml.safe_dump(value, default_flow_style=True).strip() \
                    if isinstance(value, list) else value

    for section, values in to_dict(cfg).items():
        add(f"{section}.", values)
    return flat


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML; `load_yaml` / `from_dict(yaml.safe_load(...))` gives `cfg` back."""
    text: str = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    return text


def from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """A TrainConfig from nested plain data, strictly checked; absent keys take their defaults and
    `${...}` interpolations are resolved against the full tree (defaults included)."""
    try:
        tree = OmegaConf.merge(OmegaConf.create(defaults_dict()), OmegaConf.create(dict(data)))
        plain = OmegaConf.to_container(tree, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from None
    assert isinstance(plain, dict)
    return build(TrainConfig, plain)  # type: ignore[arg-type]


def load_yaml(path: str | Path) -> TrainConfig:
    """A TrainConfig from a YAML file written by `to_yaml` (for example a run's saved config)."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return from_dict(data)


def available_groups(config_dir: str | Path | None = None) -> dict[str, list[str]]:
    """{group: sorted options} for every config group (sub-directory of YAML files) in conf/ and,
    when given, the user's config directory."""
    groups: dict[str, set[str]] = {}
    for root in _search_dirs(config_dir):
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            options = {p.stem for p in sub.glob("*.yaml")}
            if options:
                groups.setdefault(sub.name, set()).update(options)
    return {group: sorted(options) for group, options in sorted(groups.items())}


def load_config(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> TrainConfig:
    """Compose the configuration and return it checked and typed.

    Args:
        overrides: Hydra overrides: `key=value`, `+key=value`, `group=option`
            (`rollout_correction=token_tis`, `model=tiny_llama`, `task=length_target`, `parallelism=tp2`).
        config_dir: an extra config directory searched before conf/: its config.yaml (if any)
            replaces conf/config.yaml, its group files add options or replace conf/'s.

    Raises:
        ConfigError: a one-line message naming the bad key, value or option and what is allowed.
    """
    tree = _compose(list(overrides), config_dir)
    return build(TrainConfig, tree)


def config_show(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> str:
    """The resolved configuration as YAML (what `nrc config show` prints)."""
    return to_yaml(load_config(overrides, config_dir))


# ---- internals -------------------------------------------------------------------------------


def _search_dirs(config_dir: str | Path | None) -> list[Path]:
    dirs = [] if config_dir is None else [Path(config_dir).resolve()]
    if config_dir is not None and not dirs[0].is_dir():
        raise ConfigError(f"config directory {config_dir} does not exist")
    return [*dirs, default_conf_dir()]


def _register_defaults() -> None:
    ConfigStore.instance().store(name=DEFAULTS_NAME, node=defaults_dict())


def _check_override_syntax(overrides: list[str]) -> None:
    """Parse each override alone so a syntax error names the override that has it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as exc:
            reason = str(exc).splitlines()[0]
            raise ConfigError(f"cannot parse override {override!r}: {reason} "
                              "(syntax: key=value, +key=value, group=option; quote values with spaces)") from None


def _compose(overrides: list[str], config_dir: str | Path | None) -> dict[str, Any]:
    dirs = _search_dirs(config_dir)
    _check_override_syntax(overrides)
    _register_defaults()
    hydra_overrides = list(overrides)
    config_name = "config"
    if len(dirs) > 1:
        # The user's directory is primary (its files win); conf/ is searched after it. Without a
        # config.yaml of its own, conf/config.yaml is the root: Hydra looks up the primary config
        # before it reads hydra.searchpath, so that root is registered in the ConfigStore under
        # another name (a stored "config" would collide with config.yaml files).
        hydra_overrides.append(f"hydra.searchpath=['file://{dirs[1]}']")
        if not (dirs[0] / "config.yaml").is_file():
            root = yaml.safe_load((dirs[1] / "config.yaml").read_text())
            ConfigStore.instance().store(name=_FALLBACK_ROOT, node=root)
            config_name = _FALLBACK_ROOT
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(dirs[0]), version_base=None):
            cfg = compose(config_name=config_name, overrides=hydra_overrides)
            plain = OmegaConf.to_container(cfg, resolve=True)
    except MissingConfigException as exc:
        raise ConfigError(_missing_option_message(exc, config_dir)) from None
    except HydraException as exc:
        raise ConfigError(_hydra_message(exc, config_dir)) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from None
    except (ValueError, KeyError, TypeError) as exc:  # Hydra raises plain ones too (e.g. `group=null`)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot compose the configuration from {overrides}: {first}") from None
    assert isinstance(plain, dict)
    return plain  # type: ignore[return-value]


def _missing_option_message(exc: MissingConfigException, config_dir: str | Path | None) -> str:
    match = re.search(r"Could not find '([^']+)/([^'/]+)'", str(exc))
    if not match:
        return str(exc).splitlines()[0]
    group, option = match.groups()
    options = available_groups(config_dir).get(group, [])
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"unknown {group} option {option!r}; {hint}available: {', '.join(options)}"


def _hydra_message(exc: HydraException, config_dir: str | Path | None) -> str:
    text = str(exc)
    match = re.search(r"Could not override '([^']+)'", text)
    if match:
        key = match.group(1)
        groups = available_groups(config_dir)
        if key in groups:
            return (f"group {key!r} is not in the defaults list of the root config.yaml; add '- {key}: <option>' "
                    f"there, or select it with +{key}=<option> (options: {', '.join(groups[key])})")
        hint = suggest_key(key, TrainConfig)
        if "." not in key:
            close = difflib.get_close_matches(key, list(groups), n=1, cutoff=0.75)
            hint = close[0] if close else hint
        suggestion = f"; did you mean {hint!r}?" if hint else ""
        return f"unknown key {key!r}{suggestion} (groups: {', '.join(groups)}; `nrc config show` lists every key)"
    return text.splitlines()[0] if text else type(exc).__name__


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    lines = str(exc).splitlines()
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("full_key:")), "")
    where = f"{key}: " if key else ""
    return f"{where}{lines[0] if lines else type(exc).__name__}"


"""Plain mapping -> typed dataclasses, with strict checks and errors a user can act on.

OmegaConf's structured configs cannot express `Literal` or `str | float` unions, and their errors
do not suggest the key a user meant, so the composed tree is checked here instead: an unknown
key names its full dotted path and the closest valid key; a wrong type names the expected type
and the value; a `Literal` lists the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from nemo_rollout_correction.config.schema import ConfigError

T = TypeVar("T")

__all__ = ["build", "dotted_keys", "field_type", "suggest_key", "type_name"]


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def field_type(cls: type, name: str) -> Any:
    """The resolved annotation of field `name` of dataclass `cls` (string annotations evaluated)."""
    return typing.get_type_hints(cls)[name]


def dotted_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Every leaf key of dataclass `cls` as a dotted path, in declaration order."""
    for f in _init_fields(cls):
        key = f"{prefix}{f.name}"
        tp = field_type(cls, f.name)
        if dataclasses.is_dataclass(tp):
            yield from dotted_keys(tp, f"{key}.")  # type: ignore[arg-type]
        else:
            yield key


def suggest_key(bad: str, root: type) -> str | None:
    """The valid dotted key closest to the unknown dotted key `bad`, or None.

    Tries the siblings first (a typo in the last part), then every key of the tree (a typo in a
    section name, or a field placed in the wrong section: `policy.temperature` ->
    `rollout.temperature`).
    """
    all_keys = list(dotted_keys(root))
    sections = {k.rsplit(".", 1)[0] for k in all_keys if "." in k}
    parent, _, leaf = bad.rpartition(".")
    siblings = [k for k in all_keys + sorted(sections) if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(bad, siblings, n=1, cutoff=0.75)
    if close:
        return close[0]
    # Section names are candidates only for a bare name (`polcy` -> `policy`), never for
    # `policy.foo` (suggesting its own parent would not help).
    close = difflib.get_close_matches(bad, all_keys + ([] if parent else sorted(sections)), n=1, cutoff=0.75)
    if close:
        return close[0]
    # The same leaf name under another section.
    by_leaf = [k for k in all_keys if k.rpartition(".")[2] == leaf]
    return by_leaf[0] if len(by_leaf) == 1 else None


def type_name(tp: Any) -> str:
    """A readable name for an annotation: `int`, `str | None`, `'a' | 'b'`, `list[str]`."""
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    """A value that does not fit one candidate type (internal: unions try the next member)."""


def _convert(value: Any, tp: Any, key: str, root: type) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} is a section; expected a mapping of its keys, got {value!r}")
        return build(tp, value, root=root, prefix=f"{key}.")  # type: ignore[arg-type]
    if origin in (Union, types.UnionType):
        members = [m for m in get_args(tp) if m is not type(None)]
        if value is None and len(members) < len(get_args(tp)):
            return None
        if len(members) == 1:  # `X | None`: X's own error (a Literal lists its values) is the useful one
            return _convert(value, members[0], key, root)
        # Exact type first, so `2.5` for `str | float` stays a float; then the coercions in order.
        for member in members:
            if member in (int, float, str, bool) and type(value) is member:
                return value
        # A number stays a number when a numeric member exists (`2` for `str | float` is 2.0).
        for member in sorted(members, key=lambda m: m is str):
            try:
                return _convert(value, member, key, root)
            except (_Mismatch, ConfigError):
                continue
        raise _Mismatch
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and not isinstance(value, bool):
            return value
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}"
                          f"{did_you_mean}")
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _Mismatch
        (item_tp,) = get_args(tp)
        return [_checked(v, item_tp, f"{key}[{i}]", root) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        # Hydra reads `run.name=2024` as an int; a number is a fine name, a bool or list is not.
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    raise TypeError(f"{key}: unsupported annotation {tp!r} in the schema")  # a schema bug, not user input


def _checked(value: Any, tp: Any, key: str, root: type) -> Any:
    try:
        return _convert(value, tp, key, root)
    except _Mismatch:
        hint = ""
        if isinstance(value, bool) and tp is not bool:
            hint = f" (to pass the text, quote it: {key}='{str(value).lower()}')"
        got = "null" if value is None else f"{value!r} ({type(value).__name__})"
        raise ConfigError(f"{key} expects {type_name(tp)}, got {got}{hint}") from None


def build(cls: type[T], data: Mapping[str, Any], *, root: type | None = None, prefix: str = "") -> T:
    """Instantiate dataclass `cls` from `data`, strictly: every key must exist and every value must
    fit its annotation. Keys absent from `data` take the dataclass default. Validation errors of
    the class itself (`__post_init__`) are re-raised as `ConfigError` naming the section."""
    root = root if root is not None else cls
    fields = {f.name: f for f in _init_fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            hint = suggest_key(key, root)
            suggestion = f"; did you mean {hint!r}?" if hint else ""
            valid = ", ".join(fields)
            raise ConfigError(f"unknown key {key!r}{suggestion} (valid keys under "
                              f"{prefix.rstrip('.') or 'the top level'}: {valid})")
        kwargs[name] = _checked(value, field_type(cls, name), key, root)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        # Core classes (RolloutCorrectionConfig) name the field but not its section.
        section = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{section}: {exc}") from None

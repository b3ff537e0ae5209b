"""Config flattening and MLflow name/size rules (stdlib only, no mlflow import).

MLflow 3.17.2 limits (mlflow/utils/validation.py): keys 250 characters, param values 6000, tag values
8000; names may contain alphanumerics, `_ - . / :` and spaces and must not be path-like (`..`,
leading `/`). One `log_batch` takes at most 1000 metrics, 100 params and 100 tags.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100

_VALID_NAME = re.compile(r"^[/\w.\- :]*$")
_INVALID_CHAR = re.compile(r"[^/\w.\- :]")
TRUNCATION_MARKER = "...[truncated]"


def is_valid_name(name: str) -> bool:
    """True when MLflow accepts `name` as a metric, param or tag key (characters, path form, length)."""
    if not name or len(name) > MAX_KEY_LENGTH or not _VALID_NAME.match(name):
        return False
    norm = posixpath.normpath(name)
    return not (norm != name or norm == "." or norm.startswith("..") or norm.startswith("/"))


def check_metric_name(name: object) -> str:
    """Return `name` if MLflow accepts it as a metric key, else raise ValueError naming it and the rule."""
    if not isinstance(name, str) or not is_valid_name(name):
        raise ValueError(
            f"invalid metric name {name!r}: MLflow allows 1-{MAX_KEY_LENGTH} characters from letters, digits, "
            "'_', '-', '.', '/', ':' and space, and no path-like form ('a//b', './a', '../a', '/a', trailing '/')"
        )
    return name


def sanitize_key(key: str) -> str:
    """Map an arbitrary config key path to a valid MLflow key.

    Invalid characters become `_`; a key longer than 250 characters keeps its head and gets an 8-hex
    hash suffix so two long keys cannot collide.
    """
    key = _INVALID_CHAR.sub("_", key).strip("/") or "_"
    key = re.sub(r"/+", "/", key)
    key = "/".join(part if part not in (".", "..") else "_" for part in key.split("/"))
    if len(key) > MAX_KEY_LENGTH:
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        key = f"{key[: MAX_KEY_LENGTH - 9]}-{digest}"
    return key


def truncate_value(value: str, limit: int) -> str:
    """Cut `value` to at most `limit` characters, marking the cut (MLflow rejects or silently cuts longer)."""
    if len(value) <= limit:
        return value
    return value[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def to_plain(value: Any) -> Any:
    """Recursively turn mappings/sequences (OmegaConf containers included) into dict/list; other leaves that
    are not str/int/float/bool/None become str. Used for JSON params and the YAML artifact."""
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [to_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def format_param_value(value: Any) -> str:
    """A config leaf as a param string: strings as-is, everything else as JSON (`true`, `null`, `[1, 2]`)."""
    if isinstance(value, str):
        return value
    return json.dumps(to_plain(value))


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested mapping into dotted MLflow params.

    `{"policy": {"lr": 1e-5}, "launcher": {"container_mounts": ["a", "b"]}}` ->
    `{"policy.lr": "1e-05", "launcher.container_mounts": '["a", "b"]'}`. Nested mappings recurse;
    lists and other leaves are JSON-encoded; keys are sanitized and values truncated to MLflow's limits.
    An empty mapping becomes `"{}"` so the key is still visible.
    """
    flat: dict[str, str] = {}
    for raw_key, value in config.items():
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if isinstance(value, Mapping):
            if value:
                flat.update(flatten_config(value, key))
            else:
                flat[sanitize_key(key)] = "{}"
            continue
        flat[sanitize_key(key)] = truncate_value(format_param_value(value), MAX_PARAM_VALUE_LENGTH)
    return flat


def to_float(name: str, value: object) -> float:
    """Convert a metric value (Python/numpy number, 0-d tensor) to float; raise TypeError naming the metric."""
    if isinstance(value, bool):
        return float(value)
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"metric {name!r} has value {value!r} of type {type(value).__name__}; expected a number "
            "(int, float, numpy scalar or a one-element tensor)"
        ) from exc
    return result


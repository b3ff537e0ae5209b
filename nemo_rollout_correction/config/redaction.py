"""Credentials never leave the process: the one redaction rule for config values, environment variables and logs.

Every place that writes configuration or text out of the process goes through this module: MLflow params,
tags and the resolved-config artifact (`MlflowTracker.log_params` / `set_tags` / `log_config`), the
checkpoint metadata (`public_config`), and every log record (`RedactingFilter`, installed by `nrc train` /
`nrc audit` on the handlers that write the console and the run's log file).

The rule (docs/tracking.md, "Secrets"): a name is secret when, split into words at `_`, `.`, `-` and
lower-to-upper case changes, it contains one of SECRET_WORDS (token, password, passwd, secret, credential,
credentials, auth, authorization, apikey, passphrase, cookie) or the word `key` right after one of
KEY_QUALIFIERS (api, access, private, secret, signing, encryption, client, account, master). So `HF_TOKEN`,
`MLFLOW_TRACKING_PASSWORD`, `AWS_SECRET_ACCESS_KEY`, `WANDB_API_KEY`, `sshPrivateKey` are secret, and
`task.prompt_key`, `task.answer_key`, `checkpoint.keep_last`, `max_new_tokens`, `tokenizer`, `author` are
not (whole words only, and a bare `key` names a column or a metric, not a credential). Independently of
names, the password of a URI's user-info part (`https://user:PASSWORD@host`) is always redacted. Numbers and
booleans are never credentials: `rollout_correction.rollout_token_veto_threshold: 1e-4` keeps its value (and
"0.0001" is not scrubbed from every log line).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "KEY_QUALIFIERS",
    "REDACTED",
    "SECRET_WORDS",
    "RedactingFilter",
    "is_secret_name",
    "redact_text",
    "redact_tree",
    "redact_uri_passwords",
    "secret_values",
]

REDACTED = "***REDACTED***"
"""What a secret value is replaced with."""

SECRET_WORDS: frozenset[str] = frozenset({
    "token", "password", "passwd", "secret", "credential", "credentials", "auth", "authorization", "apikey",
    "passphrase", "cookie",
})
"""A name containing one of these whole words is secret."""

KEY_QUALIFIERS: frozenset[str] = frozenset({
    "api", "access", "private", "secret", "signing", "encryption", "client", "account", "master",
})
"""`key` is secret only right after one of these words (`api_key`, `ACCESS_KEY`); alone it names a column."""

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_URI_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")
_MIN_SCRUB_LENGTH = 6  # shorter values ("1", "true") would blank unrelated text; they are not credentials


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(name)]


def is_secret_name(name: str) -> bool:
    """True if a config key or environment variable `name` names a credential (the rule in the module doc)."""
    words = _words(name.rsplit(".", 1)[-1]) if "." in name else _words(name)
    if any(w in SECRET_WORDS for w in words):
        return True
    return any(w == "key" and i > 0 and words[i - 1] in KEY_QUALIFIERS for i, w in enumerate(words))


def _may_hold_credential(value: Any) -> bool:
    """False for empty values, numbers and booleans: a secret-sounding key with such a value holds no credential."""
    return value not in (None, "") and not isinstance(value, bool | int | float)


def redact_uri_passwords(text: str) -> str:
    """`text` with the password of every `scheme://user:password@` replaced by REDACTED."""
    return _URI_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)


def redact_tree(data: Any, name: str = "") -> Any:
    """A copy of nested dicts/lists/scalars with the values under secret names replaced by REDACTED and
    URI passwords removed from every string; the input is not modified."""
    if isinstance(data, Mapping):
        return {k: (REDACTED if is_secret_name(str(k)) and _may_hold_credential(v) else redact_tree(v, str(k)))
                for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact_tree(v, name) for v in data]
    if isinstance(data, str):
        return redact_uri_passwords(data)
    return data


def secret_values(config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> set[str]:
    """Every value that must not appear in text: values of secret-named environment variables (os.environ by
    default) and config keys, and URI passwords inside either. Values shorter than 6 characters are skipped."""
    found: set[str] = set()
    env = os.environ if environ is None else environ

    def visit(value: Any, secret: bool) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, secret or is_secret_name(str(k)))
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v, secret)
        elif value is not None:
            text = str(value)
            if secret and _may_hold_credential(value):
                found.add(text)
            found.update(m["password"] for m in _URI_USERINFO.finditer(text))

    visit(dict(env), False)
    visit(config or {}, False)
    return {v for v in found if len(v) >= _MIN_SCRUB_LENGTH}


def redact_text(text: str, values: Iterable[str]) -> str:
    """`text` with every occurrence of `values` (longest first) and every URI password replaced by REDACTED."""
    for value in sorted(values, key=len, reverse=True):
        if value in text:
            text = text.replace(value, REDACTED)
    return redact_uri_passwords(text)


class RedactingFilter(logging.Filter):
    """A handler filter that rewrites each record's message with `redact_text` (never drops a record)."""

    def __init__(self, values: Iterable[str]) -> None:
        super().__init__()
        self.values = frozenset(values)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message, self.values)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            # The formatted traceback is cached on the record; redact it too.
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info), self.values)
            record.exc_info = None
        return True

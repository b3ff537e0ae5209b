"""A reward for tests/integration/test_dynamic_sampling_vllm.py, at module level so pool workers can import it."""

from __future__ import annotations

import hashlib
from typing import Any


def text_parity(completions: list[str], **_: Any) -> list[float]:
    """0 or 1 from a hash of the completion text: varies within most groups of a random model's samples."""
    return [float(hashlib.sha1(c.encode()).digest()[0] % 2) for c in completions]

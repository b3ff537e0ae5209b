"""The test tree itself: pytest imports test modules by basename (no packages under tests/), so two files of one
name in different folders stop the whole collection ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_test_modules_share_a_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py" and "__pycache__" not in p.parts)
    assert not {name for name, count in names.items() if count > 1}

"""Fixtures of the distributed lane: one launch of 4 gloo ranks shared by every test that needs it."""

from __future__ import annotations

import time
from typing import Any

import dist_harness
import dist_workers
import pytest


@pytest.fixture(scope="session")
def gloo_run() -> dict[str, Any]:
    """Every layout x config scenario of `dist_workers.worker`, run once on 4 spawned gloo ranks.

    Returns {"ranks": [per-rank results], "seconds": wall time of the launch}.
    """
    started = time.perf_counter()
    ranks = dist_harness.launch(dist_workers.worker, 4, timeout=240.0)
    return {"ranks": ranks, "seconds": time.perf_counter() - started}

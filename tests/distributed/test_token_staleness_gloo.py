"""Per-token staleness computed by the trainer on real gloo ranks equals one process: the `token_versions` step
tensor, turned into staleness, cut by rows (DP2) or sharded by Megatron's load-balanced CP chunks (CP2), summed
per staleness on each rank and reduced over dp x cp, gives the one-process `rollout/token_staleness_*` and
`rollout_corr/lag_<L>/*` (tests/distributed/staleness_workers.py)."""

from __future__ import annotations

from typing import Any

import dist_harness
import pytest
import staleness_workers as sw
from default_lane import require

pytestmark = pytest.mark.distributed
require("megatron.core", "megatron")


@pytest.fixture(scope="module")
def run() -> list[Any]:
    return dist_harness.launch(sw.worker, 2, timeout=240.0)


@pytest.mark.parametrize("layout", ["cp2", "dp2"])
def test_layout_matches_one_process(run: list[Any], layout: str) -> None:
    ref = sw.reference()
    assert ref["rollout/token_staleness_max"] == 3.0  # versions 3..6 at trainer version 6 (older clamp to 3)
    assert ref["rollout/token_staleness_mean"] > 0.5
    assert ref["rollout_corr/lag_3/k3_kl"] > ref["rollout_corr/lag_0/k3_kl"] > 0  # older tokens drift more
    for rank_result in run:
        got = rank_result[layout]
        assert set(got) == set(ref)
        for name, value in ref.items():
            assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name

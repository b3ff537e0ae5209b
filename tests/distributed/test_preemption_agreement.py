"""Every rank stops after the same step when a signal reaches one rank only (issue 23, item 1).

Real gloo processes and a real SIGUSR1 delivered to one rank: `StopRequest.agreed()` (one all-reduce of the flag
per step, `distributed.runtime.any_rank`) makes every rank stop where the single-process run stops.
"""

from __future__ import annotations

import pytest
from dist_harness import launch
from preemption_workers import stop_loop

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(signalled_rank: int) -> None:
    reference = stop_loop(0, 1, 0, 3, 10)  # one process, signalled after step 3
    assert reference == {"stopped_after": 3, "stopping": True, "signalled": True}
    results = launch(stop_loop, 2, signalled_rank, 3, 10)
    assert [r["stopped_after"] for r in results] == [3, 3]
    assert [r["signalled"] for r in results] == [rank == signalled_rank for rank in range(2)]


def test_no_signal_runs_every_step() -> None:
    results = launch(stop_loop, 2, -1, 3, 5)
    assert [(r["stopped_after"], r["stopping"]) for r in results] == [(5, False), (5, False)]

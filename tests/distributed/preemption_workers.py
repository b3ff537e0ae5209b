"""Rank functions for test_preemption_agreement.py (spawned processes import them by name)."""

from __future__ import annotations

import os
import signal
from typing import Any


def stop_loop(rank: int, world_size: int, signalled_rank: int, signal_at_step: int, steps: int) -> dict[str, Any]:
    """The trainer's loop shape: a step, then `StopRequest.agreed()`; only `signalled_rank` gets a real SIGUSR1,
    after its step `signal_at_step`. Returns the step each rank stopped after and whether it saw the signal."""
    from nemo_rollout_correction.trainer import preemption

    stop = preemption.install()
    try:
        step = 0
        stopping = stop.agreed()
        while step < steps and not stopping:
            step += 1
            if rank == signalled_rank and step == signal_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            stopping = stop.agreed()
        return {"stopped_after": step, "stopping": stopping, "signalled": stop.requested}
    finally:
        stop.release()

"""Shared by `nrc train` and `nrc audit`: the engine ranks' rollouts shared with every rank of the job."""

from __future__ import annotations

import dataclasses
from typing import Any

from nemo_rollout_correction.distributed.runtime import all_gather_object, broadcast_object
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

__all__ = ["broadcast_rollouts", "gather_rollouts"]


def broadcast_rollouts(batch: RolloutBatch | None, extra: Any = None) -> tuple[RolloutBatch, Any]:
    """Share the engine rank's rollouts (and `extra`, e.g. rewards) with every rank of the job.

    The engine rank (global rank 0) passes its batch; every other rank passes None. Samples travel as
    plain dicts (one `broadcast_object_list`); without torch.distributed this is the identity.
    """
    payload: Any = None
    if batch is not None:
        payload = ([dataclasses.asdict(s) for s in batch.samples], batch.n, batch.seconds, extra)
    received: Any = broadcast_object(payload, src=0)
    samples, n, seconds, extra = received
    return RolloutBatch([RolloutSample(**s) for s in samples], n=n, seconds=seconds), extra


def gather_rollouts(local: tuple[int, RolloutBatch] | None, extra: Any = None) -> tuple[RolloutBatch, list[Any]]:
    """Every engine's rollouts (and `extra`, e.g. its rewards) on every rank of the job, in engine order.

    Engine ranks pass `(engine_index, batch)`, the others None; one `all_gather_object` over the job. The
    batches are concatenated by engine index, so for prompts sharded contiguously across engines the result
    is in the order one engine generating every prompt would give; each engine's samples already carry
    `prompt_index` into the whole call. `seconds` is the slowest engine's (they generate at the same time).
    Returns the batch and the list of the engines' `extra`, in engine order.
    """
    payload: Any = None
    if local is not None:
        engine, batch = local
        payload = (engine, [dataclasses.asdict(s) for s in batch.samples], batch.n, batch.seconds, extra)
    gathered: list[Any] = all_gather_object(payload)
    received = sorted((p for p in gathered if p is not None), key=lambda p: p[0])
    if not received:
        raise RuntimeError("gather_rollouts: no rank passed an engine's rollouts")
    samples = [RolloutSample(**s) for p in received for s in p[1]]
    return (RolloutBatch(samples, n=received[0][2], seconds=max(p[3] for p in received)),
            [p[4] for p in received])

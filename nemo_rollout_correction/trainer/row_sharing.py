"""`RowSharing`: a step's rollouts moved between the ranks of the job, for `RolloutFleet` (trainer/fleet.py).

Two moves, both collectives that every rank calls in the same order:

- `share`: every engine's samples and rewards on every rank, in prompt order (`rollout.placement=rank0`: one
  broadcast from global rank 0; `per_dp_group`: one all-gather in which each engine's rank sends its share
  without logprobs and routing, which it keeps (`hold`));
- `localize`: after DAPO has chosen the step's batch, the kept logprobs and routing of the rows each
  data-parallel group trains, sent point-to-point to that group's ranks (per_dp_group only).

`share_whole` is `share` for partial rollouts, whose pool every rank holds whole (logprobs included). Each
move also brings every engine's latest weight-load seconds (`engine_refit_seconds`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from torch import Tensor

from nemo_rollout_correction.distributed.runtime import Runtime, all_gather_object, recv_object, send_object
from nemo_rollout_correction.harness.exchange import broadcast_rollouts, gather_rollouts
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

__all__ = ["RowSharing", "TrainRows"]

TrainRows = Callable[[int, int], Tensor]
"""`(num_samples, dp_rank) -> [rows]` the rows of a step's batch that data-parallel rank `dp_rank` trains."""


class RowSharing:
    """The fleet's rollouts between ranks (module docstring). Built on every rank (collective: every rank's role).

    Args:
        runtime: the job's ranks and parallel groups.
        placement: `rollout.placement` as resolved (`rank0` or `per_dp_group`).
        engine_index: this rank's engine's index (None without one).
        shares_rollouts: whether this rank contributes its engine's samples (one TP shard of a GPU engine does).
    """

    def __init__(self, runtime: Runtime, placement: str, engine_index: int | None, shares_rollouts: bool) -> None:
        self.runtime, self.groups = runtime, runtime.groups
        self.placement, self.engine_index, self.shares_rollouts = placement, engine_index, shares_rollouts
        # each engine's latest weight load (shared-buffer refit on CPU), as the last `share` reported it
        self.engine_refit_seconds: tuple[float, ...] = ()
        # per_dp_group: the full samples this engine generated, by (step, attempt), until `localize` hands their
        # logprobs and routing to the data-parallel group that trains them
        self._held: dict[tuple[int, int], list[Any]] = {}
        self._held_lock = threading.Lock()  # generate_local may run in another thread (async rollouts)
        # every rank's (dp rank, engine index if it shares rollouts): the plan of `localize`
        self._rank_roles: list[Any] = (all_gather_object((self.groups.dp_rank, engine_index if shares_rollouts
                                                          else None))
                                       if placement == "per_dp_group" else [])

    def hold(self, batch: RolloutBatch, step: int, attempt: int) -> None:
        """No collectives (engine rank that shares): per_dp_group, stamp each sample's origin and keep the samples
        until `localize` sends their logprobs and routing (`share` sends them without)."""
        if self.placement != "per_dp_group":
            return
        assert self.engine_index is not None, "hold runs on an engine rank"
        for index, sample in enumerate(batch.samples):
            sample.origin = (self.engine_index, step, attempt, index)
        self.keep(step, attempt, batch.samples)

    def keep(self, step: int, attempt: int, samples: list[RolloutSample]) -> None:
        """Keep samples whose origin is stamped (by `hold`, or a checkpoint's in-flight batch) for `localize`:
        per_dp_group, on a rank that shares its engine's samples."""
        if self.placement != "per_dp_group" or not self.shares_rollouts:
            return
        with self._held_lock:
            self._held[(step, attempt)] = list(samples)

    def share(self, local: tuple[RolloutBatch, list[float]] | None,
              push_seconds: float) -> tuple[RolloutBatch, list[float]]:
        """Collective: every engine's (batch, rewards) on every rank of the job, in prompt order.

        rank0: a broadcast from global rank 0. per_dp_group: one all-gather over the job in which each
        engine's rank sends its share without logprobs and routing (`localize` moves those).
        Also records the engines' latest refit seconds (`push_seconds`: this rank's engine's).
        """
        batch, rewards = local if local is not None else (None, None)
        if self.placement == "rank0":
            shared, rewards = broadcast_rollouts(batch, rewards)
            self.engine_refit_seconds = (push_seconds,)
            return shared, list(rewards)
        mine = None
        if self.shares_rollouts and self.engine_index is not None and batch is not None:
            # metadata and token ids go to every rank; logprobs and routing only where trained (localize)
            light = [dataclasses.replace(s, logprobs=[], routed_experts=None) for s in batch.samples]
            mine = (self.engine_index, RolloutBatch(light, n=batch.n, seconds=batch.seconds))
        shared, extras = gather_rollouts(mine, (list(rewards or []), push_seconds))
        self.engine_refit_seconds = tuple(seconds for _, seconds in extras)
        return shared, [r for engine_rewards, _ in extras for r in engine_rewards]

    def share_whole(self, local: RolloutBatch | None, push_seconds: float) -> RolloutBatch:
        """Collective: every engine's samples whole (logprobs included) on every rank, in prompt order (partial
        rollouts: every rank keeps the same carried-over pool). Records the engines' latest refit seconds."""
        if self.placement == "rank0":
            shared, refit = broadcast_rollouts(local, push_seconds)
            self.engine_refit_seconds = (refit,)
            return shared
        mine = None
        if self.shares_rollouts and self.engine_index is not None and local is not None:
            mine = (self.engine_index, local)
        shared, extras = gather_rollouts(mine, push_seconds)
        self.engine_refit_seconds = tuple(extras)
        return shared

    def localize(self, batch: RolloutBatch, step: int, train_rows: TrainRows) -> RolloutBatch:
        """Collective: the step's chosen batch with the logprobs and routing of the rows this rank trains.

        per_dp_group: `share` gave every rank every sample without `logprobs` / `routed_experts`; now
        each engine's rank sends, for each rank, the rows that rank's data-parallel group trains (`train_rows`:
        after DAPO has chosen the batch). Pairs (engine rank, receiving rank) go in one global order, the same
        on every rank, so the blocking gloo sends cannot deadlock. Rows other groups train keep `logprobs == []`
        (zeros in `to_tensors`). rank0: the batch unchanged (it was broadcast whole).
        """
        if self.placement == "rank0":
            return batch
        me = self.runtime.rank
        owner: list[tuple[int, int, int, int]] = []
        for sample in batch.samples:
            if sample.origin is None:
                raise RuntimeError("RowSharing.localize: a sample without its origin (not from RowSharing.share)")
            owner.append(sample.origin)
        rows_of_dp = {d: sorted(train_rows(len(batch.samples), d).tolist()) for d in range(self.groups.dp_size)}
        received: dict[int, tuple[list[float], Tensor | None]] = {}
        with self._held_lock:
            held = {(key, i): s for key, samples in self._held.items() for i, s in enumerate(samples)}
        for src, (_, engine) in enumerate(self._rank_roles):
            if engine is None:
                continue
            for dst, (dst_dp, _) in enumerate(self._rank_roles):
                rows = [r for r in rows_of_dp[dst_dp] if owner[r][0] == engine]
                if not rows or me not in (src, dst):
                    continue
                if me == src:
                    full = [held[((owner[r][1], owner[r][2]), owner[r][3])] for r in rows]
                    payload = {r: (s.logprobs, s.routed_experts) for r, s in zip(rows, full, strict=True)}
                    if dst == me:
                        received |= payload
                    else:
                        send_object(payload, dst)
                else:
                    got: Any = recv_object(src)
                    received |= got
        with self._held_lock:  # this step's rollouts are placed; later steps' (async) stay
            for key in [k for k in self._held if k[0] <= step]:
                del self._held[key]
        samples = [dataclasses.replace(s, logprobs=list(received[i][0]), routed_experts=received[i][1])
                   if i in received else s for i, s in enumerate(batch.samples)]
        return RolloutBatch(samples, n=batch.n, seconds=batch.seconds)

"""`InFlightRollouts`: the rollouts a checkpoint holds in flight, for `RolloutFleet` (trainer/fleet.py).

What is in flight at a step boundary: with async rollouts the pipeline's queued batches (prompts, versions, the
engine rank's samples; trainer/async_rollouts.py), with partial rollouts the carried-over pool
(trainer/partial_rollouts.py), with both the pool after every queued job. `state` takes them when the checkpoint
is taken (it waits for the queued engine jobs), `save` writes them beside the checkpoint's shards, `restore` reads
them back on resume and the first steps take the restored batches (`next_records` synchronous, `for_pipeline`
async) before the sampler's new prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.runtime import Runtime, barrier
from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
from nemo_rollout_correction.trainer import async_rollouts, partial_rollouts
from nemo_rollout_correction.trainer.checkpoint_door import VerifiedCheckpoint
from nemo_rollout_correction.trainer.row_sharing import RowSharing

__all__ = ["InFlightRollouts"]


class InFlightRollouts:
    """A checkpoint's in-flight rollouts: taken, saved, restored and handed to the first steps (module docstring).

    Args:
        cfg: the run's config (`rollout.max_staleness`, `rollout.stale_policy`).
        runtime: the job's ranks.
        num_engines: the fleet's engines (with the world and data-parallel sizes, `placement_key`).
        pipeline: the fleet's async pipeline as it is now (None before the first async step or without one).
        partial: the synchronous partial rollouts' pool (None without).
        partial_async: the async partial rollouts' pool (None without).
        sharing: the fleet's `RowSharing` (per_dp_group: a restored batch's samples are kept for `localize`).
        has_engine: whether this rank hosts an engine (it holds the async pool).
        log: progress lines.
    """

    def __init__(self, cfg: TrainConfig, runtime: Runtime, num_engines: int, *,
                 pipeline: Callable[[], async_rollouts.RolloutPipeline | None],
                 partial: partial_rollouts.PartialRollouts | None,
                 partial_async: partial_rollouts.AsyncPartialJobs | None, sharing: RowSharing, has_engine: bool,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.runtime, self.num_engines, self.log = cfg, runtime, num_engines, log
        # what decides which engine generated which samples: saved batches are reused only under the same placement
        self.placement_key = {"num_engines": num_engines, "world_size": runtime.world_size,
                              "data_parallel_size": runtime.groups.dp_size}
        self.pipeline, self.partial, self.partial_async = pipeline, partial, partial_async
        self.sharing, self.has_engine = sharing, has_engine
        # the restored batches for the first steps, and whether to regenerate them
        self._restored: tuple[list[async_rollouts.PendingBatch], bool] | None = None

    def state(self) -> dict[str, Any] | None:
        """Async rollouts: wait for the queued engine jobs and return this rank's in-flight batches (prompts,
        versions, the engine rank's samples) for the checkpoint; partial rollouts: the pool; None otherwise."""
        if self.partial is not None:  # synchronous only (config rule): the carried-over pool
            return {"partial": self.partial.state()}
        pipeline = self.pipeline()
        if pipeline is None:
            return None
        pipeline.drain()
        state = {**pipeline.state(self.num_engines), "placement": self.placement_key}
        if self.partial_async is not None and self.has_engine:  # the pool after every queued job
            state["partial_async"] = self.partial_async.state()
        return state

    def save(self, step_dir: Path, state: dict[str, Any] | None) -> None:
        """Write `state()` to `<step_dir>/async_rollouts/rank_<r>.pt` (every rank; collective: ends in a barrier
        so every file exists before `meta.json` marks the checkpoint complete). No-op for None."""
        if state is None:
            return
        if "partial" in state:  # rank 0 writes the pool (identical on every rank)
            partial_rollouts.save_state(step_dir, state["partial"], is_main=self.runtime.is_main)
            barrier()
            return
        if "partial_async" in state:  # the engine's rank (rank 0) holds the pool
            state = dict(state)
            partial_rollouts.save_state(step_dir, state.pop("partial_async"), is_main=True)
        path = async_rollouts.pending_file(step_dir, self.runtime.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        barrier()

    def restore(self, checkpoint: VerifiedCheckpoint) -> None:
        """Read the checkpoint's in-flight async rollouts (`async_rollouts.pending_file`) for the first steps.

        Prompts and versions come from rank 0's file (identical on every rank), results from this rank's own.
        Under another engine placement they are regenerated with the checkpoint's weights (not exact then).
        """
        step_dir = checkpoint.step_dir
        pool = partial_rollouts.load_state(checkpoint)
        shared = async_rollouts.load_pending(checkpoint, 0)
        if pool is not None and (self.partial is not None or self.partial_async is not None):
            saved = None if shared is None else (shared.get("max_staleness"), shared.get("placement"))
            if saved is not None and saved != (self.cfg.rollout.max_staleness, self.placement_key):
                raise ValueError(  # the queued stages already moved the pool: they can be neither rerun nor dropped
                    f"the checkpoint {step_dir} holds partial rollouts in flight in the async pipeline (rollout."
                    f"max_staleness={saved[0]}, engine placement {saved[1]}); resume with the same "
                    f"rollout.max_staleness and layout (now {self.cfg.rollout.max_staleness}, {self.placement_key})")
            if self.partial is not None:
                self.partial.restore(pool)
            else:
                assert self.partial_async is not None
                self.partial_async.restore(pool)
        elif pool is not None:
            self.log(f"[nrc train] partial rollouts are off: the checkpoint's {len(pool['groups'])} carried-over "
                     "groups are dropped with their prompts")
        if shared is None:
            return
        regenerate = shared.get("placement") != self.placement_key
        own = shared if self.runtime.rank == 0 else async_rollouts.load_pending(checkpoint, self.runtime.rank)
        batches = async_rollouts.restored_batches(shared, own)
        steps = ", ".join(str(b.step + 1) for b in batches)
        if self.cfg.rollout.max_staleness == 0:  # synchronous now: every saved batch is stale
            wait = self.cfg.rollout.stale_policy == "wait"
            self.log(f"[nrc train] rollout.max_staleness=0: the checkpoint's in-flight rollouts of steps {steps} are "
                     + ("regenerated with the current weights (rollout.stale_policy=wait)" if wait else
                        "dropped with their prompts (rollout.stale_policy=drop)"))
            self._restored = (batches, True) if wait else None
            return
        if regenerate:
            self.log(f"[nrc train] the checkpoint's in-flight rollouts (steps {steps}) were generated under another "
                     f"engine placement ({shared.get('placement')} -> {self.placement_key}): regenerating their "
                     "prompts with the checkpoint's weights (the resumed run is not exact)")
        else:
            self.log(f"[nrc train] restored the checkpoint's in-flight rollouts of steps {steps}")
            for pending in batches:  # per_dp_group: `localize` sends their logprobs from this rank's copy
                if pending.local is not None:
                    self.sharing.keep(pending.step, 0, pending.local[0].samples)
        self._restored = (batches, regenerate)

    def next_records(self, sampler: PromptSampler) -> list[PromptRecord]:
        """The synchronous step's prompts: the sampler's next batch, or first the prompts of in-flight async
        rollouts restored from a checkpoint (a run resumed with rollout.max_staleness=0)."""
        if self._restored is None:
            return sampler.next_batch()
        batches, _ = self._restored
        records = batches.pop(0).records
        if not batches:
            self._restored = None
        return records

    def for_pipeline(self) -> tuple[list[async_rollouts.PendingBatch], bool]:
        """The restored batches the async pipeline starts with, and whether to regenerate them (once)."""
        restored, regenerate = self._restored or ([], False)
        self._restored = None
        return restored, regenerate

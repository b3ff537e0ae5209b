"""The process groups the distributed layer reduces over: TP, CP, DP, DP x CP and PP.

A `ParallelGroups` names, for the calling rank, the groups of Megatron-Core's parallel layout and
the rank's coordinates in them. Three ways to get one:

- `ParallelGroups.from_megatron()`: from an initialised `megatron.core.parallel_state` (imported
  lazily; megatron-core is an optional dependency, installed in the default CI lane through the
  `megatron` extra, where tests/integration/test_megatron_tp.py exercises this path);
- `build_parallel_groups(tp, cp, dp, pp)`: from plain `torch.distributed`, in Megatron's default
  rank order (tensor parallel fastest, then context parallel, then data parallel, then pipeline);
  used by the gloo tests and by callers without Megatron;
- the constructor, for groups built elsewhere; `ParallelGroups.single()` for one process.

Which group each quantity is reduced over (docs/design.md, "The reduction contract"): per-sequence
partials over `cp`; metric partials and loss denominators over `dp_cp`; nothing over `tp` (values
are replicated there after the vocab-parallel logprob); over `pp` only the trainer's step-level
exchanges (gradient norm, the last stage's metrics, the refit weights). No function of this package reduces over
the default (WORLD) group: a WORLD collective would include other pipeline stages and TP replicas,
count their values several times, and hang stages that have no loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

# ProcessGroup is re-exported: the layers above name the type through this package, never torch.distributed.
__all__ = ["ParallelGroups", "ProcessGroup", "build_parallel_groups", "megatron_rank"]


@dataclass(frozen=True)
class ParallelGroups:
    """The calling rank's process groups and coordinates.

    A group may be None only where its size is 1 (nothing to reduce). `dp_cp_rank` is the rank
    inside `dp_cp_group` (context-parallel fastest, as Megatron orders it).
    """

    tp_group: ProcessGroup | None = None
    """Tensor-parallel group (only the vocab-parallel logprob communicates over it)."""
    cp_group: ProcessGroup | None = None
    """Context-parallel group: the ranks that hold the pieces of the same sequences."""
    dp_group: ProcessGroup | None = None
    """Data-parallel group without context parallelism."""
    dp_cp_group: ProcessGroup | None = None
    """Data x context parallel group: every rank of one pipeline stage and one TP coordinate."""
    tp_rank: int = 0
    """This rank's index in `tp_group`."""
    tp_size: int = 1
    """Tensor-parallel size."""
    cp_rank: int = 0
    """This rank's index in `cp_group`."""
    cp_size: int = 1
    """Context-parallel size."""
    dp_rank: int = 0
    """This rank's index in `dp_group`."""
    dp_size: int = 1
    """Data-parallel size (not counting context parallelism)."""
    dp_cp_rank: int = 0
    """This rank's index in `dp_cp_group`."""
    is_last_pipeline_stage: bool = True
    """Whether this rank holds the last pipeline stage (the only one with a loss and metrics)."""
    pp_group: ProcessGroup | None = None
    """Pipeline-parallel group: the stages of this rank's pipeline (same tp, cp and dp coordinates)."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    pp_size: int = 1
    """Pipeline-parallel size (number of stages)."""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank={rank} must lie in [0, {name}_size={size})")
        if self.is_last_pipeline_stage != (self.pp_rank == self.pp_size - 1):
            raise ValueError(f"is_last_pipeline_stage={self.is_last_pipeline_stage} contradicts pp_rank={self.pp_rank} "
                             f"of pp_size={self.pp_size}")
        if not 0 <= self.dp_cp_rank < self.dp_cp_size:
            raise ValueError(f"dp_cp_rank={self.dp_cp_rank} must lie in [0, dp_cp_size={self.dp_cp_size})")
        for name, size in (("tp", self.tp_size), ("cp", self.cp_size), ("dp", self.dp_size),
                           ("dp_cp", self.dp_cp_size), ("pp", self.pp_size)):
            if size > 1 and getattr(self, f"{name}_group") is None:
                raise ValueError(f"{name}_group is None but {name} size is {size}; pass the process group")

    @property
    def dp_cp_size(self) -> int:
        """Size of the data x context parallel group."""
        return self.dp_size * self.cp_size

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process: every size is 1 and nothing is ever communicated."""
        return cls()

    @classmethod
    def from_megatron(cls) -> ParallelGroups:
        """The groups of an initialised `megatron.core.parallel_state`.

        Raises ImportError when megatron-core is not installed and RuntimeError when its parallel
        state is not initialised. Exercised on a real TP=1 x DP=2 and TP=2 parallel state by
        tests/integration/test_megatron_tp.py (the `megatron` extra is in the default CI lane).
        """
        from megatron.core import parallel_state as mpu  # optional dependency, imported lazily

        if not mpu.model_parallel_is_initialized():
            raise RuntimeError("megatron.core.parallel_state is not initialised; call "
                               "initialize_model_parallel(...) first or use build_parallel_groups")
        tp = mpu.get_tensor_model_parallel_group()
        cp = mpu.get_context_parallel_group()
        dp = mpu.get_data_parallel_group(with_context_parallel=False)
        dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
        pp = mpu.get_pipeline_model_parallel_group()
        pp_rank, pp_size = dist.get_rank(pp), dist.get_world_size(pp)
        return cls(
            tp_group=tp, cp_group=cp, dp_group=dp, dp_cp_group=dp_cp,
            tp_rank=dist.get_rank(tp), tp_size=dist.get_world_size(tp),
            cp_rank=dist.get_rank(cp), cp_size=dist.get_world_size(cp),
            dp_rank=dist.get_rank(dp), dp_size=dist.get_world_size(dp),
            dp_cp_rank=dist.get_rank(dp_cp), is_last_pipeline_stage=pp_rank == pp_size - 1,
            pp_group=pp, pp_rank=pp_rank, pp_size=pp_size,
        )


def megatron_rank(tp_rank: int, cp_rank: int, dp_rank: int, pp_rank: int, tp: int, cp: int, dp: int) -> int:
    """Position of a (tp, cp, dp, pp) coordinate in Megatron's default order `tp-cp-ep-dp-pp` (ep = 1)."""
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))


def build_parallel_groups(
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    pp: int = 1,
    *,
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
) -> ParallelGroups | None:
    """Build TP, CP, DP and DP x CP groups with plain `torch.distributed` in Megatron's rank order.

    ranks: the global ranks to lay out as `tp x cp x dp x pp`, in ascending order (default: the
        whole default group); `len(ranks)` must equal `tp * cp * dp * pp`. Several layouts can
        run side by side on disjoint rank lists.
    Every process of the default group must call this with the same arguments, because
    `torch.distributed.new_group` is collective over the default group. Returns None on a process
    outside `ranks`.
    """
    if min(tp, cp, dp, pp) < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tp={tp} cp={cp} dp={dp} pp={pp}")
    # Ascending, so each coordinate equals the rank inside its group (new_group orders by global rank).
    layout = list(range(dist.get_world_size())) if ranks is None else sorted(ranks)
    if len(layout) != tp * cp * dp * pp or len(set(layout)) != len(layout):
        raise ValueError(f"{len(layout)} distinct ranks are needed for tp={tp} x cp={cp} x dp={dp} x pp={pp} "
                         f"= {tp * cp * dp * pp}, got {layout}")
    me = dist.get_rank()
    coords = {layout[megatron_rank(t, c, d, p, tp, cp, dp)]: (t, c, d, p)
              for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)}
    options: dict[str, Any] = {}
    if timeout is not None:
        options["timeout"] = timeout
    if backend is not None:
        options["backend"] = backend

    def members(vary: str, fixed: tuple[int, int, int, int]) -> list[int]:
        t0, c0, d0, p0 = fixed
        out = []
        for p in range(pp) if "p" in vary else [p0]:
            for d in range(dp) if "d" in vary else [d0]:
                for c in range(cp) if "c" in vary else [c0]:
                    for t in range(tp) if "t" in vary else [t0]:
                        out.append(layout[megatron_rank(t, c, d, p, tp, cp, dp)])
        return out

    mine: dict[str, ProcessGroup | None] = {}
    # Every process creates every group, in the same order (new_group is collective).
    for vary in ("t", "c", "d", "cd", "p"):
        seen: set[tuple[int, ...]] = set()
        for rank in layout:
            group_ranks = tuple(members(vary, coords[rank]))
            if group_ranks in seen:
                continue
            seen.add(group_ranks)
            group = dist.new_group(list(group_ranks), **options)
            if me in group_ranks:
                mine[vary] = group
    if me not in coords:
        return None
    t, c, d, p = coords[me]
    return ParallelGroups(
        tp_group=mine["t"], cp_group=mine["c"], dp_group=mine["d"], dp_cp_group=mine["cd"],
        tp_rank=t, tp_size=tp, cp_rank=c, cp_size=cp, dp_rank=d, dp_size=dp,
        dp_cp_rank=c + cp * d, is_last_pipeline_stage=(p == pp - 1),
        pp_group=mine["p"], pp_rank=p, pp_size=pp,
    )

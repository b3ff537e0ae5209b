"""Step-level exchanges between pipeline stages (Megatron pipeline parallelism).

Megatron's schedule moves activations between stages and its `finalize_model_grads` syncs the two
copies of a tied embedding; what it leaves to the trainer is here:

- `broadcast_from_last_stage`: the loss, the `rollout_corr/*` metrics and the review exist only on
  the last stage (it holds the output layer); the logging rank is stage 0.
- `gather_weights_to_first_stage`: the rollout engine lives on stage 0 but every stage holds a part
  of the model; each stage's (already TP-gathered) Hugging Face tensors travel to stage 0 for a refit,
  one flat buffer per dtype and stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.tensor_gather import collective_device


def stage_rank(groups: ParallelGroups, stage: int) -> int:
    """Global rank of pipeline stage `stage` in this rank's pipeline."""
    if groups.pp_size == 1:
        return dist.get_rank() if dist.is_initialized() else 0
    return int(dist.get_global_rank(groups.pp_group, stage))  # type: ignore[arg-type]


def broadcast_from_last_stage(obj: Any, groups: ParallelGroups) -> Any:
    """The last stage's `obj` on every stage of this pipeline (identity for PP = 1)."""
    if groups.pp_size == 1:
        return obj
    box = [obj if groups.is_last_pipeline_stage else None]
    dist.broadcast_object_list(box, src=stage_rank(groups, groups.pp_size - 1), group=groups.pp_group)
    return box[0]


def _flat_by_dtype(weights: list[tuple[str, Tensor]]) -> dict[torch.dtype, Tensor]:
    flats: dict[torch.dtype, list[Tensor]] = {}
    for _, tensor in weights:
        flats.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in flats.items()}


def gather_weights_to_first_stage(weights: Iterable[tuple[str, Tensor]], groups: ParallelGroups
                                  ) -> Iterator[tuple[str, Tensor]]:
    """Stage 0: its own (name, tensor) pairs, then every later stage's; other stages: send, yield nothing.

    Every stage of the pipeline must exhaust the iterator. The metadata (names, shapes, dtypes) goes as
    a pickled object, the values as one flat buffer per dtype; order is stage order, then each stage's
    own order.
    """
    if groups.pp_size == 1:
        yield from weights
        return
    first = stage_rank(groups, 0)
    if groups.pp_rank == 0:
        yield from weights
        for stage in range(1, groups.pp_size):
            src = stage_rank(groups, stage)
            meta: list[Any] = [None]
            dist.recv_object_list(meta, src=src, group=groups.pp_group)
            entries: list[tuple[str, tuple[int, ...], torch.dtype]] = meta[0]
            counts: dict[torch.dtype, int] = {}
            for _, shape, dtype in entries:
                counts[dtype] = counts.get(dtype, 0) + int(torch.Size(shape).numel())
            flats = {}
            for dtype in sorted(counts, key=str):
                flats[dtype] = torch.empty(counts[dtype], dtype=dtype, device=collective_device(groups.pp_group))
                dist.recv(flats[dtype], src=src, group=groups.pp_group)
            offsets = dict.fromkeys(counts, 0)
            for name, shape, dtype in entries:
                numel = int(torch.Size(shape).numel())
                yield name, flats[dtype][offsets[dtype]:offsets[dtype] + numel].view(shape)
                offsets[dtype] += numel
        return
    device = collective_device(groups.pp_group)
    own = [(name, tensor.detach().to(device)) for name, tensor in weights]
    dist.send_object_list([[(name, tuple(t.shape), t.dtype) for name, t in own]], dst=first, group=groups.pp_group)
    flats = _flat_by_dtype(own)
    for dtype in sorted(flats, key=str):
        dist.send(flats[dtype].contiguous(), dst=first, group=groups.pp_group)


__all__ = ["broadcast_from_last_stage", "gather_weights_to_first_stage", "stage_rank"]

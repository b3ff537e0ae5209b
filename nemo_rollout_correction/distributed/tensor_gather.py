"""Gather tensor-parallel parameter shards into the full tensor (weight refit and export).

Megatron-Core splits a TP-sharded parameter into equal contiguous chunks along its partition
dimension, chunk `r` on TP rank `r`. Refitting the rollout engine or exporting a Hugging Face
checkpoint needs the full tensor: one all-gather per parameter over the TP group. Kept here because
torch.distributed belongs to this layer only (DESIGN.md, "Layers").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of `group`; 1 when torch.distributed is not initialised or `group` is None."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group))


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in `group`; 0 when torch.distributed is not initialised or `group` is None."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank(group))


def gather_along_dim(shard: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's `shard` along `dim` in rank order (one all-gather; no-op for one rank).

    shard: this rank's chunk, same shape on every rank. Returns the full tensor on every rank.
    """
    size = group_size(group)
    if size == 1:
        return shard
    chunks = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(chunks, shard.contiguous(), group=group)
    return torch.cat(chunks, dim=dim)


def broadcast_object(obj: object, src: int, group: ProcessGroup | None = None) -> object:
    """Broadcast a picklable object from global rank `src` (identity without torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


__all__ = ["broadcast_object", "gather_along_dim", "group_rank", "group_size"]

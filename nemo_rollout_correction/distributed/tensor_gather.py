"""Gather tensor-parallel parameter shards into the full tensor (weight refit and export).

Also the differentiable all-gather of the CPU context-parallel attention (`all_gather_with_grad`:
every CP rank's keys and values) and `all_gather_list` (the trainer's review of CP-sharded tokens).

Megatron-Core splits a TP-sharded parameter into equal contiguous chunks along its partition
dimension, chunk `r` on TP rank `r`. Refitting the rollout engine or exporting a Hugging Face
checkpoint needs the full tensor: one all-gather per parameter over the TP group. Kept here because
torch.distributed belongs to this layer only (docs/design.md, "Layers").
"""

from __future__ import annotations

from typing import Any

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


def collective_device(group: ProcessGroup | None) -> torch.device:
    """Where a buffer for a collective over `group` must live: the current GPU for NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_along_dim(shard: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's `shard` along `dim` in rank order (one all-gather; no-op for one rank).

    shard: this rank's chunk, same shape on every rank. Returns the full tensor on every rank.
    """
    if group_size(group) == 1:
        return shard
    return torch.cat(all_gather_list(shard, group), dim=dim)


class _AllGatherWithGrad(torch.autograd.Function):
    """All-gather along `dim` whose backward hands each rank the summed gradient of its own chunk."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size = group_rank(group), group_size(group)
        return gather_along_dim(shard, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # Every rank used every chunk: the gradient of chunk r is the sum over ranks of their grad
        # slice r (a reduce-scatter; gloo has none, so all-reduce and keep the own slice).
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def all_gather_with_grad(shard: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """`gather_along_dim` that backpropagates: the gradient of the full tensor flows to each shard's owner."""
    if group_size(group) == 1:
        return shard
    out: Tensor = _AllGatherWithGrad.apply(shard, dim, group)  # type: ignore[no-untyped-call]
    return out


def all_gather_list(shard: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """Every rank's `shard` (same shape everywhere), in rank order; `[shard]` for one rank."""
    size = group_size(group)
    if size == 1:
        return [shard]
    chunks = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(chunks, shard.contiguous(), group=group)
    return chunks


def broadcast_object(obj: object, src: int, group: ProcessGroup | None = None) -> object:
    """Broadcast a picklable object from global rank `src` (identity without torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list[object]:
    """Every rank's picklable `obj`, in rank order of `group` (default: the whole job); `[obj]` without
    torch.distributed. One `all_gather_object`: every rank sends its own object once, so N sources cost one
    collective instead of N broadcasts."""
    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def send_object(obj: object, dst: int) -> None:
    """Send a picklable object to global rank `dst` (blocks until it is received: callers order their pairs)."""
    dist.send_object_list([obj], dst=dst)


def recv_object(src: int) -> object:
    """Receive the object global rank `src` sends with `send_object`."""
    box: list[object] = [None]
    dist.recv_object_list(box, src=src)
    return box[0]


__all__ = ["all_gather_list", "all_gather_object", "all_gather_with_grad", "broadcast_object", "collective_device",
           "gather_along_dim", "group_rank", "group_size", "recv_object", "send_object"]

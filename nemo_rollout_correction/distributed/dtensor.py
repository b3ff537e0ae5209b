"""DTensor logits (NeMo-RL's DTensor worker at TP > 1) as a local vocabulary shard and its group.

NeMo-RL's DTensor policy hands the loss a `torch.distributed.tensor.DTensor` whose last dimension
(the vocabulary) is sharded over the TP mesh dimension. Mixing it with plain tensors in `gather`
fails (`aten.gather.default got mixed torch.Tensor and DTensor`), so the vocab-parallel logprob
takes its local shard (`to_local`, differentiable: the gradient flows back into the DTensor) and
the mesh dimension's process group, which is what `vocab_parallel_logprobs` already computes with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["VocabShard", "vocab_shard_of"]


@dataclass(frozen=True)
class VocabShard:
    """A plain-tensor view of (possibly DTensor) logits for the vocab-parallel logprob.

    logits: `[..., V_local]` this rank's columns (the input itself when it was no DTensor).
    group: the process group the vocabulary is sharded over; None when not sharded (plain tensor
        or replicated DTensor).
    vocab_start: first global vocabulary id of `logits` (None: let the caller's default apply).
    """

    logits: Tensor
    group: ProcessGroup | None
    vocab_start: int | None


def vocab_shard_of(logits: Tensor) -> VocabShard:
    """Unwrap DTensor logits; plain tensors pass through unchanged.

    Supported placements: `Replicate()` on every mesh dimension (the full vocabulary on each rank),
    or `Shard(-1)` (the vocabulary) on one mesh dimension and `Replicate()` on the others. Anything
    else (a `Partial` sum, a shard of the batch or sequence dimension) raises ValueError naming the
    placements, since the logprob of a sampled token needs whole vocabulary rows.
    """
    if not isinstance(logits, DTensor):
        return VocabShard(logits, None, None)
    vocab_dim = logits.ndim - 1
    mesh = logits.device_mesh
    sharded: list[int] = []
    for mesh_dim, placement in enumerate(logits.placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard) and placement.dim in (vocab_dim, -1):
            sharded.append(mesh_dim)
            continue
        raise ValueError(
            f"DTensor logits with placements {tuple(logits.placements)} are not supported: the vocabulary "
            f"(dim {vocab_dim}) may be sharded over one mesh dimension (Shard({vocab_dim})) and every other "
            "placement must be Replicate(); redistribute the logits (e.g. logits.redistribute(placements=...))"
        )
    local = logits.to_local()
    if not sharded:
        return VocabShard(local, None, None)
    if len(sharded) > 1:
        raise ValueError(f"DTensor logits shard the vocabulary over {len(sharded)} mesh dimensions "
                         f"{tuple(logits.placements)}; shard it over one (the TP dimension)")
    mesh_dim = sharded[0]
    size = mesh.size(mesh_dim)
    # DTensor's Shard follows torch.chunk: ceil(V / n) columns per rank, the last ones may hold fewer.
    per_rank = math.ceil(logits.shape[vocab_dim] / size)
    vocab_start = mesh.get_local_rank(mesh_dim) * per_rank
    group = mesh.get_group(mesh_dim)
    return VocabShard(local, group, vocab_start)

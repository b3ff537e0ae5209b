"""Context parallelism: which tokens a CP rank holds, and the per-sequence reduction over the CP group.

Under context parallelism (CP) every sequence of a microbatch is split along the token axis over
the `cp` ranks of a CP group. Two layouts are supported:

- `load_balanced` (Megatron-Core's, used with causal attention): the sequence is cut into
  `2 * cp` equal chunks and rank r holds chunks `r` and `2*cp - 1 - r`, so every rank gets the same
  amount of causal-attention work. With cp = 2 and 8 tokens:
  rank 0 holds tokens [0 1 | 6 7], rank 1 holds [2 3 | 4 5].
- `contiguous`: `cp` equal chunks, rank r holds chunk r.

Token-level terms of rollout correction are local to a rank. Everything sequence-level (sequence
and geometric IS, sequence rejection, the veto, per-sequence metrics) needs each sequence's SUM /
MAX / MIN of token terms over the whole sequence. `gather_sequence_partials` produces those with
ONE all-gather of a small `[k, batch]` table of per-sequence partials (never the tokens), reduced
locally in rank order, so every CP rank ends with bitwise identical sequence statistics and makes
identical decisions.

Packed sequences (Megatron's THD format: the tokens of several sequences back to back, with
`cu_seqlens` boundaries) are split per sequence in the same layouts (`thd_token_indices`), and
`PackedSequences` maps a rank's packed tokens to a padded `[num_seqs, max_len]` view, so the same
correction and the same per-sequence reduction apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.reduce import all_gather_flat
from nemo_rollout_correction.distributed.tensor_gather import all_gather_list

CpLayout = Literal["load_balanced", "contiguous"]
CP_LAYOUTS: tuple[str, ...] = get_args(CpLayout)

__all__ = [
    "CP_LAYOUTS",
    "CpLayout",
    "CpNextTokenBatch",
    "GatheredSequences",
    "PackedSequences",
    "cp_token_indices",
    "gather_cp_tokens",
    "gather_sequence_partials",
    "shard_next_token_batch",
    "shard_sequence",
    "thd_token_indices",
    "unshard_sequence",
]


def _check_layout(seq_len: int, cp_size: int, cp_rank: int, layout: str) -> int:
    """Validate and return the chunk length."""
    if layout not in CP_LAYOUTS:
        raise ValueError(f"layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    num_chunks = 2 * cp_size if layout == "load_balanced" else cp_size
    if seq_len % num_chunks:
        raise ValueError(f"sequence length {seq_len} must be divisible by {num_chunks} for the {layout} layout "
                         f"with cp={cp_size}; pad the sequence (Megatron pads to a multiple of 2*cp)")
    return seq_len // num_chunks


def cp_token_indices(seq_len: int, cp_size: int, cp_rank: int, layout: CpLayout = "load_balanced",
                     device: torch.device | str | None = None) -> Tensor:
    """Positions `[seq_len // cp_size]` (int64, ascending) of the tokens CP rank `cp_rank` holds."""
    chunk = _check_layout(seq_len, cp_size, cp_rank, layout)
    chunks = [cp_rank, 2 * cp_size - 1 - cp_rank] if layout == "load_balanced" else [cp_rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def shard_sequence(x: Tensor, cp_size: int, cp_rank: int, layout: CpLayout = "load_balanced",
                   dim: int = -1) -> Tensor:
    """This CP rank's tokens of `x` along `dim` (e.g. `[batch, seq]` -> `[batch, seq // cp]`), a copy."""
    dim = dim % x.dim()
    chunk = _check_layout(x.shape[dim], cp_size, cp_rank, layout)
    if layout == "contiguous":
        return x.narrow(dim, cp_rank * chunk, chunk).clone()
    first = x.narrow(dim, cp_rank * chunk, chunk)
    second = x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)
    return torch.cat([first, second], dim=dim)


def unshard_sequence(shards: Sequence[Tensor], layout: CpLayout = "load_balanced", dim: int = -1) -> Tensor:
    """Inverse of `shard_sequence`: the full tensor from the shards of CP ranks 0..cp-1 (for tests and references)."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("need at least one shard")
    dim = dim % shards[0].dim()
    if layout not in CP_LAYOUTS:
        raise ValueError(f"layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    local = shards[0].shape[dim]
    if local % 2:
        raise ValueError(f"a load-balanced shard holds two equal chunks; got length {local}")
    chunk = local // 2
    pieces: list[Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        pieces[rank] = shard.narrow(dim, 0, chunk)
        pieces[2 * cp_size - 1 - rank] = shard.narrow(dim, chunk, chunk)
    return torch.cat([p for p in pieces if p is not None], dim=dim)


@dataclass(frozen=True)
class CpNextTokenBatch:
    """This CP rank's share of a next-token batch (Megatron's load-balanced layout).

    All `[rows, padded // cp]`: `input_ids` for the model, `labels` (the next token of every held
    position; pad past the end), `position_ids` `[padded // cp]` (global positions, ascending), and every
    per-token tensor given, cut the same way. `padded` is the width rounded up to a multiple of 2 * cp.
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    tokens: dict[str, Tensor]
    padded: int


def shard_next_token_batch(input_ids: Tensor, tokens: Mapping[str, Tensor], cp_size: int, cp_rank: int, *,
                           pad_id: int, fill: Mapping[str, float | bool] | None = None) -> CpNextTokenBatch:
    """Cut a right-padded `[rows, width]` batch and its `[rows, width - 1]` next-token tensors for one CP rank.

    Position t of a next-token tensor belongs to input position t (the logits there predict token
    t + 1), so both are padded to the same length and cut with the same indices; the labels are cut
    from the full sequence BEFORE sharding, because a chunk's last label is the next chunk's first
    input. Padding gets `pad_id` (inputs, labels) and `fill[name]` (default 0 / False) for tokens.
    """
    rows, width = input_ids.shape
    padded = -(-width // (2 * cp_size)) * 2 * cp_size
    index = cp_token_indices(padded, cp_size, cp_rank, device=input_ids.device)
    full = torch.full((rows, padded), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    full[:, :width] = input_ids
    labels = torch.full_like(full, pad_id)
    labels[:, : width - 1] = input_ids[:, 1:]
    local: dict[str, Tensor] = {}
    for name, x in tokens.items():
        if x.shape != (rows, width - 1):
            raise ValueError(f"{name}: shape {tuple(x.shape)} != (rows, width - 1) = {(rows, width - 1)}")
        value = (fill or {}).get(name, False if x.dtype == torch.bool else 0.0)
        padded_x = torch.full((rows, padded), value, dtype=x.dtype, device=x.device)
        padded_x[:, : width - 1] = x
        local[name] = padded_x[:, index]
    return CpNextTokenBatch(full[:, index], labels[:, index], index, local, padded)


def gather_cp_tokens(x: Tensor, groups: ParallelGroups, layout: CpLayout = "load_balanced") -> Tensor:
    """The full `[rows, seq]` tensor from every CP rank's `[rows, seq // cp]` share (one all-gather).

    Every rank of the CP group must call it; all get the same result. Identity for cp = 1.
    """
    if groups.cp_size == 1:
        return x
    return unshard_sequence(all_gather_list(x, groups.cp_group), layout=layout, dim=-1)


@dataclass(frozen=True)
class GatheredSequences:
    """Per-sequence partials completed over the CP group.

    reduced: every SUM entry summed, MAX entry maxed and MIN entry minned over the CP ranks, in
        rank order; identical (bitwise) on every rank of the group. `[batch]` float64 vectors.
    per_rank: each SUM entry and each extra row as `[cp, batch]`: the value every CP rank
        contributed (row i = CP rank i). Callers use it for decisions that need to know which rank
        holds what (e.g. which rank owns a sequence's count).
    """

    reduced: Partials
    per_rank: dict[str, Tensor]


def gather_sequence_partials(seq: Partials, groups: ParallelGroups,
                             extra: Mapping[str, Tensor] | None = None) -> GatheredSequences:
    """Complete this rank's per-sequence partials `seq` (`[batch]` vectors) over the CP group.

    extra: more `[batch]` rows to gather alongside (returned per rank only, not reduced).
    Every CP rank must pass the same keys and batch size (they hold pieces of the same sequences).
    ONE all-gather of `(k + len(extra)) * batch` float64 values per rank; none when cp_size == 1.
    The SUM/MAX/MIN are then taken locally over the `[cp, k, batch]` table in rank order.
    """
    extra = dict(extra or {})
    sum_keys, max_keys, min_keys = sorted(seq.sums), sorted(seq.maxs), sorted(seq.mins)
    extra_keys = sorted(extra)
    rows = ([seq.sums[k] for k in sum_keys] + [extra[k].to(torch.float64) for k in extra_keys]
            + [seq.maxs[k] for k in max_keys] + [seq.mins[k] for k in min_keys])
    if not rows:
        return GatheredSequences(Partials(), {})
    table = torch.stack([r.to(torch.float64) for r in rows])  # [k, batch]
    gathered = all_gather_flat(table, group=groups.cp_group, group_size=groups.cp_size)  # [cp, k, batch]
    n_sum, n_extra, n_max = len(sum_keys), len(extra_keys), len(max_keys)
    sums = gathered[:, :n_sum].sum(dim=0)
    offset = n_sum + n_extra
    maxs = gathered[:, offset:offset + n_max].amax(dim=0) if n_max else None
    mins = gathered[:, offset + n_max:].amin(dim=0) if min_keys else None
    reduced = Partials(
        sums={k: sums[i] for i, k in enumerate(sum_keys)},
        maxs={k: maxs[i] for i, k in enumerate(max_keys)} if maxs is not None else {},
        mins={k: mins[i] for i, k in enumerate(min_keys)} if mins is not None else {},
    )
    per_rank = {k: gathered[:, i] for i, k in enumerate(sum_keys)}
    per_rank.update({k: gathered[:, n_sum + i] for i, k in enumerate(extra_keys)})
    return GatheredSequences(reduced, per_rank)


# ---- packed sequences (THD with cu_seqlens) ---------------------------------------------------------


def thd_token_indices(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int,
                      layout: CpLayout = "load_balanced") -> Tensor:
    """Positions (int64) in a packed THD stream of the tokens CP rank `cp_rank` holds, in local order.

    cu_seqlens_padded: `[num_seqs + 1]` cumulative sequence boundaries of the packed stream, each
        sequence padded to a multiple of `2 * cp_size` (load-balanced) or `cp_size` (contiguous),
        as Megatron-Core requires for CP with packed sequences.
    Every sequence is split on its own, as for a `[batch, seq]` tensor: with the load-balanced
    layout rank r holds chunks r and 2*cp-1-r of each sequence (Transformer Engine's THD
    partitioning); the rank's pieces follow each other in sequence order.
    """
    cu = cu_seqlens_padded.to(torch.int64)
    if layout not in CP_LAYOUTS:
        raise ValueError(f"layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D [num_seqs + 1] tensor, got shape {tuple(cu.shape)}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    lengths = cu[1:] - cu[:-1]
    pieces = 2 * cp_size if layout == "load_balanced" else cp_size
    if bool((lengths % pieces != 0).any()) or bool((lengths < 0).any()):
        raise ValueError(f"every packed sequence length must be a non-negative multiple of {pieces} for the "
                         f"{layout} layout with cp={cp_size}; got lengths {lengths.tolist()} (pad each sequence)")
    local = lengths // cp_size
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), local)
    local_starts = torch.cumsum(local, 0) - local
    j = torch.arange(int(local.sum()), device=cu.device) - local_starts[seq_id]
    if layout == "contiguous":
        offset = cp_rank * local[seq_id] + j
    else:
        chunk = (lengths // pieces)[seq_id]
        offset = torch.where(j < chunk, cp_rank * chunk + j, (2 * cp_size - 1 - cp_rank) * chunk + (j - chunk))
    return cu[:-1][seq_id] + offset


@dataclass(frozen=True)
class PackedSequences:
    """Index maps between one rank's packed THD tokens and a padded `[num_seqs, max_len]` view.

    Core works on `[batch, seq]` tensors; a packed stream becomes one row per sequence (its tokens
    left-aligned, padding after them masked out), is corrected there, and the results are mapped
    back. Build it from the rank's LOCAL boundaries: for CP, `cu_seqlens_padded // cp_size`.
    rows, cols: `[num_tokens]` the padded position of each packed token.
    """

    rows: Tensor
    cols: Tensor
    num_seqs: int
    max_len: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor) -> PackedSequences:
        """From `[num_seqs + 1]` cumulative boundaries of this rank's packed tokens."""
        cu = cu_seqlens.to(torch.int64)
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D [num_seqs + 1] tensor, got shape {tuple(cu.shape)}")
        lengths = cu[1:] - cu[:-1]
        if bool((lengths < 0).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
        rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
        cols = torch.arange(rows.numel(), device=cu.device) - (cu[:-1] - cu[0])[rows]
        max_len = int(lengths.max()) if lengths.numel() else 0
        return cls(rows=rows, cols=cols, num_seqs=int(lengths.numel()), max_len=max_len)

    def to_padded(self, packed: Tensor, fill: float | bool = 0) -> Tensor:
        """`[num_tokens]` (or `[1, num_tokens]`) -> `[num_seqs, max_len]`, `fill` in the padding.

        Differentiable: gradients flow back to the packed tokens.
        """
        flat = packed.reshape(-1)
        if flat.numel() != self.rows.numel():
            raise ValueError(f"expected {self.rows.numel()} packed tokens, got {flat.numel()}")
        out = flat.new_full((self.num_seqs, self.max_len), fill)
        return out.index_put((self.rows, self.cols), flat)

    def to_packed(self, padded: Tensor) -> Tensor:
        """`[num_seqs, max_len]` -> `[num_tokens]`: the packed tokens' entries (differentiable)."""
        return padded[self.rows, self.cols]

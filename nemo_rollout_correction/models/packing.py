"""Packed rows: a microbatch's right-padded rows concatenated without their padding (Megatron's THD layout).

A padded microbatch `[rows, width]` computes every row up to the longest one; packed, the rows' real tokens sit
one after the other in a `[1, total]` sequence (`total = sum(lengths)`), each row's positions restart at 0,
and `cu_seqlens` (`[rows + 1]`, int32, the running sum of the lengths) tells the attention and the rotary
embedding where a row ends: Megatron's `PackedSeqParams(qkv_format="thd")`. The attention never crosses a row
boundary (on CPU `models.sdpa_attention.SdpaDotProductAttention` attends within each row; on GPU Transformer
Engine's THD kernels), so each row's logits are those of the padded forward up to float rounding.

Only the positions whose logprobs are read get logits: per row, from its first column in the loss
(`starts`) to its second-to-last token (the last token predicts nothing inside the row). Their logprobs are
scattered back (`unpack`) into the padded `[rows, width - 1]` layout every consumer reads (the loss and its
sequence sums per row, the old/reference passes, turn indices, per-token staleness, the review), zeros
elsewhere: nothing after packing depends on how the rows were laid out.

Shared prefixes (`of(..., share_prefixes=True)`, `policy.prefix_sharing`): the rows of a GRPO microbatch are
several samples of one prompt, so each prompt would be computed once per sample. Rows whose first `p` tokens are
identical (compared by token id, `shared_prefix_groups`) are packed as one group: the `p` shared tokens once, then
each row's own tokens after them (its suffix). Positions are those of the unshared rows (the prefix 0..p-1, every
suffix p, p+1, ...); the attention (`models.sdpa_attention`, `models.prefix_sharing`) lets the prefix attend
causally to itself and each suffix to the whole prefix plus causally to its own tokens, never to another suffix:
every token sees exactly the keys it sees unshared. A logit at column c < p of a row is read at the shared prefix
position c (its hidden state depends only on tokens 0..c, identical in every row of the group), so `logit_index`
may list a prefix position once per row; index_select's backward sums, so the gradients stay exact. The
segments (`cu_seqlens`) are then the groups, and `groups` lists each group's prefix and suffix lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """One microbatch's rows in the packed layout (module docstring). `K` = positions whose logits are computed.

    input_ids / position_ids: `[1, total]`; cu_seqlens: `[rows + 1]` int32; max_seqlen: the longest row;
    logit_index: `[K]` packed positions whose logits are computed; labels: `[1, K]` the next token of each;
    target_rows / target_cols: `[K]` where each logprob lands in the padded `[rows, width - 1]` layout.
    groups: None (every row its own segment of `cu_seqlens`), or with shared prefixes (module docstring) per
    segment `(p, suffix lengths)`: `p` shared tokens, then one suffix per row (a row alone: p = 0, one suffix).
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    logit_index: Tensor
    labels: Tensor
    target_rows: Tensor
    target_cols: Tensor
    rows: int
    width: int
    groups: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    @classmethod
    def of(cls, input_ids: Tensor, lengths: Tensor, starts: Tensor | None = None, *,
           share_prefixes: bool = False) -> PackedRows:
        """Pack right-padded `input_ids` `[rows, width]` whose row r holds `lengths[r]` real tokens; `starts`
        `[rows]`: per row the first column whose logprob is read (default 0). `share_prefixes`: rows that begin
        with the same tokens share one copy of them (module docstring); the plain layout when none do."""
        rows, width = input_ids.shape
        lengths = lengths.to(torch.int64).cpu()
        if rows == 0 or int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise ValueError(f"row lengths must be in [1, {width}] for {rows} rows, got {lengths.tolist()}")
        starts = torch.zeros(rows, dtype=torch.int64) if starts is None else starts.to(torch.int64).cpu()
        if share_prefixes:
            groups = shared_prefix_groups(input_ids, lengths)
            if any(len(members) > 1 for _, members in groups):
                return cls._shared(input_ids, lengths, starts, groups)
        real = torch.arange(width)[None, :] < lengths[:, None]  # [rows, width]
        ids = input_ids[real.to(input_ids.device)][None, :]  # row-major: row 0's tokens, then row 1's ...
        positions = torch.cat([torch.arange(int(n)) for n in lengths])[None, :]
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        # logits at column c of row r predict token c + 1: columns start_r .. length_r - 2
        cols = torch.arange(width - 1)[None, :]
        read = (cols >= starts[:, None]) & (cols < (lengths - 1)[:, None])  # [rows, width - 1]
        target_rows, target_cols = read.nonzero(as_tuple=True)
        logit_index = cu_seqlens[:-1].to(torch.int64)[target_rows] + target_cols
        labels = input_ids[target_rows.to(input_ids.device), (target_cols + 1).to(input_ids.device)][None, :]
        return cls(input_ids=ids, position_ids=positions.to(ids.device), cu_seqlens=cu_seqlens,
                   max_seqlen=int(lengths.max()), logit_index=logit_index, labels=labels,
                   target_rows=target_rows, target_cols=target_cols, rows=rows, width=width)

    @classmethod
    def _shared(cls, input_ids: Tensor, lengths: Tensor, starts: Tensor,
                groups: list[tuple[int, list[int]]]) -> PackedRows:
        """The shared-prefix layout of `groups` (`shared_prefix_groups`): per group its prefix, then its suffixes."""
        rows, width = input_ids.shape
        host = input_ids.cpu()
        pieces: list[Tensor] = []
        positions: list[Tensor] = []
        bounds = [0]
        # per row: where its prefix (the group's) and its suffix start in the pack, and the group's prefix length
        prefix_at = torch.zeros(rows, dtype=torch.int64)
        suffix_at = torch.zeros(rows, dtype=torch.int64)
        shared = torch.zeros(rows, dtype=torch.int64)
        layout: list[tuple[int, tuple[int, ...]]] = []
        offset = 0
        for p, members in groups:
            pieces.append(host[members[0], :p])
            positions.append(torch.arange(p))
            prefix_at[members] = offset
            shared[members] = p
            offset += p
            for row in members:
                n = int(lengths[row])
                pieces.append(host[row, p:n])
                positions.append(torch.arange(p, n))
                suffix_at[row] = offset
                offset += n - p
            bounds.append(offset)
            layout.append((p, tuple(int(lengths[row]) - p for row in members)))
        ids = torch.cat(pieces)[None, :].to(input_ids.device)
        cols = torch.arange(width - 1)[None, :]
        read = (cols >= starts[:, None]) & (cols < (lengths - 1)[:, None])  # [rows, width - 1]
        target_rows, target_cols = read.nonzero(as_tuple=True)
        # column c of row r: its hidden state is the shared prefix's position c if c < p, else in r's suffix
        in_prefix = target_cols < shared[target_rows]
        logit_index = torch.where(in_prefix, prefix_at[target_rows] + target_cols,
                                  suffix_at[target_rows] + target_cols - shared[target_rows])
        labels = input_ids[target_rows.to(input_ids.device), (target_cols + 1).to(input_ids.device)][None, :]
        return cls(input_ids=ids, position_ids=torch.cat(positions)[None, :].to(ids.device),
                   cu_seqlens=torch.tensor(bounds, dtype=torch.int32), max_seqlen=int(lengths.max()),
                   logit_index=logit_index, labels=labels, target_rows=target_rows, target_cols=target_cols,
                   rows=rows, width=width, groups=tuple(layout))

    @property
    def shares_prefixes(self) -> bool:
        """Whether some rows share their prefix (`groups`), so the forward needs `models.prefix_sharing`."""
        return self.groups is not None

    @property
    def total(self) -> int:
        """Tokens in the pack (`sum(lengths)`)."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedRows:
        """The same pack with its tensors on `device`."""
        fields = {name: getattr(self, name) for name in ("input_ids", "position_ids", "cu_seqlens", "logit_index",
                                                         "labels", "target_rows", "target_cols")}
        if all(t.device == torch.device(device) for t in fields.values()):
            return self
        moved = {name: t.to(device) for name, t in fields.items()}
        return PackedRows(**moved, max_seqlen=self.max_seqlen, rows=self.rows, width=self.width, groups=self.groups)

    def packed_seq_params(self) -> Any:
        """Megatron's `PackedSeqParams` for the pack: THD, the same boundaries for queries and keys. With shared
        prefixes `models.prefix_sharing.SharedPrefixParams`, which also carries the groups and the positions."""
        if self.groups is not None:
            from nemo_rollout_correction.models.prefix_sharing import SharedPrefixParams

            return SharedPrefixParams.of(self.cu_seqlens, self.max_seqlen, self.position_ids[0], self.groups)
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def unpack(self, values: Tensor) -> Tensor:
        """`[1, K]` (or `[K]`) values of the computed positions -> `[rows, width - 1]`, zeros at the other
        positions (the prompt before a row's first loss column, the padding); differentiable."""
        flat = values.reshape(-1)
        out = flat.new_zeros(self.rows, self.width - 1)
        return out.index_put((self.target_rows.to(flat.device), self.target_cols.to(flat.device)), flat)


def shared_prefix_groups(input_ids: Tensor, lengths: Tensor) -> list[tuple[int, list[int]]]:
    """The rows of `input_ids` `[rows, width]` (row r: its first `lengths[r]` tokens) grouped by a shared prefix:
    `(p, rows)` per group, ordered by first row, rows ascending; every row of a group begins with the same `p`
    tokens and keeps at least one token of its own; a row alone has p = 0.

    Compares token ids (nothing trusts the rows' order): sorted lexicographically, the longest common prefix of a
    run of rows is the smallest one of neighbours in the run, and a dynamic programme over the sorted rows picks the
    runs that save the most tokens, `(rows - 1) x p` per group (one level: a group is not split further)."""
    rows = int(input_ids.shape[0])
    sizes = [int(n) for n in lengths.tolist()]
    seqs = [input_ids[r, : sizes[r]].tolist() for r in range(rows)]
    order = sorted(range(rows), key=lambda r: (seqs[r], r))
    neighbours = [_common_prefix(seqs[a], seqs[b]) for a, b in pairwise(order)]
    best = [0] * (rows + 1)  # best[j]: the most tokens saved by grouping the sorted rows order[:j]
    first = list(range(-1, rows))  # first[j]: where the last group of that grouping starts (j - 1: alone)
    shared = [0] * (rows + 1)
    for j in range(1, rows + 1):
        best[j], first[j], shared[j] = best[j - 1], j - 1, 0
        common, own = 1 << 62, sizes[order[j - 1]] - 1
        for i in range(j - 2, -1, -1):  # the run order[i:j]
            common, own = min(common, neighbours[i]), min(own, sizes[order[i]] - 1)
            p = min(common, own)
            if p < 1:
                break  # only shrinks as the run grows
            if best[i] + (j - i - 1) * p > best[j]:
                best[j], first[j], shared[j] = best[i] + (j - i - 1) * p, i, p
    groups: list[tuple[int, list[int]]] = []
    j = rows
    while j > 0:
        groups.append((shared[j], sorted(order[first[j]:j])))
        j = first[j]
    return sorted(groups, key=lambda group: group[1][0])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def row_lengths(cu_seqlens: Tensor) -> list[int]:
    """The rows' lengths from `cu_seqlens` `[rows + 1]`."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


__all__ = ["PackedRows", "row_lengths", "shared_prefix_groups"]

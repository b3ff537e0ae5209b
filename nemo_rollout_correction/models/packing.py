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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """One microbatch's rows in the packed layout (module docstring). `K` = positions whose logits are computed.

    input_ids / position_ids: `[1, total]`; cu_seqlens: `[rows + 1]` int32; max_seqlen: the longest row;
    logit_index: `[K]` packed positions whose logits are computed; labels: `[1, K]` the next token of each;
    target_rows / target_cols: `[K]` where each logprob lands in the padded `[rows, width - 1]` layout.
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

    @classmethod
    def of(cls, input_ids: Tensor, lengths: Tensor, starts: Tensor | None = None) -> PackedRows:
        """Pack right-padded `input_ids` `[rows, width]` whose row r holds `lengths[r]` real tokens; `starts`
        `[rows]`: per row the first column whose logprob is read (default 0)."""
        rows, width = input_ids.shape
        lengths = lengths.to(torch.int64).cpu()
        if rows == 0 or int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise ValueError(f"row lengths must be in [1, {width}] for {rows} rows, got {lengths.tolist()}")
        starts = torch.zeros(rows, dtype=torch.int64) if starts is None else starts.to(torch.int64).cpu()
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
        return PackedRows(**moved, max_seqlen=self.max_seqlen, rows=self.rows, width=self.width)

    def packed_seq_params(self) -> Any:
        """Megatron's `PackedSeqParams` for the pack: THD, the same boundaries for queries and keys."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def unpack(self, values: Tensor) -> Tensor:
        """`[1, K]` (or `[K]`) values of the computed positions -> `[rows, width - 1]`, zeros at the other
        positions (the prompt before a row's first loss column, the padding); differentiable."""
        flat = values.reshape(-1)
        out = flat.new_zeros(self.rows, self.width - 1)
        return out.index_put((self.target_rows.to(flat.device), self.target_cols.to(flat.device)), flat)


def row_lengths(cu_seqlens: Tensor) -> list[int]:
    """The rows' lengths from `cu_seqlens` `[rows + 1]`."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


__all__ = ["PackedRows", "row_lengths"]

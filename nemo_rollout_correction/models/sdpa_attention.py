"""Core attention of the CPU layer spec on torch's fused `scaled_dot_product_attention`.

Megatron-Core 0.16's local (non-Transformer-Engine) layer spec has one core attention, the unfused
`DotProductAttention`: it repeats the key/value heads for grouped-query attention, materialises the
`[batch, heads, seq, seq]` scores, fills the masked ones with -10000, takes the softmax and multiplies by the
values, each a separate element-wise pass over the scores (and again in the backward). Megatron's fused
alternatives are Transformer Engine's and Flash Attention's modules, both CUDA-only. torch's
`scaled_dot_product_attention` has a fused CPU kernel (flash attention over blocks, grouped-query attention
without repeating the keys and values, a causal mode that skips the masked blocks): on the default run's
shapes it takes about half the time of the unfused module for forward plus backward
(`benchmarks/bench_update_phases.py --attention`).

`SdpaDotProductAttention` subclasses `DotProductAttention`, keeps its constructor (and so its checks, softmax
scale and head counts) and replaces only the attention math. Same result up to fp32 rounding: the masked
scores get probability exactly 0 in both (exp(-10000 - max) underflows to 0 in fp32; the fused kernel skips
them), and no row is fully masked under a causal mask. Where the fused kernel cannot reproduce the module
(attention dropout during training, a sliding window, a softmax offset, query-key layer scaling, an attention
bias) it calls the parent's forward. `fused = False` on an instance does the same (the benchmark's and the
tests' A/B switch). Packed rows (Megatron's THD layout, `models.packing`), which the parent refuses, get causal
attention within each row (`_packed`); rows packed with a shared prefix (`models.prefix_sharing`) get the prefix's
causal attention once and each suffix's attention over the prefix and its own tokens (`_shared_prefix`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _dot_product_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base: type = DotProductAttention
    return base


class SdpaDotProductAttention(_dot_product_attention()):  # type: ignore[misc]
    """Drop-in `core_attention` of the local GPT layer spec on `torch.nn.functional.scaled_dot_product_attention`.

    Same constructor and forward signature as `megatron.core.transformer.dot_product_attention.DotProductAttention`.
    """

    fused: bool = True
    """False: always the parent's unfused forward (for side-by-side comparisons)."""

    def _fusable(self, attention_bias: Tensor | None, packed_seq_params: Any) -> bool:
        config = self.config
        return (attention_bias is None and packed_seq_params is None
                and self.softmax_offset is None and not config.apply_query_key_layer_scaling
                and self.scale_mask_softmax.window_size is None
                and not (self.training and self.attention_dropout.p > 0))

    def _is_causal(self, mask: Tensor, sq: int, sk: int) -> bool:
        """Whether `mask` (`[.., sq, sk]`, True = masked) is exactly the causal mask (key after query)."""
        if sq != sk or mask.shape[-2:] != (sq, sk) or mask.numel() != sq * sk:
            return False
        causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
        return bool(torch.equal(mask.reshape(sq, sk), causal))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        """query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]`, mask `[1|b, 1, sq, sk]` (True = masked) or None
        -> context `[sq, b, np * hn]`. Packed rows (`packed_seq_params` THD): query `[t, np, hn]`, key/value
        `[t, ng, hn]` -> `[t, np * hn]`, causal within each row (`_packed`)."""
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd":
            return self._packed(query, key, value, attention_bias, packed_seq_params)
        if not (self.fused and self._fusable(attention_bias, packed_seq_params)):
            out: Tensor = super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                          attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            return out
        from megatron.core.transformer.enums import AttnMaskType

        sq, sk = query.shape[0], key.shape[0]
        mask_kwargs: dict[str, Any]
        if attention_mask is None:
            # Megatron's softmax builds the causal mask itself for a causal layer without a mask
            mask_kwargs = {"is_causal": self.attn_mask_type == AttnMaskType.causal}
        elif self._is_causal(attention_mask, sq, sk):
            mask_kwargs = {"is_causal": True}  # the kernel then skips the blocks above the diagonal
        else:
            mask_kwargs = {"attn_mask": ~attention_mask}  # scaled_dot_product_attention: True = attend
        # [s, b, heads, hn] -> [b, heads, s, hn]; grouped-query heads stay ng (enable_gqa: no repeat)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1], **mask_kwargs)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, query.shape[1], self.hidden_size_per_partition)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, attention_bias: Tensor | None,
                packed_seq_params: Any) -> Tensor:
        """Causal attention within each packed row (`models.packing`): one fused call per row, so no query ever
        sees another row's keys and each row computes exactly what its padded forward computes (the padded
        batch's causal mask hides a row's padding from its real tokens). Megatron's own `DotProductAttention`
        refuses packed rows; the settings the fused kernel cannot reproduce are refused here too."""
        if not self._fusable(attention_bias, None):
            raise ValueError("packed sequences (policy.sequence_packing) on the local layer spec need plain causal "
                             "attention: no attention dropout while training, sliding window, softmax offset, "
                             "query-key layer scaling or attention bias; set policy.sequence_packing=false")
        cu_q, cu_k = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if not torch.equal(cu_q, cu_k):
            raise ValueError("packed attention needs the same row boundaries for queries and keys")
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        gqa = key.shape[1] != query.shape[1]
        if getattr(packed_seq_params, "groups", None):
            return self._shared_prefix(query, key, value, lengths, packed_seq_params, gqa)
        contexts = []
        # [t, heads, hn] -> per row [1, heads, len, hn]
        rows = zip(torch.split(query, lengths), torch.split(key, lengths), torch.split(value, lengths), strict=True)
        for q, k, v in rows:
            q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=self.softmax_scale, is_causal=True,
                                                 enable_gqa=gqa)
            contexts.append(out.squeeze(0).permute(1, 0, 2))  # [len, np, hn]
        return torch.cat(contexts).reshape(query.shape[0], self.hidden_size_per_partition)

    def _shared_prefix(self, query: Tensor, key: Tensor, value: Tensor, lengths: list[int], params: Any,
                       gqa: bool) -> Tensor:
        """Attention of a shared-prefix pack (`models.prefix_sharing.SharedPrefixParams`): per segment (a group
        `[prefix (p), suffix_1, suffix_2, ...]`) the prefix causal over itself, then each suffix over the keys
        `[prefix; its own tokens]` with `suffix_masks` (the whole prefix, causal over its own): the keys and their
        order are those its unshared row attends to, so each suffix computes what the plain pack computes. A
        segment of one row (p = 0) is one causal call, as in `_packed`. query `[t, np, hn]` -> `[t, np * hn]`."""
        if len(lengths) != len(params.groups):
            raise ValueError(f"shared-prefix pack: {len(lengths)} segments for {len(params.groups)} groups")

        def heads_first(t: Tensor) -> Tensor:  # [len, heads, hn] -> [1, heads, len, hn]
            return t.permute(1, 0, 2).unsqueeze(0)

        def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
            out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), dropout_p=0.0,
                                                 scale=self.softmax_scale, enable_gqa=gqa,
                                                 **({"is_causal": True} if mask is None else {"attn_mask": mask}))
            return out.squeeze(0).permute(1, 0, 2)  # [len, np, hn]

        contexts = []
        start = 0
        for length, (p, suffixes), masks in zip(lengths, params.groups, params.suffix_masks, strict=True):
            if p + sum(suffixes) != length:
                raise ValueError(f"shared-prefix pack: a segment of {length} tokens, its group holds {p} + {suffixes}")
            if p:
                contexts.append(attend(query[start:start + p], key[start:start + p], value[start:start + p], None))
            k_prefix, v_prefix = key[start:start + p], value[start:start + p]
            at = start + p
            for n, mask in zip(suffixes, masks, strict=True):
                q = query[at:at + n]
                if p:
                    k, v = torch.cat([k_prefix, key[at:at + n]]), torch.cat([v_prefix, value[at:at + n]])
                    contexts.append(attend(q, k, v, mask.to(q.device)))
                else:
                    contexts.append(attend(q, key[at:at + n], value[at:at + n], None))
                at += n
            start += length
        return torch.cat(contexts).reshape(query.shape[0], self.hidden_size_per_partition)


__all__ = ["SdpaDotProductAttention"]

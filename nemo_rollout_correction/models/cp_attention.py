"""Context-parallel core attention for Megatron-Core's local (non-Transformer-Engine) layer spec.

Megatron-Core runs context parallelism (CP) only inside Transformer Engine's attention, which does
not exist on CPU. This module is the CPU path: each CP rank holds the query, key and value rows of
its tokens (Megatron's load-balanced layout: chunks `r` and `2 * cp - 1 - r` of `2 * cp`), all-gathers
the keys and values of the whole sequence over the CP group (TE's `cp_comm_type="all_gather"` does the
same on GPU), and attends its local queries to them under the causal mask of the global token
positions. The backward sums each key/value gradient back to the rank that owns the token.

Exact (same math as attention over the unsplit sequence), not memory-efficient: every rank holds the
full keys and values. It exists so CP layouts run, and are tested, on CPU; GPU jobs use TE.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from nemo_rollout_correction.distributed.context_parallel import cp_token_indices
from nemo_rollout_correction.distributed.tensor_gather import all_gather_with_grad, group_rank, group_size


class AllGatherContextParallelAttention(nn.Module):
    """Drop-in `core_attention` of the local GPT layer spec for `context_parallel_size > 1`.

    Same constructor and forward signature as `megatron.core.transformer.dot_product_attention.
    DotProductAttention`; the attention math itself is `models.sdpa_attention.SdpaDotProductAttention` (that
    module with a CP size of 1, on torch's fused kernel) over the gathered keys and values.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        from megatron.core import parallel_state as ps

        from nemo_rollout_correction.models.sdpa_attention import SdpaDotProductAttention

        super().__init__()
        self.config = config
        self.cp_group = ps.get_context_parallel_group()
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1  # DotProductAttention refuses CP; we feed it gathered K/V
        self.inner = SdpaDotProductAttention(local_config, layer_number, attn_mask_type, attention_type,
                                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                                         pg_collection=pg_collection)

    def _mask(self, local_len: int, device: torch.device) -> Tensor:
        """`[1, 1, local, total]` True where a local query must not see a key (key after query)."""
        cp, rank = group_size(self.cp_group), group_rank(self.cp_group)
        total = local_len * cp
        query_pos = cp_token_indices(total, cp, rank).to(device)
        key_pos = torch.cat([cp_token_indices(total, cp, r) for r in range(cp)]).to(device)
        return (key_pos[None, :] > query_pos[:, None])[None, None]

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        """query `[s_local, b, np, hn]`, key/value `[s_local, b, ng, hn]` -> context `[s_local, b, np * hn]`."""
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences with CPU context parallelism: use Transformer Engine")
        # Gathered in CP rank order: rank 0's tokens, then rank 1's, ... (the mask uses their positions).
        key = all_gather_with_grad(key, 0, self.cp_group)
        value = all_gather_with_grad(value, 0, self.cp_group)
        mask = self._mask(query.shape[0], query.device)
        out: Tensor = self.inner(query, key, value, mask, attn_mask_type=attn_mask_type,
                                 attention_bias=attention_bias)
        return out


__all__ = ["AllGatherContextParallelAttention"]

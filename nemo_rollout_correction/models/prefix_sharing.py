"""The forward of packed rows that share their prefix (`models.packing`, `policy.prefix_sharing`).

A shared-prefix pack lays a group of rows out as `[prefix, suffix_1, suffix_2, ...]`; two things of the forward
must then differ from the plain packed one, and both travel in the forward's own `packed_seq_params`
(`SharedPrefixParams`, a subclass of Megatron's `PackedSeqParams`), never in module or global state:

- the attention: the prefix attends causally to itself, suffix i to the whole prefix and causally to its own
  tokens, never to another suffix. `models.sdpa_attention.SdpaDotProductAttention` (the local layer spec's core
  attention) reads `groups` and `suffix_masks`; Transformer Engine's THD kernels cannot express it (no tree mask),
  so `install` reports False on any other core attention and the trainer keeps sharing off there.
- the rotary positions: suffix i continues at position p, where Megatron's THD rotary restarts at 0 in every
  `cu_seqlens` segment (`_apply_rotary_pos_emb_thd`, megatron-core 0.16 and 0.19 alike: `freqs[:len]` per
  segment). Both versions have a second mode in that function: when the frequencies cover every token of the pack
  (`freqs.size(0) == cu_seqlens[-1]`), token t gets `freqs[t]`. `install` wraps the decoder (`TransformerBlock`)
  instance's forward: with `SharedPrefixParams` it replaces the model's rotary table `[max_seqlen, 1, 1, dim]`
  (positions 0..max_seqlen-1, what `GPTModel` computes for THD) by its rows at each token's position
  `[total, 1, 1, dim]`, so every token is rotated exactly as in its unshared row (the same table entries, no new
  rotary math). Why there: `GPTModel` computes the table from `max_seqlen` alone and hands it, with
  `packed_seq_params`, to the decoder, the first call that sees both; wrapping one instance's forward (as
  `models.logit_positions` does for the output layer) patches no Megatron global and leaves every other forward
  (plain packs, padded rows) untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor, nn

_ATTR = "nrc_prefix_sharing"


@dataclass
class SharedPrefixParams(PackedSeqParams):  # type: ignore[misc]
    """`PackedSeqParams` (THD, segments = the groups) of a shared-prefix pack, plus what its forward needs.

    position_ids: `[total]` each token's position in its unshared row; groups: per segment `(p, suffix lengths)`
    (`models.packing.PackedRows.groups`); suffix_masks: per segment one `[len_i, p + len_i]` bool mask per suffix
    (True = attend: the whole prefix, then causal over the suffix's own tokens).
    """

    position_ids: Tensor | None = None
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    suffix_masks: tuple[tuple[Tensor, ...], ...] = ()

    @classmethod
    def of(cls, cu_seqlens: Tensor, max_seqlen: int, position_ids: Tensor,
           groups: tuple[tuple[int, tuple[int, ...]], ...]) -> SharedPrefixParams:
        """The params of a pack with segment boundaries `cu_seqlens` `[groups + 1]` and its longest row `max_seqlen`
        (the rotary table covers positions 0..max_seqlen-1); masks built once here, shared by every layer."""
        device = position_ids.device
        masks: dict[tuple[int, int], Tensor] = {}
        for p, suffixes in groups:
            for n in suffixes:
                if (p, n) not in masks:
                    masks[p, n] = torch.ones(n, p + n, dtype=torch.bool, device=device).tril_(p)
        return cls(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
                   max_seqlen_kv=max_seqlen, position_ids=position_ids, groups=groups,
                   suffix_masks=tuple(tuple(masks[p, n] for n in suffixes) for p, suffixes in groups))


def _gpt(model: nn.Module) -> Any:
    """The GPTModel stage inside a DDP- or Float16Module-wrapped model (the model itself when unwrapped)."""
    inner: Any = model
    while not hasattr(inner, "decoder") and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    return inner


def _decoder(model: nn.Module) -> nn.Module | None:
    """The `TransformerBlock` of a (DDP- or Float16Module-wrapped) GPTModel stage, or None."""
    decoder = getattr(_gpt(model), "decoder", None)
    return decoder if isinstance(decoder, nn.Module) else None


def unsupported_by(model: nn.Module) -> str | None:
    """Why this model cannot run shared-prefix packs, or None: it needs the local spec's
    `SdpaDotProductAttention` in every layer, plain rope (or learned absolute positions) without the fused rope
    kernels, and no context parallelism."""
    from nemo_rollout_correction.models.sdpa_attention import SdpaDotProductAttention

    gpt = _gpt(model)
    config: Any = getattr(gpt, "config", None)
    if _decoder(model) is None or config is None:
        return "not a Megatron GPTModel"
    attentions = [m for m in gpt.modules() if m.__class__.__name__.endswith("DotProductAttention")]
    if not attentions or not all(isinstance(m, SdpaDotProductAttention) for m in attentions):
        names = sorted({type(m).__name__ for m in attentions})
        return f"the core attention is {', '.join(names) or 'unknown'} (the tree mask needs SdpaDotProductAttention)"
    embedding = getattr(gpt, "position_embedding_type", None)
    if embedding not in ("rope", "learned_absolute", "none"):
        return f"position_embedding_type={embedding!r} (rope or learned_absolute only)"
    if getattr(config, "apply_rope_fusion", False) or getattr(config, "multi_latent_attention", False):
        return "fused rope or multi-latent attention"
    if int(getattr(config, "context_parallel_size", 1)) > 1:
        return "context parallelism"
    return None


def install(model: nn.Module) -> bool:
    """Make the model's decoder rotate shared-prefix packs at their tokens' positions (module docstring);
    idempotent. Returns whether the model can run them (`unsupported_by` is None); nothing is wrapped otherwise."""
    if unsupported_by(model) is not None:
        return False
    decoder = _decoder(model)
    assert decoder is not None
    if hasattr(decoder, _ATTR):
        return True
    original = decoder.forward
    setattr(decoder, _ATTR, True)

    def forward(*args: Any, **kwargs: Any) -> Any:
        params = kwargs.get("packed_seq_params")
        if isinstance(params, SharedPrefixParams):
            if "rotary_pos_emb" not in kwargs:
                raise RuntimeError("prefix sharing: the decoder was called without rotary_pos_emb as a keyword")
            kwargs["rotary_pos_emb"] = at_positions(kwargs["rotary_pos_emb"], params.position_ids)
        return original(*args, **kwargs)

    decoder.forward = forward
    return True


def installed(model: nn.Module) -> bool:
    """Whether `install` wrapped this model's decoder."""
    decoder = _decoder(model)
    return decoder is not None and hasattr(decoder, _ATTR)


def at_positions(emb: Any, position_ids: Tensor | None) -> Any:
    """A rotary table `[max_seqlen, 1, 1, dim]` (or a tuple of them, query and key) -> its rows at `position_ids`
    `[total]`: `[total, 1, 1, dim]`, which Megatron's THD rotary applies token by token. None stays None."""
    if emb is None or position_ids is None:
        return emb
    if isinstance(emb, tuple):
        return tuple(at_positions(e, position_ids) for e in emb)
    return emb.index_select(0, position_ids.to(device=emb.device, dtype=torch.long))


__all__ = ["SharedPrefixParams", "at_positions", "install", "installed", "unsupported_by"]

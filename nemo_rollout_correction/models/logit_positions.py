"""The output layer applied only from a given sequence position on (the positions whose logprobs are read).

A GRPO update reads the logprobs of the response tokens only: the logits of the prompt positions go through
the vocabulary projection (the largest single matrix product of a small model: 49,152 x 576 for SmolLM2-135M)
and the vocabulary-wide log-softmax, forward and backward, and are then thrown away. Megatron-Core 0.16's
`GPTModel` has no switch for it outside inference (`materialize_only_last_token_logits` keeps one position), so
`install` wraps the output layer's forward: while `from_position(model, start)` is active, the layer receives
the final hidden states `[seq, batch, hidden]` from position `start` on and the model returns logits
`[batch, seq - start, vocab / tp]`. The rows it computes are those of the full projection up to float rounding
(a matrix product over fewer rows may block its sums differently).

Not under sequence parallelism (the hidden states are sequence-sharded there: `install` returns False and the
callers keep `start = 0`); context parallelism scatters positions, so its callers pass 0 too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

_ATTR = "nrc_output_start"


def output_layer(model: nn.Module) -> nn.Module | None:
    """The `output_layer` of a (DDP- or Float16Module-wrapped) GPTModel stage, or None (not the last stage)."""
    inner: Any = model
    while not hasattr(inner, "output_layer") and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    layer = getattr(inner, "output_layer", None)
    return layer if isinstance(layer, nn.Module) else None


def install(model: nn.Module) -> bool:
    """Make the model's output layer honour `from_position` (idempotent). Returns whether positions can be cut:
    False under sequence parallelism (nothing is wrapped then); True on a stage without the output layer."""
    config: Any = getattr(model, "config", None)
    if config is not None and getattr(config, "sequence_parallel", False):
        return False
    layer = output_layer(model)
    if layer is None or hasattr(layer, _ATTR):
        return True
    original = layer.forward
    setattr(layer, _ATTR, 0)

    def forward(input_: Tensor, *args: Any, **kwargs: Any) -> Any:
        start = getattr(layer, _ATTR)
        if isinstance(start, Tensor):  # packed rows: the listed positions (`models.packing`)
            return original(input_.index_select(0, start.to(input_.device)), *args, **kwargs)
        return original(input_[start:] if start else input_, *args, **kwargs)

    layer.forward = forward
    return True


def can_cut(model: nn.Module) -> bool:
    """Whether `from_position` works on `model`: `install` wrapped its output layer, or it has none."""
    layer = output_layer(model)
    return layer is None or hasattr(layer, _ATTR)


@contextlib.contextmanager
def from_position(model: nn.Module, start: int | Tensor) -> Iterator[None]:
    """Within the block, forwards of `model` compute logits for sequence positions `start..` only (`install`
    first; 0 = all positions); a `[K]` index tensor (packed rows, `models.packing`): for those positions of the
    `[total]` sequence only, logits `[1, K, vocab / tp]`. A no-op on a pipeline stage without the output layer."""
    cuts = isinstance(start, Tensor) or bool(start)
    layer = output_layer(model) if cuts else None
    if layer is None:
        yield
        return
    if not hasattr(layer, _ATTR):
        raise RuntimeError("models.logit_positions.install(model) was not called: the output layer cannot cut")
    setattr(layer, _ATTR, start)
    try:
        yield
    finally:
        setattr(layer, _ATTR, 0)


__all__ = ["can_cut", "from_position", "install", "output_layer"]

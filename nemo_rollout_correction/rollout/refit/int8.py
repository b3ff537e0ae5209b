"""The int8 refit (`rollout.quantization=int8`): the trainer's weights re-quantized at every sync, loaded in place.

The trainer quantizes its full weights per output channel (`rollout/int8.py`, `quantize_state`: int8 codes and a
float32 scale per row of every decoder linear layer; embeddings, norms and the output layer in the engine's dtype)
into the shared buffer of `SharedBufferRefit` (scales as their int32 bit patterns: exact). Every worker then loads
its tensor-parallel shard through its layers' own loaders and rebuilds each int8 layer's kernel state
(`RefitExtension.nrc_load_int8_from_shared`, `rollout/int8_load.py`), never through vLLM's `reload_weights`,
which leaves a W8A8 engine producing NaN logprobs (docs/rollout.md, "The NaN trap").

Verified: the embeddings and norms as on the bf16 path (`refit/verify.py`), and every int8 layer against the
buffer (`nrc_check_int8`: its live scale exactly, its kernel on a probe within tolerance): a sync leaving stale,
NaN or wrongly scaled int8 weights raises `RefitVerificationError` naming the layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RefitVerificationError, RolloutEngineError
from nemo_rollout_correction.rollout.int8 import SCALE_SUFFIX, quantize_state
from nemo_rollout_correction.rollout.refit.base import RefitTarget
from nemo_rollout_correction.rollout.refit.shared_buffer import SharedBufferRefit


class Int8Refit(SharedBufferRefit):
    """`SharedBufferRefit` with the trainer's weights quantized to int8 W8A8 and loaded by the int8 loader
    (module docstring); `phases["write"]` includes the quantization."""

    def buffer_tensors(self, named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
        state = quantize_state(named_tensors)
        # float32 scales as int32 bits: the buffer stores floating tensors in the engine's dtype
        return {name: tensor.view(torch.int32) if name.endswith(SCALE_SUFFIX) else tensor
                for name, tensor in state.items()}

    def load_call(self, engine: RefitTarget) -> tuple[str, tuple[object, ...]]:
        assert self._buffer is not None
        return "nrc_load_int8_from_shared", (self._key, self._buffer.nbytes, self._wire)

    def verify(self, engine: RefitTarget) -> None:
        super().verify(engine)  # embeddings and norms, bit for bit
        try:
            answers = engine.llm.collective_rpc("nrc_check_int8", args=(self._key, self._buffer.nbytes
                                                                        if self._buffer else 0, self._wire))
        except Exception as exc:
            raise RolloutEngineError(f"int8 refit verification of {engine.name} failed: {type(exc).__name__}: "
                                     f"{exc}") from exc
        for worker, answer in enumerate(answers):
            if not answer.get("checked"):
                raise RefitVerificationError(f"refit verification on {engine.name} (worker {worker}): no int8 layer "
                                             "was checked (rollout.quantization=int8 on an engine without any)")
            for layer, why in answer["bad"]:
                raise RefitVerificationError(
                    f"refit verification failed on {engine.name} (worker {worker}): int8 layer {layer!r}: {why}. "
                    "Set rollout.verify_refit=false only to debug; the rollouts would come from other weights "
                    "than the trainer's.")


__all__ = ["Int8Refit"]

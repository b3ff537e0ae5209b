"""The CPU refit: the weights in a buffer shared with every vLLM worker, loaded by the workers themselves.

The trainer casts the tensors into the engine's dtype and copies them into one memory-mapped file on the node's
shared memory (`rollout/shared_weights.py`: /dev/shm unless `staging_dir` says otherwise; created again only when
the set of tensors changes, unlinked as soon as every worker has mapped it). One RPC then has every worker load
the buffer (`RefitExtension.nrc_reload_from_shared`) with one of two loaders:

- **direct** (`rollout/direct_load.py`): the slots copied straight into the model's parameters, where the
  model's layers allow it;
- **reload**: the slots' views fed to vLLM's layer-wise `reload_weights`, where direct does not apply or
  `rollout.direct_refit=false` (read at every push, for comparisons).

Nothing is serialised. Verifiable: the workers' copies are compared with the buffer (`refit/verify.py`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.refit.base import RefitPath, RefitTarget
from nemo_rollout_correction.rollout.refit.verify import verify_engine_weights, verify_requests
from nemo_rollout_correction.rollout.shared_weights import SharedWeightsBuffer, plan_slots


class SharedBufferRefit(RefitPath):
    """The refit through a buffer shared with the workers (module docstring); `report` holds each worker's
    account (its own seconds, the loader taken: "direct" or "reload", and why not direct), `phases` the seconds
    by side ("write": the trainer's cast and copy into the buffer; "load": the engine's RPC, the workers' load
    and the prefix-cache reset; "worker": the slowest worker's own seconds)."""

    staging_device = "cpu"
    verifiable = True

    def __init__(self) -> None:
        super().__init__()
        self._buffer: SharedWeightsBuffer | None = None
        self._key = ""  # the buffer file's path: how the workers recognise a buffer they have mapped
        self._wire: list[list[object]] = []  # its slot layout, as vLLM's RPC carries it
        self._verified_sums: dict[str, int] = {}  # the last verified fingerprints (tells a lost sync apart)

    def push(self, engine: RefitTarget, named_tensors: Iterable[tuple[str, Tensor]], *,
             staging_dir: str | None = None) -> float:
        start = time.perf_counter()
        state = self.buffer_tensors(named_tensors)
        if not state:
            raise ValueError("refit() got no tensors")
        dtype = getattr(torch, engine.options.dtype)
        fresh = self._buffer is None or not self._buffer.matches(state, dtype)
        try:
            if fresh:
                slots, nbytes = plan_slots(state, dtype)
                base = staging_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
                self.release()
                self._buffer = SharedWeightsBuffer(slots, nbytes, base)
                self._key = str(self._buffer.path)
                self._wire = [slot.to_wire() for slot in slots]
            assert self._buffer is not None
            self._buffer.write(state)
            written = time.perf_counter()
            engine.weight_version += 1  # before the load: even a failed, partial load salts the cache anew
            method, args = self.load_call(engine)
            self.report = engine.watched("weight refit", lambda: engine.llm.collective_rpc(method, args=args))
            self._buffer.unlink()  # every worker has mapped it now: no name left behind if a process dies
            engine.llm.reset_prefix_cache()
            self.phases = {
                "write": written - start,  # the trainer's side: cast and copy into the shared buffer
                "load": time.perf_counter() - written,  # the engine's side: the RPC, the workers' load, the reset
                # inside the workers; no reply at all (a lost sync) is left to the verification to name
                "worker": max((float(r.get("seconds", 0.0)) for r in self.report), default=0.0),
            }
        except RolloutEngineError:
            raise
        except Exception as exc:
            self.release()  # a worker may not have mapped it: the next refit starts a fresh buffer
            raise RolloutEngineError(f"vLLM {engine.name}: weight refit failed: {type(exc).__name__}: {exc}") \
                from exc
        return time.perf_counter() - start

    def buffer_tensors(self, named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """The tensors the buffer holds for `named_tensors` (here: them; a quantized path quantizes)."""
        return dict(named_tensors)

    def load_call(self, engine: RefitTarget) -> tuple[str, tuple[object, ...]]:
        """The worker extension's method that loads the buffer, and its arguments."""
        assert self._buffer is not None
        return "nrc_reload_from_shared", (self._key, self._buffer.nbytes, self._wire, engine.options.direct_refit)

    def verify(self, engine: RefitTarget) -> None:
        if self._buffer is None:
            raise RolloutEngineError(f"verify_refit on {engine.name} before any refit")
        requests = verify_requests({slot.name: slot.shape for slot in self._buffer.slots})
        self._verified_sums = verify_engine_weights(engine, requests, self._buffer.view, self._verified_sums)

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.unlink()
        self._buffer = None
        self._verified_sums = {}


__all__ = ["SharedBufferRefit"]

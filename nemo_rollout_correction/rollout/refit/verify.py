"""Refit verification: read some weights back from the engine's workers and compare them with what was pushed.

The tensors kept under their Hugging Face names on the workers (`verify_requests`: the output layer's and the
embedding's rows at a fixed stride, the final norm, the first and last layer's norms; the linear layers' weights
live in packed kernel form on CPU and are not readable) are fingerprinted on the workers
(`RefitExtension.nrc_weight_checksums`) and compared with the same fingerprint (`shared_weights.checksum`: an exact
integer sum of the raw bits, whatever the reduction order) of what the path pushed (`verify_engine_weights`).
A path that can verify calls both from its `RefitPath.verify`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RefitVerificationError, RolloutEngineError
from nemo_rollout_correction.rollout.refit.base import RefitTarget
from nemo_rollout_correction.rollout.shared_weights import checksum


def verify_requests(shapes: Mapping[str, Sequence[int]]) -> list[list[Any]]:
    """[name, rows or None] of the tensors to read back, of the pushed tensors' `shapes` (name -> shape): up to
    128 rows at a fixed stride of the output layer and the embedding (every row of a tied output layer moves at
    each step), whole norms."""
    names = list(shapes)
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")
                     and n.split(".")[2].isdigit()})
    wanted = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    if layers:
        wanted += [f"model.layers.{layers[0]}.input_layernorm.weight",
                   f"model.layers.{layers[-1]}.post_attention_layernorm.weight"]
    requests: list[list[Any]] = []
    for name in wanted:
        shape = shapes.get(name)
        if shape is None:
            continue
        rows = list(range(0, shape[0], max(1, shape[0] // 128))) if len(shape) == 2 else None
        requests.append([name, rows])
    return requests


def verify_engine_weights(engine: RefitTarget, requests: list[list[Any]], expected: Callable[[str], Tensor],
                          previous: Mapping[str, int]) -> dict[str, int]:
    """Check that every worker of `engine` holds `expected(name)` for each of `requests` it can read.

    `previous`: the fingerprints of the last verified push (`"<name>@<worker>"` -> sum), to tell a lost sync
    (the worker still holds them) from corrupted weights. Returns this push's fingerprints, the next call's
    `previous`. Raises `RefitVerificationError` naming the engine, the worker and the first tensor that differs,
    or when no requested tensor is readable; `RolloutEngineError` when the read-back fails.
    """
    try:
        answers = engine.llm.collective_rpc("nrc_weight_checksums", args=(requests,))
    except Exception as exc:
        raise RolloutEngineError(f"refit verification of {engine.name} failed: {type(exc).__name__}: {exc}") \
            from exc
    checked = 0
    current: dict[str, int] = {}
    for worker, answer in enumerate(answers):
        for name, _rows in requests:
            got = answer.get(name)
            if got is None:
                continue
            dtype = getattr(torch, str(got["dtype"]).removeprefix("torch."))
            fingerprint = checksum(expected(name).to(dtype), got["rows"])
            current[f"{name}@{worker}"] = fingerprint
            if int(got["sum"]) != fingerprint:
                why = ("it still holds the previous weights (the sync was lost)"
                       if previous.get(f"{name}@{worker}") == int(got["sum"])
                       else "it holds neither the new nor the previous weights")
                raise RefitVerificationError(
                    f"refit verification failed on {engine.name} (worker {worker}): tensor {name!r} differs from "
                    f"the trainer's after the weight sync: {why}. Set rollout.verify_refit=false only to "
                    "debug; the rollouts would come from other weights than the trainer's.")
            checked += 1
    if checked == 0:
        raise RefitVerificationError(f"refit verification on {engine.name}: none of {[n for n, _ in requests]} "
                                     "is readable on the engine's workers")
    return current


__all__ = ["verify_engine_weights", "verify_requests"]

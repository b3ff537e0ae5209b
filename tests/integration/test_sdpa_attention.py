"""The CPU layer spec's fused core attention (`models.sdpa_attention`) against Megatron's unfused module.

Real Megatron-Core (one-process gloo): the module alone on grouped-query heads under the causal mask, no mask
and a context-parallel style mask; a whole tiny policy's logprobs and gradients with the fused path on and
off; the properties the trainer relies on (no-grad forward equals the training forward bit for bit, so the
first forward's logprobs can serve as old logprobs; repeated backward passes equal bit for bit).
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

FP32_TOL = {"rtol": 1e-5, "atol": 2e-6}


@pytest.fixture(scope="module")
def megatron_state(megatron_runtime: Any) -> None:
    """Megatron's parallel state at TP = 1 for this module (see conftest.megatron_runtime)."""


def _modules(heads: int = 6, groups: int = 2, head_dim: int = 32, causal: bool = True) -> tuple[Any, Any]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_rollout_correction.models.megatron_cpu import seed_model_parallel
    from nemo_rollout_correction.models.sdpa_attention import SdpaDotProductAttention

    seed_model_parallel(0)  # the unfused module forks Megatron's RNG tracker around its dropout
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                               attention_softmax_in_fp32=True)
    kind = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return (SdpaDotProductAttention(config, 1, kind, "self"), DotProductAttention(config, 1, kind, "self"))


def _qkv(sq: int, sk: int, batch: int = 3, heads: int = 6, groups: int = 2, head_dim: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(sq, batch, heads, head_dim), (sk, batch, groups, head_dim), (sk, batch, groups, head_dim)]
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def _run(module: Any, qkv: list[torch.Tensor], mask: torch.Tensor | None) -> list[torch.Tensor]:
    for tensor in qkv:
        tensor.grad = None
    out = module(*qkv, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach()] + [tensor.grad.clone() for tensor in qkv]  # type: ignore[union-attr]


def _masks(seq: int) -> dict[str, torch.Tensor]:
    causal = torch.ones(seq, seq, dtype=torch.bool).triu_(1)[None, None]
    # a context-parallel rank's mask: its queries (scattered positions) against all keys, key after query
    query_pos = torch.tensor([0, 1, 6, 7])
    cp = (torch.arange(seq)[None, :] > query_pos[:, None])[None, None]
    return {"causal": causal, "cp": cp}


@pytest.mark.parametrize("case", ["causal", "cp", "none_causal_type", "none_no_mask_type"])
def test_fused_module_equals_megatrons_unfused_module(megatron_state: None, case: str) -> None:
    fused, unfused = _modules(causal=case != "none_no_mask_type")
    seq = 8
    qkv = _qkv(4, seq) if case == "cp" else _qkv(seq, seq)
    mask = {"causal": _masks(seq)["causal"], "cp": _masks(seq)["cp"]}.get(case)
    # without a mask Megatron's causal softmax builds one on the GPU: the unfused reference gets the CPU one
    reference_mask = _masks(seq)["causal"] if case == "none_causal_type" else mask
    unfused_out = _run(unfused, qkv, reference_mask)
    fused_out = _run(fused, qkv, mask)
    for got, want in zip(fused_out, unfused_out, strict=True):
        torch.testing.assert_close(got, want, **FP32_TOL)
    assert not all(torch.equal(a, b) for a, b in zip(fused_out, unfused_out, strict=True)), \
        "bit-identical outputs: the fused kernel did not run"
    fused.fused = False  # the A/B switch really takes Megatron's path
    assert all(torch.equal(a, b) for a, b in zip(_run(fused, qkv, reference_mask), unfused_out, strict=True))


def test_dropout_in_training_falls_back_to_megatron(megatron_state: None) -> None:
    fused, _ = _modules()
    fused.attention_dropout.p = 0.1
    called: list[bool] = []
    parent = type(fused).__mro__[1].forward

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        called.append(True)
        return parent(self, *args, **kwargs)

    qkv = _qkv(8, 8)
    mask = _masks(8)["causal"]
    original = type(fused).__mro__[1].forward
    try:
        type(fused).__mro__[1].forward = spy
        fused.train()
        fused(*qkv, mask)
        assert called, "attention dropout in training must take Megatron's unfused path"
        called.clear()
        fused.eval()
        fused(*qkv, mask)
        assert not called, "without active dropout the fused kernel must run"
    finally:
        type(fused).__mro__[1].forward = original


def _policy(root: Path) -> MegatronPolicy:
    hf_dir = tiny_llama_dir(root / "tiny", hidden_size=128, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, vocab_size=512)
    return MegatronPolicy.from_hf(hf_dir, seed=0)


def _set_fused(policy: MegatronPolicy, fused: bool) -> int:
    from nemo_rollout_correction.models.sdpa_attention import SdpaDotProductAttention

    modules = [m for m in policy.model.modules() if isinstance(m, SdpaDotProductAttention)]
    for module in modules:
        module.fused = fused
    return len(modules)


def test_policy_logprobs_and_gradients_match_the_unfused_path(megatron_state: None, tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    assert _set_fused(policy, True) == 2, "the CPU layer spec must use the fused core attention in every layer"
    ids = torch.randint(3, 512, (4, 23), generator=torch.Generator().manual_seed(1))
    results = {}
    for fused in (True, False, True):
        _set_fused(policy, fused)
        policy.model.zero_grad(set_to_none=True)
        logprobs = policy.token_logprobs(ids)
        logprobs.sum().backward()
        grads = [p.grad.clone() for p in policy.model.parameters()]  # type: ignore[union-attr]
        if fused in results:  # repeated training forward + backward: bit for bit (run-to-run determinism)
            assert torch.equal(results[fused][0], logprobs.detach())
            assert all(torch.equal(a, b) for a, b in zip(results[fused][1], grads, strict=True))
        results[fused] = (logprobs.detach(), grads)
    torch.testing.assert_close(results[True][0], results[False][0], **FP32_TOL)
    for got, want in zip(results[True][1], results[False][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the no-grad scoring pass equals the training forward bit for bit (the reused old logprobs rely on it)
    _set_fused(policy, True)
    with torch.no_grad():
        assert torch.equal(policy.token_logprobs(ids), results[True][0])
    no_grad = policy.score_microbatches([ids[:2], ids[2:]])
    assert no_grad is not None and torch.equal(torch.cat(no_grad), results[True][0])

"""`nrc audit`'s distribution probe math (audit/probes.py) against direct computations."""

from __future__ import annotations

import math

import torch

from nemo_rollout_correction.audit.probes import (
    DivergenceAccumulator,
    LayerDiff,
    first_token_stats,
    parting_layer,
    position_divergence,
)

V = 50


def two_distributions(seed: int = 0, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    trainer = torch.log_softmax(logits, -1)
    engine = torch.log_softmax(logits + scale * torch.randn(V, generator=gen, dtype=torch.float64), -1)
    return trainer, engine


def test_whole_vocabulary_tv_and_kl_are_exact() -> None:
    trainer, engine = two_distributions()
    tv, kl, rest = position_divergence(trainer.float(), (torch.arange(V), engine.float()), whole_vocab=True)
    p, q = trainer.exp(), engine.exp()
    assert math.isclose(tv, 0.5 * float((p - q).abs().sum()), rel_tol=1e-5)
    assert math.isclose(kl, float((q * (engine - trainer)).sum()), rel_tol=1e-4)
    assert rest < 1e-6
    same, zero, _ = position_divergence(trainer.float(), (torch.arange(V), trainer.float()), whole_vocab=True)
    assert same < 1e-6 and abs(zero) < 1e-6


def test_top_k_with_a_rest_bucket_is_a_lower_bound_that_tightens_with_k() -> None:
    for seed in range(5):
        trainer, engine = two_distributions(seed, scale=0.8)
        exact_tv, exact_kl, _ = position_divergence(trainer.float(), (torch.arange(V), engine.float()),
                                                    whole_vocab=True)
        previous = (-1.0, -1.0)
        for k in (1, 5, 20, 49):
            ids = torch.topk(engine, k).indices
            tv, kl, rest = position_divergence(trainer.float(), (ids, engine[ids].float()), whole_vocab=False)
            assert 0 <= tv <= exact_tv + 1e-6 and kl <= exact_kl + 1e-6
            assert math.isclose(rest, 1 - float(engine[ids].exp().sum()), abs_tol=1e-6)
            assert tv >= previous[0] - 1e-6  # a finer partition never lowers TV
            previous = (tv, kl)
        ids = torch.arange(V)  # k = V: the rest bucket is empty and the coarse values are the exact ones
        tv, kl, _ = position_divergence(trainer.float(), (ids, engine.float()), whole_vocab=False)
        assert math.isclose(tv, exact_tv, rel_tol=1e-4) and math.isclose(kl, exact_kl, rel_tol=1e-3, abs_tol=1e-7)


def test_accumulator_covers_response_positions_and_the_first_token() -> None:
    trainer, engine = two_distributions(scale=0.5)
    length, start = 7, 3  # tokens 3..6 are the response: 4 positions, scored at rows 2..5
    lps = torch.stack([trainer.float()] * (length - 1))
    lps[start - 1] = engine.float()  # the first response token's row agrees exactly
    positions = [(torch.arange(V), engine.float())] * (length - 1)
    acc = DivergenceAccumulator(-1, V)
    acc.add(lps, positions, start)
    out = acc.result()
    tv, _, _ = position_divergence(trainer.float(), positions[0], whole_vocab=True)
    assert out.num_positions == 4 and out.first_token_tv_mean < 1e-6
    assert math.isclose(out.tv_mean, 3 * tv / 4, rel_tol=1e-5) and math.isclose(out.tv_max, tv, rel_tol=1e-6)
    assert out.support == "whole vocabulary"


def test_first_token_stats_and_parting_layer() -> None:
    rollout = torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, 0.0, -1.0, -1.0]])
    old = rollout + torch.tensor([[0.0, 0.5, 0.1, 0.1], [0.0, 0.0, -0.2, 9.0]])
    mask = torch.tensor([[False, True, True, True], [False, False, True, True]])
    stats = first_token_stats(old, rollout, mask)
    assert math.isclose(stats["max_abs_logprob_diff"], 0.5)
    assert math.isclose(stats["mean_abs_logprob_diff"], 0.35, rel_tol=1e-6)
    expected = ((math.exp(0.5) - 1.5) + (math.exp(-0.2) - 0.8)) / 2
    assert math.isclose(stats["k3_kl"], expected, rel_tol=1e-6)
    layers = [LayerDiff("embedding", 0.0, 0.0), LayerDiff("layer_0", 1e-6, 2e-7), LayerDiff("layer_1", 0.3, 0.02)]
    assert parting_layer(layers) == "layer_1" and parting_layer(layers[:2]) is None

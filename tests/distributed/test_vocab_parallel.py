"""Vocab-parallel logprobs equal the single-process `torch.log_softmax` reference.

The `distributed` tests share ONE launch of 4 spawned gloo ranks (`vocab_parallel_workers.worker`)
that runs every case on TP4, on two TP2 pairs and on TP1 (a real group of size 1): logprobs,
entropies and the gradient of a fixed objective w.r.t. the full logits (reassembled from the
shards) are compared with the reference on the full logits, and every collective is counted.
The other tests are single-process checks of the pure math helpers, the reference itself and
the argument handling.

Tolerance on values: 1e-6 absolute plus one fp32 ulp of the value (2**-23 relative). The
sharded sum of exp(x - max) runs in a different order than torch's kernel, which can move
log Z by an ulp and so the final fp32 rounding of `x_t - max - log Z` by one ulp of the result
(about 1e-6 for logprobs near -10, 2e-6 near -20).
"""

from __future__ import annotations

import time
from typing import Any

import dist_harness
import pytest
import torch
import vocab_parallel_workers as workers
from dist_workers import CollectiveCounter
from torch import Tensor
from vocab_parallel_workers import CASES, Case, make_data, objective, processed_logits, reference, vllm_sort_support

from nemo_rollout_correction.distributed import vocab_parallel_logprobs
from nemo_rollout_correction.distributed.vocab_parallel import (
    STATUS_KEPT,
    SamplingReplay,
    active_filters,
    finish_partials,
    local_candidates,
    logits_grad,
    scaled_logits,
    shard_partials,
    support_counts,
    support_from_candidates,
)

ATOL, RTOL = 1e-6, 2.0**-23
LAYOUTS = {"tp4": (4, (0, 1, 2, 3)), "tp2": (2, (0, 1))}


def close(actual: Tensor, expected: Tensor, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same -inf / NaN pattern, finite entries within tolerance."""
    assert actual.shape == expected.shape
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), "NaN pattern differs"
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "-inf (out-of-support) pattern differs"
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite].float(), expected[finite].float(), rtol=rtol, atol=atol)


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality, NaN equal to NaN."""
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=123.0), torch.nan_to_num(b, nan=123.0))


# ---- the gloo launch ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vp_run() -> dict[str, Any]:
    """Every case on TP4, TP2 (two pairs) and TP1, one launch of 4 gloo ranks."""
    started = time.perf_counter()
    ranks = dist_harness.launch(workers.worker, 4, timeout=180.0)
    return {"ranks": ranks, "seconds": time.perf_counter() - started}


@pytest.fixture(scope="module")
def refs() -> dict[str, dict[str, Tensor]]:
    data = make_data()
    return {name: reference(*data[case.data], case) for name, case in CASES.items()}


def _group_results(vp_run: dict[str, Any], layout: str, name: str, ranks: tuple[int, ...]) -> list[dict[str, Any]]:
    return [vp_run["ranks"][r]["results"][(layout, name)] for r in ranks]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_reference(vp_run: dict[str, Any], refs: dict[str, dict[str, Tensor]], layout: str,
                                  name: str) -> None:
    tp, ranks = LAYOUTS[layout]
    case, ref = CASES[name], refs[name]
    results = _group_results(vp_run, layout, name, ranks)
    first = results[0]
    assert first["lp_dtype"] == torch.float32
    close(first["logprobs"], ref["logprobs"])
    if case.entropy:
        close(first["entropy"], ref["entropy"])
    # Replicated across TP: every rank of the group holds the same bits.
    for other in results[1:]:
        assert same_bits(other["logprobs"], first["logprobs"])
        if case.entropy:
            assert same_bits(other["entropy"], first["entropy"])
    if tp == 2:  # the other pair ran the same data
        for mine, theirs in zip(results, _group_results(vp_run, layout, name, (2, 3)), strict=True):
            assert same_bits(mine["logprobs"], theirs["logprobs"])
    # Gradient w.r.t. the full logits, reassembled from the shards in rank order.
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    assert grad.dtype == ref["grad"].dtype
    bf16 = ref["grad"].dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref["grad"].float(), atol=ATOL, rtol=2.0**-7 if bf16 else 1e-5)
    assert all(r["unchanged"] for r in results), "the caller's logits were modified"
    assert all(r["backward_collectives"] == [] for r in results), "backward must be local"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_tp1_group_is_exact_and_issues_no_collective(vp_run: dict[str, Any], refs: dict[str, dict[str, Tensor]],
                                                     name: str) -> None:
    for rank in range(4):
        result = vp_run["ranks"][rank]["results"][("tp1", name)]
        assert result["collectives"] == [] and result["backward_collectives"] == []
        assert same_bits(result["logprobs"], refs[name]["logprobs"])
        if CASES[name].entropy:
            assert same_bits(result["entropy"], refs[name]["entropy"])
        assert same_bits(result["grad"], refs[name]["grad"])
        assert result["unchanged"]
    none = vp_run["ranks"][0]["results"][("none", "top_k_top_p")]
    assert none["collectives"] == []


def _calls(vp_run: dict[str, Any], layout: str, name: str) -> list[tuple[str, str, int]]:
    rank_calls = [r["collectives"] for r in _group_results(vp_run, layout, name, LAYOUTS[layout][1])]
    assert all(calls == rank_calls[0] for calls in rank_calls), "ranks issued different collectives"
    return [(op, group, nbytes) for _, op, group, nbytes in rank_calls[0]]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collective_count_and_bytes(vp_run: dict[str, Any], layout: str) -> None:
    data = make_data()
    gather = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
    for name, case in CASES.items():
        calls = _calls(vp_run, layout, name)
        n = data[case.data][1].numel()
        cols = 4 if case.entropy else 3
        assert all(group == "tp" for _, group, _ in calls), calls
        assert calls[-1] == ("all_reduce", "tp", 4 * n * cols), (name, calls)
        replay = SamplingReplay.create(case.kwargs.get("temperature", 1.0), case.kwargs.get("top_k"),
                                       case.kwargs.get("top_p"), vocab_size=case.kwargs.get("vocab_size", 10**9))
        if not replay.filters:  # MAX of the row maximum, then the fused SUM
            assert calls == [("all_reduce", "tp", 4 * n), ("all_reduce", "tp", 4 * n * cols)], (name, calls)
            continue
        gathers = calls[:-1]
        if n == 0:  # nothing to gather: only the (empty) SUM, so every rank still calls the same
            assert gathers == [], (name, calls)
            continue
        assert gathers and all(op == gather for op, _, _ in gathers), (name, calls)
        first = replay.top_k if replay.top_k is not None else case.kwargs.get("top_p_candidates", 64)
        assert gathers[0][2] == 4 * n * (first + 3), (name, calls)
        if replay.top_k is not None:
            assert len(gathers) == 1, (name, calls)  # top-k bounds the candidates: never escalates


@pytest.mark.distributed
def test_cases_exercise_what_they_claim(vp_run: dict[str, Any], refs: dict[str, dict[str, Tensor]]) -> None:
    # Sampled tokens outside the support exist (-inf), in every filtered case with unlikely targets.
    for name in ("top_k", "top_p", "top_k_top_p", "ties_top_k", "wide_top_p"):
        assert torch.isneginf(refs[name]["logprobs"]).any(), name
    # Ties at the top-k boundary: some row keeps more than k tokens.
    logits, _ = make_data()["ties"]
    kept = torch.isfinite(processed_logits(logits, top_k=5)).sum(dim=-1)
    assert (kept > 5).any()
    # Top-p escalated past the first candidates in the escalation cases, on both layouts.
    for layout in LAYOUTS:
        for name in ("top_p_escalates", "ties_top_p", "wide_top_p"):
            assert len(_calls(vp_run, layout, name)) >= 3, (layout, name)
    # Padded vocabulary: a padded id is NaN (invalid), never a probability.
    assert torch.isnan(refs["padded_vocab"]["logprobs"]).any()


# ---- single process: the reference -------------------------------------------------------------


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.9), (7, 0.5), (None, 0.3), (3, 0.99), (1, None)])
def test_brute_force_reference_equals_vllm_sort_rule_without_ties(top_k: int | None, top_p: float | None) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 50, generator=gen) * torch.tensor([0.2, 1.0, 3.0, 8.0]).repeat(16)[:, None]
    assert all(row.unique().numel() == row.numel() for row in logits)
    ours = torch.isfinite(processed_logits(logits, top_k=top_k, top_p=top_p))
    assert torch.equal(ours, vllm_sort_support(logits, top_k, top_p))


def test_top_p_ties_are_kept_together() -> None:
    # Three tokens tie at the top: any tie order gives vLLM a cut inside the tie group at p = 0.5;
    # the tie-inclusive rule keeps the whole group.
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0, -1.0]])
    kept = torch.isfinite(processed_logits(logits, top_p=0.5))
    assert kept.tolist() == [[True, True, True, False, False]]
    assert vllm_sort_support(logits, None, 0.5).sum() == 2  # vLLM keeps two of the three


# ---- single process: the pure helpers, sharded by hand -----------------------------------------


def _shards(x: Tensor, tp: int) -> list[Tensor]:
    return list(x.chunk(tp, dim=-1))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("kwargs", [{}, {"top_k": 5}, {"top_p": 0.9}, {"top_k": 6, "top_p": 0.6},
                                    {"top_p": 0.97, "temperature": 0.5}, {"top_k": 1}],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_helpers_sharded_by_hand_equal_reference(tp: int, kwargs: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(tp)
    logits = (torch.randn(12, 40, generator=gen) * 2.5).round(decimals=1)  # some ties
    target = torch.randint(0, 40, (12,), generator=gen)
    target[:3] = logits.argmin(dim=-1)[:3]
    case = Case("-", kwargs, entropy=True)
    ref = reference(logits, target, case)
    replay = SamplingReplay.create(kwargs.get("temperature", 1.0), kwargs.get("top_k"), kwargs.get("top_p"),
                                   vocab_size=40)
    width = 40 // tp
    xs = [scaled_logits(s, replay.temperature, vocab_start=r * width) for r, s in enumerate(_shards(logits, tp))]
    threshold = None
    row_max = torch.stack([x.amax(dim=-1) for x in xs]).amax(dim=0)
    if replay.filters:
        for num in (1, 2, 3, width):  # too few candidates flag rows unresolved; resolved rows are exact
            num = max(num, replay.first_candidates) if replay.top_k is not None else num
            found = support_from_candidates(torch.stack([local_candidates(x, num) for x in xs]), replay)
            assert torch.equal(found.row_max, row_max)
            expected = processed_logits(logits, **kwargs)
            smallest = torch.where(torch.isfinite(expected), expected, float("inf")).amin(dim=-1)
            assert torch.equal(found.threshold[found.resolved], smallest[found.resolved])
        assert bool(found.resolved.all())  # num = width: complete lists
        threshold = found.threshold
    local = [target - r * width for r in range(tp)]
    owned = [(t >= 0) & (t < width) for t in local]
    reduced = sum(shard_partials(x, row_max, threshold, t, o, entropy=True) for x, t, o in zip(xs, local, owned,
                                                                                             strict=True))
    assert isinstance(reduced, Tensor)
    logprob, ent, log_z = finish_partials(reduced, entropy=True)
    close(logprob, ref["logprobs"])
    assert ent is not None
    close(ent, ref["entropy"], rtol=1e-6)
    # Backward of the objective, shard by shard, equals autograd on the full logits.
    lp_leaf, ent_leaf = logprob.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    g_lp, g_ent = torch.autograd.grad(objective(lp_leaf, ent_leaf), (lp_leaf, ent_leaf))
    kept = [o & (reduced[:, 2] == STATUS_KEPT) for o in owned]
    grads = [logits_grad(x, row_max, log_z, threshold, t, k, g_lp, ent, g_ent, replay.temperature)
             for x, t, k in zip(xs, local, kept, strict=True)]
    torch.testing.assert_close(torch.cat(grads, dim=-1), ref["grad"], atol=ATOL, rtol=1e-5)


def test_candidates_payload_layout() -> None:
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    payload = local_candidates(x, 2)
    assert payload[0, :2].tolist() == [3.0, 1.0] and payload[0, 2] == 1.0 and payload[0, 3] == 3.0
    assert payload[1, 2] == 0.0 and payload[1, 3] == 5.0  # five entries equal the boundary value
    torch.testing.assert_close(payload[:, 4], torch.logsumexp(x, dim=-1))
    complete = local_candidates(x, 7)
    assert torch.isneginf(complete[:, 5:7]).all() and torch.isneginf(complete[:, 7]).all()
    assert (complete[:, 8] == 0).all()


# ---- single process: the public function -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_process_is_log_softmax_gather_exactly(dtype: torch.dtype, temperature: float) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 7, 33, generator=gen) * 4).to(dtype).requires_grad_(True)
    target = torch.randint(0, 33, (2, 7), generator=gen)
    counter = CollectiveCounter()
    counter.install()
    try:
        lp = vocab_parallel_logprobs(logits, target, None, temperature=temperature)
    finally:
        counter.uninstall()
    assert counter.calls == []
    expected = torch.log_softmax(logits.float() / temperature if temperature != 1.0 else logits.float(), dim=-1)
    assert torch.equal(lp, expected.gather(-1, target.unsqueeze(-1)).squeeze(-1))
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.gather(-1, target.unsqueeze(-1)).sum(), logits)
    assert torch.equal(grad, expected_grad)


def test_one_process_does_not_touch_the_logits_and_flags_bad_ids() -> None:
    logits = torch.randn(3, 4, 16)
    before = logits.clone()
    target = torch.tensor([[0, 15, 16, -1]] * 3)
    lp, ent = vocab_parallel_logprobs(logits, target, top_k=2, top_p=0.9, return_entropy=True)
    assert torch.equal(logits, before)
    assert torch.isnan(lp[:, 2:]).all() and not torch.isnan(lp[:, :2]).any()
    assert torch.isfinite(ent).all()
    counts = support_counts(lp, torch.ones_like(lp, dtype=torch.bool))
    assert int(counts["num_invalid_target_tokens"]) == 6
    assert int(counts["num_out_of_support_tokens"]) == int(torch.isneginf(lp).sum())


def test_extreme_logits_are_stable() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3, 40, generator=gen) * 1e4
    target = torch.randint(0, 40, (4, 3), generator=gen)
    lp, ent = vocab_parallel_logprobs(logits, target, return_entropy=True, top_k=5, top_p=0.9)
    assert not torch.isnan(lp).any() and torch.isfinite(ent).all() and (ent >= 0).all()
    lp, ent = vocab_parallel_logprobs(logits, target, return_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


def test_replay_arguments() -> None:
    assert SamplingReplay.create(1.0, -1, 1.0, vocab_size=10) == SamplingReplay()
    assert SamplingReplay.create(1.0, 0, None, vocab_size=10).top_k is None
    assert SamplingReplay.create(1.0, 10, None, vocab_size=10).top_k is None  # k >= vocab keeps all
    assert SamplingReplay.create(0.5, 3, 0.9, vocab_size=10) == SamplingReplay(0.5, 3, 0.9)
    # The one "disabled filter" rule, shared with the trainer's replay options (harness/settings.py).
    assert active_filters(-1, 1.0) == active_filters(0, None) == (None, None)
    assert active_filters(3, 0.9) == (3, 0.9)
    for bad in ({"temperature": 0.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": -0.1},
                {"top_k": True}, {"top_p_candidates": 0}):
        with pytest.raises(ValueError):
            SamplingReplay.create(**{"temperature": 1.0, **bad}, vocab_size=10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leading shape"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.int64))


def test_boundary_ties_beyond_the_candidates_are_counted() -> None:
    # Each of 2 shards holds four tokens tied at the top (and junk below): with one candidate per
    # rank the lists show two of the eight tied tokens; the tie counts recover all eight, so the
    # known tokens carry the whole nucleus and the first gather resolves the cut.
    shard = torch.tensor([[5.0, -9.0, 5.0, 5.0, -8.0, 5.0]])
    replay = SamplingReplay.create(top_p=0.9, vocab_size=12)
    found = support_from_candidates(torch.stack([local_candidates(shard, 1), local_candidates(shard, 1)]), replay)
    assert bool(found.resolved.all()) and found.threshold.tolist() == [5.0]
    # A nucleus that needs tokens below the gathered boundary is flagged, not guessed.
    flat = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6, 0.5]])
    found = support_from_candidates(torch.stack([local_candidates(flat, 1), local_candidates(flat, 1)]), replay)
    assert not bool(found.resolved.any())

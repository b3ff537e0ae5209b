"""The reduction contract: row chunking, the two-phase API, a simulated context-parallel split and a
microbatch split all give the single-process result."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import nemo_rollout_correction.core.correction as correction
from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.correction import finish_correction, local_is_weight_mean, sequence_partials
from nemo_rollout_correction.core.metrics import finalize_metrics
from nemo_rollout_correction.core.stats import Partials

NAN = float("nan")


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


def make_batch(rows: int = 7, cols: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, cols, generator=gen) * 3 - 0.05
    old = rollout + 0.15 * torch.randn(rows, cols, generator=gen)
    lengths = torch.randint(0, cols + 1, (rows,), generator=gen)
    lengths[0], lengths[1] = cols, 0  # a full row and a row without loss tokens
    start = torch.randint(0, 3, (rows,), generator=gen)  # prompt tokens before the response
    pos = torch.arange(cols)
    mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None].clamp(max=cols))
    old[2, int(pos[mask[2]][0])] -= 12.0  # a catastrophic token (vetoed at 1e-4)
    rollout[3, -1] = NAN  # padding or loss token, depending on row 3's length: both must work
    rollout[4, 0] = NAN
    mask[4, 0] = True  # a non-finite loss token
    return old, rollout, mask


CONFIGS = [
    cfg(),
    cfg(rollout_is="token", rollout_is_threshold=1.2),
    cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.15, rollout_is_batch_normalize=True),
    cfg(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_two_sided=True),
    cfg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=3.0, rollout_token_veto_threshold=1e-4),
    cfg(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.05, rollout_is_batch_normalize=True),
    cfg(rollout_rs="seq_sum_k1,seq_mean_k1", rollout_rs_threshold="0.3_3.0,0.97_1.03",
        rollout_token_veto_threshold=1e-4, nonfinite_policy="mask_token"),
    cfg(rollout_is="token", rollout_rs="token_k1,seq_max_k2,seq_mean_k3,seq_sum_k2,token_k3",
        rollout_rs_threshold="0.8_1.25,0.05,0.01,0.2,0.05", rejected_tokens_in_denominator=True),
    cfg(rollout_is="geometric", rollout_rs="seq_max_k3,seq_sum_k3", rollout_rs_threshold="0.05,0.1",
        metrics_only=True, rollout_token_veto_threshold=1e-4),
    # Token-level rejection alone: no sequence criterion may reject the same tokens and hide a
    # phase 2 that forgets token RS (a bug the distributed tests caught).
    cfg(rollout_rs="token_k3", rollout_rs_threshold="0.002"),
    cfg(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.97_1.03", metrics_only=True),
]
IDS = [f"c{i}" for i in range(len(CONFIGS))]

TWO_PHASE_CONFIGS = [pytest.param(c, id=i) for c, i in zip(CONFIGS, IDS, strict=True)]


def assert_metrics_close(actual: dict[str, float], expected: dict[str, float], skip: tuple[str, ...] = ()) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if key.endswith(skip):
            continue
        assert actual[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def assert_outputs_close(actual: Any, expected: Any) -> None:
    assert torch.equal(actual.keep_mask, expected.keep_mask)
    assert torch.equal(actual.denominator_mask, expected.denominator_mask)
    torch.testing.assert_close(actual.is_weights, expected.is_weights, rtol=1e-6, atol=1e-7)


def test_batch_exercises_the_interesting_cases() -> None:
    old, rollout, mask = make_batch()
    out = compute_rollout_correction(old, rollout, mask, cfg(rollout_token_veto_threshold=1e-4))
    assert out.metrics["rollout_corr/nonfinite_token_count"] >= 1
    assert out.metrics["rollout_corr/veto_fraction"] > 0
    assert not mask[1].any()


# ---- chunking ------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", CONFIGS, ids=IDS)
@pytest.mark.parametrize("chunk", [7, 16, 40])
def test_chunking_changes_nothing(c: RolloutCorrectionConfig, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    old, rollout, mask = make_batch()
    reference = compute_rollout_correction(old, rollout, mask, c)
    monkeypatch.setattr(correction, "CHUNK_ELEMENTS", chunk)
    assert len(correction.row_chunks(old)) > 1
    chunked = compute_rollout_correction(old, rollout, mask, c)
    assert_outputs_close(chunked, reference)
    assert_metrics_close(chunked.metrics, reference.metrics)


@pytest.mark.parametrize("c", TWO_PHASE_CONFIGS)
def test_chunked_two_phase_changes_nothing(c: RolloutCorrectionConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    old, rollout, mask = make_batch()
    reference = compute_rollout_correction(old, rollout, mask, c)
    monkeypatch.setattr(correction, "CHUNK_ELEMENTS", 7)
    two_phase = finish_correction(old, rollout, mask, c, sequence_partials(old, rollout, mask, c))
    assert_outputs_close(two_phase, reference)
    assert_metrics_close(two_phase.metrics, reference.metrics)


def test_chunking_with_nonfinite_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    old, rollout, mask = make_batch()
    monkeypatch.setattr(correction, "CHUNK_ELEMENTS", 16)
    with pytest.raises(ValueError, match="non-finite"):
        compute_rollout_correction(old, rollout, mask, cfg(nonfinite_policy="raise"))


# ---- two-phase API -------------------------------------------------------------------------------


@pytest.mark.parametrize("c", TWO_PHASE_CONFIGS)
def test_two_phase_equals_one_call(c: RolloutCorrectionConfig) -> None:
    old, rollout, mask = make_batch()
    reference = compute_rollout_correction(old, rollout, mask, c)
    out = finish_correction(old, rollout, mask, c, sequence_partials(old, rollout, mask, c))
    assert_outputs_close(out, reference)
    assert_metrics_close(out.metrics, reference.metrics)
    assert_metrics_close(finalize_metrics(out.partials, c), reference.metrics)


def test_two_phase_raise_policy() -> None:
    old, rollout, mask = make_batch()
    c = cfg(nonfinite_policy="raise")
    with pytest.raises(ValueError, match="nonfinite_policy='raise'"):
        sequence_partials(old, rollout, mask, c)  # may already raise ...
        seq = sequence_partials(old, rollout, mask, cfg())
        finish_correction(old, rollout, mask, c, seq)  # ... and phase 2 must


# ---- simulated context parallelism -----------------------------------------------------------------


def cp_columns(cols: int, cp: int, rank: int) -> torch.Tensor:
    """Megatron's load-balanced layout: rank r holds chunks r and 2*cp-1-r of every sequence."""
    size = cols // (2 * cp)
    chunks = [rank, 2 * cp - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def reduce_seq_partials(parts: list[Partials]) -> Partials:
    """What the CP all-reduce does: SUM, MAX and MIN entry by entry."""
    out = Partials(sums=dict(parts[0].sums), maxs=dict(parts[0].maxs), mins=dict(parts[0].mins))
    for p in parts[1:]:
        out.sums = {k: out.sums[k] + v for k, v in p.sums.items()}
        out.maxs = {k: torch.maximum(out.maxs[k], v) for k, v in p.maxs.items()}
        out.mins = {k: torch.minimum(out.mins[k], v) for k, v in p.mins.items()}
    return out


def run_cp(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, c: RolloutCorrectionConfig, cp: int,
           is_weight_mean: float | None = None) -> tuple[list[Any], list[torch.Tensor], Partials]:
    cols = [cp_columns(old.shape[1], cp, r) for r in range(cp)]
    shards = [(old[:, ix], rollout[:, ix], mask[:, ix]) for ix in cols]
    seq = reduce_seq_partials([sequence_partials(*s, c) for s in shards])
    outs = [finish_correction(*s, c, seq, owns_sequences=(r == 0), is_weight_mean=is_weight_mean)
            for r, s in enumerate(shards)]
    merged = Partials()
    for out in outs:
        merged.merge(out.partials)
    return outs, cols, merged


def global_is_weight_mean(merged: Partials) -> float:
    return local_is_weight_mean(merged)


@pytest.mark.parametrize("c", TWO_PHASE_CONFIGS)
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_split_equals_single_process(c: RolloutCorrectionConfig, cp: int) -> None:
    old, rollout, mask = make_batch(cols=16)
    reference = compute_rollout_correction(old, rollout, mask, c)
    outs, cols, merged = run_cp(old, rollout, mask, c, cp)
    if c.rollout_is_batch_normalize:
        # the caller reduces the kept-weight sum and count over dp x cp, then passes the global mean
        outs, cols, merged = run_cp(old, rollout, mask, c, cp, is_weight_mean=global_is_weight_mean(merged))
    for out, ix in zip(outs, cols, strict=True):
        assert torch.equal(out.keep_mask, reference.keep_mask[:, ix])
        assert torch.equal(out.denominator_mask, reference.denominator_mask[:, ix])
        torch.testing.assert_close(out.is_weights, reference.is_weights[:, ix], rtol=1e-6, atol=1e-7)
    assert_metrics_close(finalize_metrics(merged, c), reference.metrics)
    assert sum(o.num_kept_tokens for o in outs) == reference.num_kept_tokens
    assert sum(o.num_denominator_tokens for o in outs) == reference.num_denominator_tokens


@pytest.mark.parametrize("c", CONFIGS, ids=IDS)
def test_microbatch_split_equals_full_batch(c: RolloutCorrectionConfig) -> None:
    old, rollout, mask = make_batch(rows=9)
    reference = compute_rollout_correction(old, rollout, mask, c)
    merged = Partials()
    splits = [(0, 4), (4, 5), (5, 9)]
    mean = None
    if c.rollout_is_batch_normalize:
        first = Partials()
        for a, b in splits:
            first.merge(compute_rollout_correction(old[a:b], rollout[a:b], mask[a:b], c).partials)
        mean = global_is_weight_mean(first)
    for a, b in splits:
        out = compute_rollout_correction(old[a:b], rollout[a:b], mask[a:b], c, is_weight_mean=mean)
        assert_outputs_close(out, _rows(reference, a, b))
        merged.merge(out.partials)
    assert_metrics_close(finalize_metrics(merged, c), reference.metrics)


def _rows(out: Any, a: int, b: int) -> Any:
    class View:
        keep_mask = out.keep_mask[a:b]
        denominator_mask = out.denominator_mask[a:b]
        is_weights = out.is_weights[a:b]

    return View()


def test_batch_norm_factor_survives_the_reduction() -> None:
    old, rollout, mask = make_batch(cols=16)
    c = CONFIGS[5]
    reference = compute_rollout_correction(old, rollout, mask, c)
    _, _, merged = run_cp(old, rollout, mask, c, 2)
    _, _, merged = run_cp(old, rollout, mask, c, 2, is_weight_mean=global_is_weight_mean(merged))
    key = "rollout_corr/rollout_is_batch_norm_factor"
    assert finalize_metrics(merged, c)[key] == pytest.approx(reference.metrics[key], rel=1e-6)
    assert math.isfinite(reference.metrics[key])

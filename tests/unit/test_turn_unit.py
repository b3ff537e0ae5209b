"""`rollout_correction.sequence_unit`: sequence-level and geometric IS and sequence rejection per trajectory or per
turn, checked against a direct computation on a multi-turn batch built as the trainer builds it; observation
tokens out of the weights, the masks and every statistic; the per-turn mismatch sums."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import multi_turn_workers as mtw

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.core.segments import (
    Segments,
    fold_any,
    fold_sum,
    segment_loss_mask,
    turn_mismatch_sums,
)
from nemo_rollout_correction.distributed import ParallelGroups
from nemo_rollout_correction.losses import RolloutCorrectedPolicyLoss

GROUPS = ParallelGroups.single()


def _correct(cfg: RolloutCorrectionConfig, data: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    module = RolloutCorrectedPolicyLoss(cfg, PolicyLossConfig(loss_agg_mode="token-mean"))
    return module.correct(data["old"], data["rollout_logprobs"], data["loss_mask"], GROUPS,
                          advantages=data["advantages"], segments=Segments(data["turn_index"], mtw.MAX_TURNS))


def _units(data: dict[str, torch.Tensor], unit: str) -> list[torch.Tensor]:
    """The `[WIDTH]` bool masks of every sequence unit of every row (turn: one per turn present)."""
    out = []
    for row in range(8):
        mask = data["loss_mask"][row]
        if unit == "trajectory":
            out.append((row, mask))
        else:
            for k in range(mtw.MAX_TURNS):
                turn = mask & (data["turn_index"][row] == k)
                if turn.any():
                    out.append((row, turn))
    return out


@pytest.mark.parametrize("unit", ["trajectory", "turn"])
def test_sequence_tis_per_unit_equals_the_direct_computation(unit: str) -> None:
    data = mtw.multi_turn_batch()
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1.02, rollout_token_veto_threshold=None,
                                  sequence_unit=unit)
    out = _correct(cfg, data)
    expected = torch.zeros(8, mtw.WIDTH)
    for row, mask in _units(data, unit):
        log_rho = (data["old"][row] - data["rollout_logprobs"][row])[mask].double().sum()
        expected[row, mask] = float(torch.exp(log_rho).clamp(max=1.02))
    assert torch.equal(out.keep_mask, data["loss_mask"])  # truncation rejects nothing; observations never kept
    torch.testing.assert_close(out.is_weights, expected, atol=1e-6, rtol=1e-6)
    # the units really differ: per-turn weights are not the trajectory's
    if unit == "turn":
        traj = _correct(RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1.02,
                                                rollout_token_veto_threshold=None), data)
        assert not torch.allclose(traj.is_weights, out.is_weights)


@pytest.mark.parametrize("unit", ["trajectory", "turn"])
def test_geometric_mask_rejects_whole_units(unit: str) -> None:
    data = mtw.multi_turn_batch()
    cfg = RolloutCorrectionConfig(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.01,
                                  rollout_token_veto_threshold=None, sequence_unit=unit)
    out = _correct(cfg, data)
    expected_keep = torch.zeros(8, mtw.WIDTH, dtype=torch.bool)
    for row, mask in _units(data, unit):
        geo = float(torch.exp((data["old"][row] - data["rollout_logprobs"][row])[mask].double().mean()))
        expected_keep[row] |= mask & (1 / 1.01 <= geo <= 1.01)
    assert torch.equal(out.keep_mask, expected_keep)
    assert 0 < int(expected_keep.sum()) < int(data["loss_mask"].sum())  # some units kept, some rejected
    assert torch.all(out.is_weights[~out.keep_mask] == 0)


def test_observation_tokens_are_out_of_every_statistic() -> None:
    data = mtw.multi_turn_batch()
    cfg = mtw.CONFIGS["seq_rs_veto_turn"]
    out = _correct(cfg, data)
    calm = dict(data)  # observations with tame logprobs on both sides: nothing may change
    calm["old"] = torch.where(data["observation_mask"], -1.0, data["old"])
    calm["rollout_logprobs"] = torch.where(data["observation_mask"], -1.0, data["rollout_logprobs"])
    again = _correct(cfg, calm)
    assert torch.equal(out.keep_mask, again.keep_mask) and torch.equal(out.is_weights, again.is_weights)
    module = RolloutCorrectedPolicyLoss(cfg, PolicyLossConfig(loss_agg_mode="token-mean"))
    first = module.prepare_step([out], GROUPS).metrics
    second = module.prepare_step([again], GROUPS).metrics
    assert first == pytest.approx(second, nan_ok=True)
    assert not out.keep_mask[data["observation_mask"]].any()


def test_segment_helpers_token_by_token() -> None:
    ids = torch.tensor([[-1, 0, 0, -1, 1, 2], [0, -1, -1, 1, -1, -1]])
    mask = ids >= 0
    per_turn = segment_loss_mask(mask, Segments(ids, 3))
    assert per_turn.shape == (6, 6)
    assert per_turn[0].tolist() == [False, True, True, False, False, False]
    assert per_turn[2].tolist() == [False, False, False, False, False, True]
    assert per_turn[4].tolist() == [False, False, False, True, False, False]
    assert not per_turn[5].any()  # row 1 has no turn 2: an empty row
    assert torch.equal(fold_any(per_turn, 3), mask)
    assert torch.equal(fold_sum(per_turn.long(), 3), mask.long())
    with pytest.raises(ValueError, match=r"turn 2 but Segments\.count=2"):
        Segments(ids, 2)


def test_turn_mismatch_sums_by_turn() -> None:
    ids = torch.tensor([[0, 0, -1, 1]])
    mask = ids >= 0
    rollout = torch.tensor([[-1.0, -1.0, 5.0, -2.0]])
    reference = torch.tensor([[-1.0, -0.9, -9.0, -2.5]])
    sums = turn_mismatch_sums(reference, rollout, mask, ids, 3)
    r = torch.tensor(0.1, dtype=torch.float64)
    assert sums["turn_0/num_tokens"] == 2 and sums["turn_1/num_tokens"] == 1 and sums["turn_2/num_tokens"] == 0
    assert sums["turn_0/sum_k3"] == pytest.approx(float(torch.expm1(r) - r))
    assert sums["turn_1/sum_abs_log_ratio"] == pytest.approx(0.5)
    assert sums["turn_2/sum_k3"] == 0.0


def test_turn_unit_refuses_sequence_denominators() -> None:
    cfg = RolloutCorrectionConfig(rollout_is="sequence", sequence_unit="turn")
    with pytest.raises(ValueError, match="sequence_unit=turn supports the token-denominator"):
        RolloutCorrectedPolicyLoss(cfg, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"))
    with pytest.raises(ValueError, match="sequence_unit must be one of"):
        RolloutCorrectionConfig(sequence_unit="episode")  # type: ignore[arg-type]

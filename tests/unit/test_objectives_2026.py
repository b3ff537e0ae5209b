"""The 2026 off-policy objectives against transcriptions of their reference implementations.

Each reference below is written out independently here (from reading the public source, not by calling
our code) and compared with our loss on the same inputs: value and gradient with respect to the
current logprobs. Sources read (repository @ commit, file):

- CISPO: NovaSky-AI/SkyRL @ 03d74caf596391a62a53528ca9d23a51baffae3c,
  skyrl/backends/skyrl_train/utils/ppo_utils.py, `compute_policy_loss_cispo` (with `cispo_anchor`).
- GMPO: huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8 (PR #6078 merged as c62558ebe),
  trl/experimental/gmpo/gmpo_trainer.py, `GMPOTrainer._compute_loss` (beta = 0, no entropy mask).
- VESPO: huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8 (PR #5199), trl/trainer/grpo_trainer.py,
  `GRPOTrainer.get_gamma_weights` and the `vespo` branch of `_compute_loss` (token_truncate correction).
- M2PO: areal-project/AReaL @ cbff54d645d2cd8ee1f1c358a82f3f473588433d, areal/trainer/ppo/actor.py,
  `_apply_m2po_masking` and `_get_m2po_loss_mask` (docs/en/algorithms/m2po.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig, cispo_loss, gmpo_loss, vespo_loss

ROWS, COLS = 4, 7


def _inputs(seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(ROWS, COLS, generator=gen, dtype=torch.float64) * 3.0
    old = logprobs + 0.6 * torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([7, 5, 3, 6])
    mask = torch.arange(COLS)[None, :] < lengths[:, None]
    advantages = torch.randn(ROWS, generator=gen, dtype=torch.float64)
    return {"logprobs": logprobs, "old": old, "rollout": rollout, "mask": mask,
            "advantages": advantages[:, None].expand(ROWS, COLS).clone()}


def _grad(loss_fn, logprobs: Tensor) -> tuple[float, Tensor]:  # type: ignore[no-untyped-def]
    leaf = logprobs.clone().requires_grad_(True)
    loss = loss_fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return float(loss.detach()), grad


# ---- CISPO --------------------------------------------------------------------------------------


def skyrl_cispo_sum(log_probs: Tensor, anchor_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                    eps_clip_low: float, eps_clip_high: float) -> Tensor:
    """SkyRL's CISPO, transcribed: ratio = exp(clamp(lp - anchor, +-20)), clamped to
    [1 - eps_low, 1 + eps_high], loss = -A * clamped.detach() * lp, then a masked sum."""
    ratio = torch.exp(torch.clamp(log_probs - anchor_log_probs, min=-20.0, max=20.0))
    clamped = torch.clamp(ratio, 1 - eps_clip_low, 1 + eps_clip_high)
    loss = -advantages * clamped.detach() * log_probs
    return (loss * mask).sum()


@pytest.mark.parametrize(("eps_low", "eps_high"), [(1.0, 4.0), (0.2, 0.2), (0.0, 0.0)])
def test_cispo_matches_skyrl_old_anchor(eps_low: float, eps_high: float) -> None:
    d = _inputs()
    n = float(d["mask"].sum())
    ref_loss, ref_grad = _grad(lambda lp: skyrl_cispo_sum(lp, d["old"], d["advantages"], d["mask"].double(),
                                                         eps_low, eps_high) / n, d["logprobs"])
    out = _grad(lambda lp: cispo_loss(lp, d["old"], d["advantages"], d["mask"], ratio_low=1 - eps_low,
                                      ratio_high=1 + eps_high).per_token_loss.sum() / n, d["logprobs"])
    assert out[0] == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(out[1], ref_grad, atol=1e-12, rtol=0)


def test_cispo_keeps_every_token_gradient_where_ppo_zeroes_it() -> None:
    """The defining property: a ratio far above the bound still gives -clip(r) * A (PPO: 0)."""
    logprobs = torch.tensor([[0.0, -0.1]], dtype=torch.float64)
    old = torch.tensor([[-2.0, -0.1]], dtype=torch.float64)  # r = e^2 on token 0
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, grad = _grad(lambda lp: cispo_loss(lp, old, adv, mask, ratio_low=0.8, ratio_high=1.2).per_token_loss.sum(),
                    logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -1.0]], dtype=torch.float64))
    stats = cispo_loss(logprobs, old, adv, mask, ratio_low=0.8, ratio_high=1.2).stats
    assert float(stats["pg_clipfrac_sum"]) == 1.0 and float(stats["num_tokens"]) == 2.0


@pytest.mark.parametrize("bypass", [False, True])
def test_cispo_presets_are_skyrl_anchors_through_the_objective(bypass: bool) -> None:
    """`cispo` = SkyRL cispo_anchor='old'; `bypass_cispo` = cispo_anchor='rollout' (defaults [0, 5])."""
    d = _inputs(1)
    cfg = RolloutCorrectionConfig.from_preset("bypass_cispo" if bypass else "cispo",
                                              rollout_token_veto_threshold=None)
    anchor = d["rollout"] if bypass else d["old"]
    n = float(d["mask"].sum())
    ref = _grad(lambda lp: skyrl_cispo_sum(lp, anchor, d["advantages"], d["mask"].double(), 1.0, 4.0) / n,
                d["logprobs"])
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], d["advantages"], d["mask"], cfg,
                                                          PolicyLossConfig(clip_ratio_c=3.0),
                                                          old_logprobs=d["old"]).loss, d["logprobs"])
    assert ours[0] == pytest.approx(ref[0], abs=1e-12)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-12, rtol=0)


@pytest.mark.parametrize(("fields", "name"), [
    ({"cispo_ratio_low": -0.1}, "cispo_ratio_low"),
    ({"cispo_ratio_high": 0.0}, "cispo_ratio_high"),
    ({"cispo_ratio_low": 2.0, "cispo_ratio_high": 1.5}, "cispo_ratio_low"),
    ({"cispo_ratio_high": float("nan")}, "cispo_ratio_high"),
    ({"bypass_mode": True, "loss_type": "cispo", "rollout_is": "token"}, "rollout_is"),
])
def test_cispo_bad_bounds_raise_naming_the_field(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RolloutCorrectionConfig.from_dict({"loss_type": "cispo", **fields})
    if name.startswith("cispo"):
        with pytest.raises(ValueError, match="cispo_ratio"):
            PolicyLossConfig(loss_type="cispo", cispo_ratio_low=float(fields.get("cispo_ratio_low", 0.0)),  # type: ignore[arg-type]
                             cispo_ratio_high=float(fields.get("cispo_ratio_high", 5.0)))  # type: ignore[arg-type]


# ---- lower-bounded TIS ------------------------------------------------------------------------------


def nemo_rl_tis_weights(prev_logprobs: Tensor, generation_logprobs: Tensor, ratio_max: float,
                        ratio_min: float | None) -> Tensor:
    """NeMo-RL `truncated_importance_sampling_type: tis` after PR #2886, transcribed: the token IS weight
    exp(prev - generation) clamped to [ratio_min, ratio_max], ratio_min defaulting to 0 when unset."""
    weights = torch.exp(prev_logprobs - generation_logprobs)
    return torch.clamp(weights, min=0.0 if ratio_min is None else ratio_min, max=ratio_max)


def nemo_rl_token_loss(curr: Tensor, prev: Tensor, gen: Tensor, adv: Tensor, mask: Tensor, eps: float,
                       ratio_max: float, ratio_min: float | None) -> Tensor:
    """NeMo-RL's token-level ClippedPGLoss with TIS: sum(m * w * -min(rA, clip(r)A)) / sum(m)."""
    r = torch.exp(curr - prev)
    clipped = -torch.min(r * adv, torch.clamp(r, 1 - eps, 1 + eps) * adv)
    w = nemo_rl_tis_weights(prev, gen, ratio_max, ratio_min)
    return (clipped * w * mask).sum() / mask.sum()


@pytest.mark.parametrize(("preset", "overrides", "ratio_min"), [
    ("decoupled_token_tis_lb", {}, 0.5),  # the lower bound of PR #2886
    ("decoupled_token_is", {}, None),  # NeMo-RL's default: no lower bound (min 0)
    ("decoupled_token_tis_lb", {"rollout_is_threshold_lower": 0.9, "rollout_is_threshold": 1.1}, 0.9),
])
def test_lower_bounded_tis_matches_nemo_rl(preset: str, overrides: dict[str, float], ratio_min: float | None) -> None:
    d = _inputs(2)
    cfg = RolloutCorrectionConfig.from_preset(preset, rollout_token_veto_threshold=None, **overrides)
    ratio_max = cfg.rollout_is_threshold
    mask = d["mask"].double()
    ref = _grad(lambda lp: nemo_rl_token_loss(lp, d["old"], d["rollout"], d["advantages"], mask, 0.2, ratio_max,
                                              ratio_min), d["logprobs"])
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], d["advantages"], d["mask"], cfg,
                                                          old_logprobs=d["old"]).loss, d["logprobs"])
    # The correction's weights are float32 by design (core.correction): agreement to float32 rounding.
    assert ours[0] == pytest.approx(ref[0], abs=1e-6)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-6, rtol=0)
    if ratio_min is not None:  # the lower bound is active on these inputs (the test would not see it otherwise)
        w = torch.exp(d["old"] - d["rollout"])[d["mask"]]
        assert bool((w < ratio_min).any())


@pytest.mark.parametrize(("fields", "name"), [
    ({"rollout_is_threshold_lower": 3.0}, "rollout_is_threshold_lower"),
    ({"rollout_is_threshold_lower": -0.5}, "rollout_is_threshold_lower"),
    ({"rollout_is_threshold_lower": float("inf")}, "rollout_is_threshold_lower"),
])
def test_lower_bounded_tis_bad_bounds_raise_naming_the_field(fields: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RolloutCorrectionConfig.from_preset("decoupled_token_tis_lb", **fields)


# ---- sequence log-prob error threshold -------------------------------------------------------------


def nemo_rl_seq_logprob_error_mask(prev_logprobs: Tensor, generation_logprobs: Tensor, token_mask: Tensor,
                                   sample_mask: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """NeMo-RL's `compute_and_apply_seq_logprob_error_masking` (nemo_rl/algorithms/grpo.py), transcribed on
    the response positions: seq_mult_prob_error = sum(exp(|gen - prev| * m) * m) / clamp(sum(m), 1) with
    m = token_mask * sample_mask; the new sample_mask keeps sequences with error <= threshold."""
    mask = token_mask * sample_mask.unsqueeze(-1)
    lp_error = torch.abs(generation_logprobs - prev_logprobs)
    error = (torch.exp(lp_error * mask) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    new_sample_mask = (error <= threshold).to(sample_mask.dtype) * sample_mask
    return error, new_sample_mask


@pytest.mark.parametrize("threshold", [2.0, 2.5])
def test_seq_logprob_error_matches_nemo_rl(threshold: float) -> None:
    d = _inputs(3)
    d["rollout"][1] = d["old"][1] + 1.2  # a sequence far off: exp(1.2) = 3.3 per token
    cfg = RolloutCorrectionConfig.from_preset("seq_logprob_error", seq_logprob_error_threshold=threshold,
                                              rollout_token_veto_threshold=None)
    mask = d["mask"].double()
    error, sample_mask = nemo_rl_seq_logprob_error_mask(d["old"], d["rollout"], mask, torch.ones(ROWS,
                                                        dtype=torch.float64), threshold)
    assert 0 < int(sample_mask.sum()) < ROWS  # the filter acts on these inputs
    keep = mask * sample_mask[:, None]

    def nemo_loss(lp: Tensor) -> Tensor:  # token-level PPO clip over token_mask * sample_mask
        r = torch.exp(lp - d["old"])
        c = -torch.min(r * d["advantages"], torch.clamp(r, 0.8, 1.2) * d["advantages"])
        return (c * keep).sum() / keep.sum()

    ref = _grad(nemo_loss, d["logprobs"])
    out = rollout_corrected_policy_loss(d["logprobs"], d["rollout"], d["advantages"], d["mask"], cfg,
                                        old_logprobs=d["old"])
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], d["advantages"], d["mask"], cfg,
                                                          old_logprobs=d["old"]).loss, d["logprobs"])
    assert torch.equal(out.correction.keep_mask, keep.bool())
    assert ours[0] == pytest.approx(ref[0], abs=1e-12)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-12, rtol=0)
    m = out.correction.metrics
    assert m["rollout_corr/seq_logprob_error_max"] == pytest.approx(float(error.max()), rel=1e-6)
    assert m["rollout_corr/seq_logprob_error_mean"] == pytest.approx(float(error.mean()), rel=1e-6)
    assert m["rollout_corr/seq_logprob_error_seq_masked_fraction"] == pytest.approx(1 - float(sample_mask.mean()))


@pytest.mark.parametrize("value", [0.5, 0.0, -1.0, float("nan"), float("inf"), True])
def test_seq_logprob_error_bad_threshold_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="seq_logprob_error_threshold"):
        RolloutCorrectionConfig(seq_logprob_error_threshold=value)  # type: ignore[arg-type]


# ---- squared log-ratio penalty towards the rollout policy (prime-rl) ------------------------------------


def prime_rl_default_loss(trainer_logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor,
                          loss_mask: Tensor, dppo_mask_low: float, dppo_mask_high: float, kl_tau: float,
                          loss_scale: float) -> Tensor:
    """prime-rl's `default_loss_fn` ("DPPO+KL"), transcribed (src/prime_rl/trainer/rl/loss.py): DPPO binary-TV
    keep mask by advantage sign, pg = keep * A * ratio, kl = loss_mask * log_ratio**2, loss = sum(-pg + tau*kl)."""
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    invalid = torch.where(advantages > 0, probs_diff > dppo_mask_high, probs_diff < -dppo_mask_low)
    keep = loss_mask & ~invalid
    log_ratio = trainer_logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    pg_loss = keep * advantages * ratio
    kl_loss = loss_mask * log_ratio**2
    return (-pg_loss + kl_tau * kl_loss).sum() / loss_scale


@pytest.mark.parametrize("tau", [1e-3, 0.5])
def test_rollout_log_ratio_penalty_matches_prime_rl_default_loss(tau: float) -> None:
    """The `bypass_pg_dppo_kl` preset has prime-rl's gradient. prime-rl's pg term is -A * ratio (value), ours
    -sg(ratio) * A * log pi (the same gradient), so gradients are compared, and the penalty value on its own."""
    d = _inputs(4)
    d["rollout"] = d["logprobs"] + 0.3 * torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(9),
                                                      dtype=torch.float64)
    cfg = RolloutCorrectionConfig.from_preset("bypass_pg_dppo_kl", rollout_log_ratio_penalty=tau,
                                              dppo_tv_threshold=1.0, dppo_tv_threshold_low=1.0)  # nothing masked
    n = float(d["mask"].sum())
    ref = _grad(lambda lp: prime_rl_default_loss(lp, d["rollout"], d["advantages"], d["mask"], 1.0, 1.0, tau, n),
                d["logprobs"])
    out = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], d["advantages"], d["mask"], cfg).loss,
                d["logprobs"])
    torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=0)  # float32 IS weights
    kl_only = _grad(lambda lp: prime_rl_default_loss(lp, d["rollout"], torch.zeros_like(d["advantages"]), d["mask"],
                                                     1.0, 1.0, tau, n), d["logprobs"])
    no_adv = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], torch.zeros_like(d["advantages"]),
                                                            d["mask"], cfg).loss, d["logprobs"])
    assert no_adv[0] == pytest.approx(kl_only[0], abs=1e-12)
    torch.testing.assert_close(no_adv[1], kl_only[1], atol=1e-12, rtol=0)


def test_rollout_log_ratio_penalty_with_dppo_masking_differs_only_on_masked_tokens() -> None:
    """With the DPPO mask active, prime-rl still penalises the masked tokens; we penalise kept tokens only
    (docs/differences.md). The gradients then differ exactly by prime-rl's penalty gradient on masked tokens."""
    d = _inputs(5)
    d["rollout"] = d["logprobs"] + 0.8 * torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7),
                                                      dtype=torch.float64)
    cfg = RolloutCorrectionConfig.from_preset("bypass_pg_dppo_kl", rejected_tokens_in_denominator=True)
    n = float(d["mask"].sum())
    ref = _grad(lambda lp: prime_rl_default_loss(lp, d["rollout"], d["advantages"], d["mask"], 0.2, 0.2, 1e-3, n),
                d["logprobs"])
    out = rollout_corrected_policy_loss(d["logprobs"], d["rollout"], d["advantages"], d["mask"], cfg)
    masked = d["mask"] & ~out.correction.keep_mask
    assert bool(masked.any())
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], d["advantages"], d["mask"], cfg).loss,
                 d["logprobs"])
    penalty_grad_masked = torch.where(masked, 2e-3 * (d["logprobs"] - d["rollout"]) / n, 0.0)
    torch.testing.assert_close(ours[1] + penalty_grad_masked, ref[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf")])
def test_rollout_log_ratio_penalty_bad_value_names_the_field(value: float) -> None:
    with pytest.raises(ValueError, match="rollout_log_ratio_penalty"):
        RolloutCorrectionConfig(rollout_log_ratio_penalty=value)


# ---- GMPO ---------------------------------------------------------------------------------------


def trl_gmpo_loss(per_token_logps: Tensor, old_per_token_logps: Tensor, advantages: Tensor, mask: Tensor,
                  epsilon_low: float, epsilon_high: float) -> Tensor:
    """TRL's GMPOTrainer._compute_loss (beta 0, no entropy mask, one accumulation step), transcribed:
    clip each log-ratio one-sidedly by the advantage sign, geometric mean per sequence, mean over sequences.
    advantages: [B]."""
    log_ratio = per_token_logps - old_per_token_logps
    clamped_log_ratio = torch.clamp(log_ratio, min=-epsilon_low, max=epsilon_high)
    advantages_col = advantages.unsqueeze(1)
    clipped_log_ratio = torch.where(advantages_col > 0, torch.minimum(log_ratio, clamped_log_ratio),
                                    torch.maximum(log_ratio, clamped_log_ratio))
    log_importance_weights = (clipped_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef = torch.exp(log_importance_weights)
    per_sequence_loss = -coef * advantages
    return per_sequence_loss.mean()


@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.4, 0.4), (0.1, 0.3), (1e-3, 2.0)])
@pytest.mark.parametrize("bypass", [False, True])
def test_gmpo_matches_trl(eps_low: float, eps_high: float, bypass: bool) -> None:
    """Loss and gradient of TRL's GMPO equal ours with seq-mean-token-mean (TRL's mean over sequences), the
    clip range given as ratios exp(-epsilon), exp(epsilon_high); anchored on pi_old, or on pi_rollout."""
    d = _inputs(2)
    adv = d["advantages"][:, 0]
    anchor = d["rollout"] if bypass else d["old"]
    mask = d["mask"].double()
    ref = _grad(lambda lp: trl_gmpo_loss(lp, anchor, adv, mask, eps_low, eps_high), d["logprobs"])
    cfg = RolloutCorrectionConfig.from_dict({"loss_type": "gmpo", "bypass_mode": bypass,
                                            "gmpo_ratio_low": math.exp(-eps_low),
                                            "gmpo_ratio_high": math.exp(eps_high),
                                            "rollout_token_veto_threshold": None})
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, d["rollout"], adv, d["mask"], cfg,
                                                          PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"),
                                                          old_logprobs=d["old"]).loss, d["logprobs"])
    assert ours[0] == pytest.approx(ref[0], abs=1e-12)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-12, rtol=0)
    # Some tokens of the inputs are clipped (the test is not vacuous) and the clip removes their gradient.
    out = gmpo_loss(d["logprobs"], anchor, d["advantages"], d["mask"], ratio_low=math.exp(-eps_low),
                    ratio_high=math.exp(eps_high))
    assert float(out.stats["pg_clipfrac_sum"]) > 0


def test_gmpo_preset_is_trl_defaults() -> None:
    cfg = RolloutCorrectionConfig.from_preset("gmpo")
    assert cfg.loss_type == "gmpo" and cfg.gmpo_ratio_low == math.exp(-0.4) and cfg.gmpo_ratio_high == math.exp(0.4)
    assert RolloutCorrectionConfig.from_preset("bypass_gmpo").bypass_mode


def test_gmpo_value_is_the_sequence_ratio_on_every_token() -> None:
    """Per token the loss value is -A * G_i (the sequence's clipped geometric mean), whatever the token."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -1.5, -0.5]], dtype=torch.float64)
    adv = torch.full((1, 3), 2.0, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = gmpo_loss(logprobs, old, adv, mask, ratio_low=0.5, ratio_high=1.05)
    clipped = torch.tensor([min(0.1, math.log(1.05)), -0.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(out.per_token_loss, torch.full((1, 3), -2.0 * math.exp(float(clipped.mean())),
                                                              dtype=torch.float64))


@pytest.mark.parametrize(("fields", "name"), [
    ({"gmpo_ratio_low": 0.0}, "gmpo_ratio_low"),
    ({"gmpo_ratio_low": 1.2}, "gmpo_ratio_low"),
    ({"gmpo_ratio_high": 0.9}, "gmpo_ratio_high"),
    ({"gmpo_ratio_high": float("inf")}, "gmpo_ratio_high"),
    ({"gmpo_ratio_low": float("nan")}, "gmpo_ratio_low"),
    ({"bypass_mode": True, "rollout_is": "token"}, "rollout_is"),
])
def test_gmpo_bad_bounds_raise_naming_the_field(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RolloutCorrectionConfig.from_dict({"loss_type": "gmpo", **fields})
    if name.startswith("gmpo"):
        with pytest.raises(ValueError, match="gmpo_ratio"):
            PolicyLossConfig(loss_type="gmpo", gmpo_ratio_low=float(fields.get("gmpo_ratio_low", 0.5)),  # type: ignore[arg-type]
                             gmpo_ratio_high=float(fields.get("gmpo_ratio_high", 1.5)))  # type: ignore[arg-type]


# ---- M2PO ---------------------------------------------------------------------------------------


def areal_get_m2po_loss_mask(sorted_m2: Tensor, m2_threshold: float) -> Tensor:
    """AReaL's `_get_m2po_loss_mask`, transcribed (descending sorted second moments -> keep flags)."""
    n = sorted_m2.numel()
    if n == 0:
        return torch.ones_like(sorted_m2, dtype=torch.bool)
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below_threshold_indices = torch.where(avg_m2_suffix < m2_threshold)[0]
    num_to_mask = int(below_threshold_indices[0].item()) if len(below_threshold_indices) > 0 else n - 1
    loss_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        loss_mask[:num_to_mask] = False
    return loss_mask


def areal_apply_m2po_masking(old_logp: Tensor, prox_logp: Tensor, loss_mask: Tensor, m2_threshold: float) -> Tensor:
    """AReaL's `_apply_m2po_masking`, transcribed: old_logp is the behaviour (rollout) policy, prox_logp pi_old."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    m2_selected_mask = areal_get_m2po_loss_mask(sorted_m2, m2_threshold)[restored_indices]
    m2_full_flat = torch.zeros_like(mask_flat, dtype=torch.bool)
    m2_full_flat[mask_flat] = m2_selected_mask
    return m2_full_flat.view_as(loss_mask)


def areal_m2po_loss(logprobs: Tensor, prox: Tensor, behav: Tensor, adv: Tensor, mask: Tensor, threshold: float,
                    eps: float = 0.2) -> Tensor:
    """The M2PO objective of AReaL's doc: the PPO clip against pi_prox over the M2PO-masked tokens, / their count."""
    keep = areal_apply_m2po_masking(behav, prox, mask, threshold)
    ratio = torch.exp(logprobs - prox)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    return torch.where(keep, loss, 0.0).sum() / keep.sum()


@pytest.mark.parametrize("threshold", [0.04, 0.2, 1.0, 1e-4, 100.0])
def test_m2po_matches_areal(threshold: float) -> None:
    """Same keep mask as AReaL's M2PO on one batch (AReaL masks per microbatch, we per step: one batch here),
    and the same PPO loss and gradient over it; the thresholds cover nothing masked (100), the usual case, and
    AReaL's fallback where not even the smallest token is below the bound (1e-4: one token kept)."""
    d = _inputs(3)
    behav = d["old"] + 0.3 * torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    old32, behav32 = d["old"].float(), behav.float()  # our log-ratios are float32 (section 1); compare on those
    ref_keep = areal_apply_m2po_masking(behav32, old32, d["mask"], threshold)  # float32, as AReaL's logprobs
    cfg = RolloutCorrectionConfig(m2po_threshold=threshold, rollout_token_veto_threshold=None)
    out = compute_rollout_correction(old32, behav32, d["mask"], cfg)
    assert torch.equal(out.keep_mask, ref_keep)
    if threshold == 1e-4:
        assert int(ref_keep.sum()) == 1
    ref = _grad(lambda lp: areal_m2po_loss(lp, old32.double(), behav32.double(), d["advantages"], d["mask"],
                                           threshold), d["logprobs"])
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, behav32.double(), d["advantages"], d["mask"], cfg,
                                                          old_logprobs=old32.double()).loss, d["logprobs"])
    assert ours[0] == pytest.approx(ref[0], abs=1e-12)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-12, rtol=0)
    m = out.metrics
    kept_m2 = (old32 - behav32).double().square()[ref_keep]
    assert m["rollout_corr/m2po_second_moment_kept"] == pytest.approx(float(kept_m2.mean()), rel=1e-12)
    assert m["rollout_corr/m2po_masked_fraction"] == pytest.approx(1 - float(ref_keep.sum() / d["mask"].sum()))
    if threshold != 1e-4:
        assert m["rollout_corr/m2po_second_moment_kept"] < threshold


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "0.04"])
def test_m2po_bad_threshold_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="m2po_threshold"):
        RolloutCorrectionConfig.from_dict({"m2po_threshold": value})
    with pytest.raises(ValueError, match="m2po_threshold"):
        RolloutCorrectionConfig.from_dict({"m2po_threshold": 0.04, "old_logprob_source": "loglinear"})


# ---- VESPO --------------------------------------------------------------------------------------


def trl_get_gamma_weights(advantages: Tensor, log_ratio_per_token: Tensor, mask: Tensor,
                          importance_sampling_ratio: Tensor | None, k_pos: float, lambda_pos: float, k_neg: float,
                          lambda_neg: float) -> Tensor:
    """TRL's `GRPOTrainer.get_gamma_weights`, transcribed (under no_grad there; detached here). advantages: [B, 1]."""
    with torch.no_grad():
        lower_clamp = math.log(1e-8)
        log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
        seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
        if importance_sampling_ratio is not None:
            log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
            seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
        lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_vespo_loss(per_token_logps: Tensor, old: Tensor, sampling: Tensor | None, advantages: Tensor, mask: Tensor,
                   cap: float, params: tuple[float, float, float, float]) -> Tensor:
    """TRL's `vespo` loss: token_truncate IS ratio exp((old - sampling) * mask) clamped at `cap` folded into the
    sequence weight, -phi * A * logp per token, summed over the mask / the global token count."""
    ratio = None if sampling is None else torch.clamp(torch.exp((old - sampling) * mask), max=cap)
    phi = trl_get_gamma_weights(advantages[:, None], per_token_logps - old, mask, ratio, *params)
    per_token_loss = -phi * advantages[:, None] * per_token_logps
    return (per_token_loss * mask).sum() / mask.sum()


@pytest.mark.parametrize("params", [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 6.0)])
@pytest.mark.parametrize("mode", ["decoupled_tis", "bypass"])
def test_vespo_matches_trl(params: tuple[float, float, float, float], mode: str) -> None:
    """Loss and gradient of TRL's VESPO (token-mean over the global token count), decoupled with the token-TIS
    ratio folded into the sequence weight (TRL's default token_truncate at 3), and anchored on the rollout."""
    d = _inputs(4)
    scale = torch.tensor([0.05, 0.2, 0.4, 0.1], dtype=torch.float64)[:, None]  # sequence weights across phi's range
    noise = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    old = d["logprobs"] + scale * noise
    rollout = old + 0.2 * torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    adv = d["advantages"][:, 0]
    mask = d["mask"].double()
    k_pos, lambda_pos, k_neg, lambda_neg = params
    fields = {"loss_type": "vespo", "vespo_k_pos": k_pos, "vespo_lambda_pos": lambda_pos, "vespo_k_neg": k_neg,
              "vespo_lambda_neg": lambda_neg, "rollout_token_veto_threshold": None}
    if mode == "bypass":
        ref = _grad(lambda lp: trl_vespo_loss(lp, rollout, None, adv, mask, 3.0, params), d["logprobs"])
        cfg = RolloutCorrectionConfig.from_dict({**fields, "bypass_mode": True})
        atol = 1e-12
    else:
        ref = _grad(lambda lp: trl_vespo_loss(lp, old, rollout, adv, mask, 3.0, params), d["logprobs"])
        cfg = RolloutCorrectionConfig.from_dict({**fields, "rollout_is": "token", "rollout_is_threshold": 3.0})
        atol = 1e-6  # our IS weights are float32
    ours = _grad(lambda lp: rollout_corrected_policy_loss(lp, rollout, adv, d["mask"], cfg, old_logprobs=old).loss,
                 d["logprobs"])
    assert ours[0] == pytest.approx(ref[0], abs=atol)
    torch.testing.assert_close(ours[1], ref[1], atol=atol, rtol=0)
    phi = vespo_loss(d["logprobs"], old, d["advantages"], d["mask"], k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                     lambda_neg=lambda_neg).stats["vespo_phi_sum"] / d["mask"].sum()
    assert float(phi) > 0.0 and abs(float(phi) - 1.0) > 1e-3  # the kernel is active on these inputs


def test_vespo_presets_and_kernel_shape() -> None:
    assert RolloutCorrectionConfig.from_preset("vespo").rollout_is_threshold == 3.0
    assert RolloutCorrectionConfig.from_preset("bypass_vespo").bypass_mode
    # phi(1) = 1 whatever (k, lambda): an on-policy sequence keeps the plain policy gradient.
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    out = vespo_loss(lp, lp, torch.tensor([[1.5, 1.5]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out.per_token_loss, -1.5 * lp)


@pytest.mark.parametrize(("fields", "name"), [
    ({"vespo_k_pos": -1.0}, "vespo_k_pos"),
    ({"vespo_k_neg": float("nan")}, "vespo_k_neg"),
    ({"vespo_lambda_pos": 0.0}, "vespo_lambda_pos"),
    ({"vespo_lambda_neg": float("inf")}, "vespo_lambda_neg"),
    ({"bypass_mode": True, "rollout_is": "token"}, "rollout_is"),
])
def test_vespo_bad_parameters_raise_naming_the_field(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RolloutCorrectionConfig.from_dict({"loss_type": "vespo", **fields})
    if name.startswith("vespo"):
        with pytest.raises(ValueError, match=name):
            PolicyLossConfig(loss_type="vespo", **fields)  # type: ignore[arg-type]

"""RolloutCorrectionConfig: validation messages, presets, aliases, verl defaults, input checks."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.config import IS_LEVELS, IS_MODES, NONFINITE_POLICIES, RS_OPTIONS

C = RolloutCorrectionConfig

# ---- presets ---------------------------------------------------------------------------------

SEED_NAMES = ["token_is", "token_tis", "seq_is", "seq_is_rs", "seq_mis", "geo_rs", "geo_mis", "ppo_is_bypass",
              "pure_is", "disabled"]
VERL_NAMES = [
    "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs", "decoupled_k3_rs",
    "decoupled_token_icepop", "bypass_ppo_clip", "bypass_pg_is", "bypass_ppo_clip_geo_rs", "bypass_pg_geo_rs",
]
ALIASES = {
    "token_is": "decoupled_token_is",
    "token_tis": "decoupled_token_is",
    "seq_is": "decoupled_seq_is",
    "seq_is_rs": "decoupled_seq_is_rs",
    "ppo_is_bypass": "bypass_ppo_clip",
    "pure_is": "bypass_pg_is",
    "geo_rs": "decoupled_geo_rs",
}


def test_preset_names_cover_seed_and_verl_names_and_are_sorted() -> None:
    names = C.preset_names()
    assert names == sorted(names)
    assert len(names) == len(set(names))
    for name in SEED_NAMES + VERL_NAMES:
        assert name in names


@pytest.mark.parametrize("name", C.preset_names())
def test_every_preset_builds_and_runs_on_random_data(name: str) -> None:
    cfg = C.from_preset(name)
    assert isinstance(cfg, C)
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 9, generator=gen) * 3
    old = rollout + 0.05 * torch.randn(4, 9, generator=gen)
    mask = torch.rand(4, 9, generator=gen) > 0.2
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])  # ignored by presets that do not mask by advantage
    out = compute_rollout_correction(old, rollout, mask, cfg, advantages=advantages)
    assert out.is_weights.shape == (4, 9) and out.is_weights.dtype == torch.float32
    assert out.keep_mask.dtype == torch.bool
    assert not (out.keep_mask & ~mask).any()
    assert torch.isfinite(out.is_weights).all()
    assert (out.is_weights[~out.keep_mask] == 0).all()
    assert all(k.startswith("rollout_corr/") and _defined(k, v) for k, v in out.metrics.items())


@pytest.mark.parametrize(("alias", "target"), sorted(ALIASES.items()))
def test_aliases_equal_their_targets(alias: str, target: str) -> None:
    assert C.from_preset(alias) == C.from_preset(target)
    assert C.from_preset(alias).to_dict() == C.from_preset(target).to_dict()


def test_verl_default_thresholds() -> None:
    token = C.from_preset("decoupled_token_is")
    assert (token.rollout_is, token.rollout_is_mode, token.rollout_is_threshold) == ("token", "truncate", 2.0)
    assert token.is_lower == pytest.approx(0.5)
    seq = C.from_preset("decoupled_seq_is")
    assert (seq.rollout_is, seq.rollout_is_threshold) == ("sequence", 2.0)

    geo = C.from_preset("decoupled_geo_rs")
    assert geo.rollout_is is None
    (crit,) = geo.rejection_criteria
    assert (crit.name, crit.lower, crit.upper) == ("seq_mean_k1", 0.999, 1.001)

    k3 = C.from_preset("decoupled_k3_rs")
    (crit,) = k3.rejection_criteria
    assert (crit.name, crit.statistic, crit.upper, crit.lower) == ("seq_mean_k3", "k3", 0.01, None)

    seq_rs = C.from_preset("decoupled_seq_is_rs")
    (crit,) = seq_rs.rejection_criteria
    assert (crit.name, crit.lower, crit.upper) == ("seq_sum_k1", 0.5, 2.0)
    assert seq_rs.rollout_is == "sequence" and seq_rs.rollout_is_threshold == 2.0

    icepop = C.from_preset("decoupled_token_icepop")
    assert (icepop.rollout_is, icepop.rollout_is_mode) == ("token", "mask")
    assert (icepop.is_lower, icepop.rollout_is_threshold) == (0.5, 5.0)

    bypass = C.from_preset("bypass_ppo_clip")
    assert bypass.bypass_mode and bypass.loss_type == "ppo_clip" and not bypass.pure_is
    pure = C.from_preset("pure_is")
    assert pure.bypass_mode and pure.loss_type == "reinforce" and pure.pure_is

    disabled = C.from_preset("disabled")
    assert disabled.rollout_is is None and disabled.rejection_criteria == ()
    assert not disabled.bypass_mode and not disabled.rollout_is_batch_normalize

    seq_mis = C.from_preset("seq_mis")
    assert (seq_mis.rollout_is, seq_mis.rollout_is_mode, seq_mis.rollout_is_threshold) == ("sequence", "mask", 2.0)
    assert C.from_preset("geo_rs").rollout_token_veto_threshold == 1e-4


def test_overrides_apply_on_top_of_presets() -> None:
    cfg = C.from_preset("token_tis", rollout_is_threshold=3.0)
    assert cfg.rollout_is == "token" and cfg.rollout_is_threshold == 3.0
    assert cfg.is_lower == pytest.approx(1 / 3)
    # overriding a preset's field with None turns the feature off
    assert C.from_preset("decoupled_geo_rs", rollout_rs=None, rollout_rs_threshold=None).rejection_criteria == ()


def test_to_dict_round_trips() -> None:
    for name in C.preset_names():
        cfg = C.from_preset(name)
        assert C.from_dict(cfg.to_dict()) == cfg
    assert set(C().to_dict()) == set(C.field_names())
    assert "_criteria" not in C.field_names()


def test_config_is_frozen() -> None:
    cfg = C()
    with pytest.raises(AttributeError):
        cfg.rollout_is = "token"  # type: ignore[misc]


# ---- validation ------------------------------------------------------------------------------


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="nope") as info:
        C.from_preset("nope")
    message = str(info.value)
    for name in ("token_tis", "decoupled_token_is", "bypass_pg_is", "geo_mis"):
        assert name in message


def test_unknown_override_field_suggests_close_match() -> None:
    with pytest.raises(ValueError, match="rollout_is_treshold") as info:
        C.from_preset("token_tis", rollout_is_treshold=3.0)
    assert "did you mean 'rollout_is_threshold'" in str(info.value)
    with pytest.raises(ValueError, match="unknown rollout-correction field 'zzz'"):
        C.from_dict({"zzz": 1})


def _raises_naming(fragments: list[str], **fields: object) -> None:
    with pytest.raises(ValueError) as info:
        C(**fields)  # type: ignore[arg-type]
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_rollout_rs_without_threshold() -> None:
    _raises_naming(["rollout_rs_threshold", "seq_mean_k1"], rollout_rs="seq_mean_k1")


def test_is_lower_above_upper() -> None:
    _raises_naming(["rollout_is_threshold_lower", "rollout_is_threshold"], rollout_is="token",
                   rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0)


def test_k1_rs_lower_above_upper() -> None:
    _raises_naming(["token_k1", "lower", "upper"], rollout_rs="token_k1", rollout_rs_threshold="1.5_0.9")
    _raises_naming(["seq_mean_k1", "lower"], rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5")


@pytest.mark.parametrize(
    "fields",
    [
        {"rollout_is_threshold": 0.0},
        {"rollout_is_threshold": -1.0},
        {"rollout_is_threshold": math.inf},
        {"rollout_is_threshold": math.nan},
        {"rollout_is_threshold_lower": 0.0},
        {"rollout_token_veto_threshold": 0.0},
        {"rollout_token_veto_threshold": -1e-4},
        {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.0},
        {"rollout_rs": "token_k1", "rollout_rs_threshold": "0_2"},
        {"rollout_rs": "token_k1", "rollout_rs_threshold": "-0.5_2"},
    ],
)
def test_non_positive_bounds(fields: dict[str, object]) -> None:
    name = next(iter(fields)) if "rollout_rs" not in fields else "rollout_rs_threshold"
    _raises_naming([name, "> 0"], **fields)


def test_bool_threshold_rejected() -> None:
    _raises_naming(["rollout_is_threshold"], rollout_is_threshold=True)


def test_bad_choices_list_allowed_values() -> None:
    _raises_naming(["rollout_is", *IS_LEVELS, "'tok'"], rollout_is="tok")
    _raises_naming(["rollout_is_mode", *IS_MODES], rollout_is_mode="clip")
    _raises_naming(["nonfinite_policy", *NONFINITE_POLICIES], nonfinite_policy="ignore")
    _raises_naming(["loss_type", "ppo_clip", "reinforce"], loss_type="gspo")
    _raises_naming(["rollout_rs", "token_k4", "seq_mean_k3"], rollout_rs="token_k4", rollout_rs_threshold=1.0)
    # k1 has no seq_max
    _raises_naming(["seq_max_k1", "seq_max_k2"], rollout_rs="seq_max_k1", rollout_rs_threshold=1.0)
    _raises_naming(["rollout_rs"], rollout_rs=" , ", rollout_rs_threshold=1.0)


def test_bool_fields_must_be_bool() -> None:
    _raises_naming(["metrics_only"], metrics_only="yes")
    _raises_naming(["bypass_mode"], bypass_mode=1)


def test_batch_normalize_needs_is_level() -> None:
    _raises_naming(["rollout_is_batch_normalize", "rollout_is", *IS_LEVELS], rollout_is_batch_normalize=True)


def test_nonfinite_max_fraction_range() -> None:
    _raises_naming(["nonfinite_max_fraction"], nonfinite_max_fraction=1.5)
    _raises_naming(["nonfinite_max_fraction"], nonfinite_max_fraction=-0.1)
    assert C(nonfinite_max_fraction=0.0).nonfinite_max_fraction == 0.0


def test_threshold_count_must_match_criteria() -> None:
    _raises_naming(["2 entries", "3 criteria"], rollout_rs="token_k1,seq_mean_k3,seq_max_k2",
                   rollout_rs_threshold="2.0,0.01")
    _raises_naming(["k3", "single upper bound"], rollout_rs="token_k3", rollout_rs_threshold="0.1_0.2")
    _raises_naming(["token_k1", "'upper' or 'lower_upper'"], rollout_rs="token_k1",
                   rollout_rs_threshold="0.1_0.2_0.3")
    _raises_naming(["not a number"], rollout_rs="token_k1", rollout_rs_threshold="abc")
    _raises_naming(["rollout_rs_threshold"], rollout_rs="token_k1", rollout_rs_threshold=[2.0])


def test_rs_parsing_shared_and_per_criterion() -> None:
    shared = C(rollout_rs="token_k2, seq_max_k3", rollout_rs_threshold=0.5).rejection_criteria
    assert [(c.name, c.granularity, c.statistic, c.upper, c.lower) for c in shared] == [
        ("token_k2", "token", "k2", 0.5, None),
        ("seq_max_k3", "seq_max", "k3", 0.5, None),
    ]
    per = C(rollout_rs="seq_sum_k1,token_k3,seq_sum_k1", rollout_rs_threshold="0.9_1.5,0.02").rejection_criteria
    # duplicates removed (the duplicate does not count against the threshold list)
    assert [(c.name, c.lower, c.upper) for c in per] == [("seq_sum_k1", 0.9, 1.5), ("token_k3", None, 0.02)]
    single = C(rollout_rs="token_k1", rollout_rs_threshold=4.0).rejection_criteria[0]
    assert single.lower == pytest.approx(0.25) and single.upper == 4.0
    assert single.is_token_level
    assert set(RS_OPTIONS) >= {c.name for c in per}


def test_is_lower_default_and_explicit() -> None:
    assert C(rollout_is_threshold=4.0).is_lower == 0.25
    assert C(rollout_is_threshold=4.0, rollout_is_threshold_lower=0.1).is_lower == 0.1


def test_implicit_lower_above_upper_raises() -> None:
    # a single upper bound below 1 implies lower = 1/upper > upper: an empty interval
    for mode in ("mask", "truncate"):
        _raises_naming(["1/rollout_is_threshold", ">= 1"], rollout_is="token", rollout_is_mode=mode,
                       rollout_is_threshold=0.5)


@pytest.mark.parametrize("value", [1.0, 1.5])
def test_veto_threshold_must_be_below_one(value: float) -> None:
    _raises_naming(["rollout_token_veto_threshold", "(0, 1)"], rollout_token_veto_threshold=value)


def test_bypass_ppo_clip_takes_no_is_weights() -> None:
    _raises_naming(["rollout_is", "bypass_mode", "ppo_clip", "reinforce"], bypass_mode=True, loss_type="ppo_clip",
                   rollout_is="token")
    assert C(bypass_mode=True, loss_type="reinforce", rollout_is="token").pure_is


def test_reinforce_needs_bypass() -> None:
    _raises_naming(["reinforce", "bypass_mode"], loss_type="reinforce")


# ---- input validation ------------------------------------------------------------------------


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("which", "bad", "fragment"),
    [
        (0, torch.zeros(2, 4), "shape mismatch"),
        (1, torch.zeros(3, 3), "shape mismatch"),
        (2, torch.ones(2, 2, dtype=torch.bool), "shape mismatch"),
        (0, torch.zeros(6), "2-D"),
        (1, torch.zeros(1, 2, 3), "2-D"),
        (2, torch.ones(6, dtype=torch.bool), "2-D"),
        (0, torch.zeros(2, 3, dtype=torch.int64), "floating-point"),
        (1, torch.zeros(2, 3, dtype=torch.bool), "floating-point"),
        (1, torch.zeros(2, 3, dtype=torch.float64), "dtype mismatch"),
        (2, torch.ones(2, 3, dtype=torch.complex64), "loss_mask"),
        (0, [[0.0, 0.0, 0.0]], "torch.Tensor"),
    ],
)
def test_bad_inputs_raise(which: int, bad: object, fragment: str) -> None:
    args: list[object] = list(_inputs())
    args[which] = bad
    with pytest.raises(ValueError, match=fragment):
        compute_rollout_correction(*args, C(rollout_is="token"))  # type: ignore[arg-type]


def test_mask_dtypes_accepted() -> None:
    old, rollout, mask = _inputs()
    reference = compute_rollout_correction(old, rollout, mask, C(rollout_is="token"))
    for as_dtype in (torch.int64, torch.float32, torch.uint8):
        out = compute_rollout_correction(old, rollout, mask.to(as_dtype), C(rollout_is="token"))
        assert torch.equal(out.keep_mask, reference.keep_mask)
        assert torch.equal(out.is_weights, reference.is_weights)


def test_lower_precision_inputs_computed_in_fp32() -> None:
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    rollout = torch.tensor([[-1.5, -2.0]], dtype=torch.bfloat16)
    out = compute_rollout_correction(old, rollout, torch.ones(1, 2, dtype=torch.bool), C(rollout_is="token"))
    assert out.is_weights.dtype == torch.float32
    assert out.is_weights[0, 0].item() == pytest.approx(math.exp(0.5), rel=1e-6)


def _defined(key: str, value: float) -> bool:
    """A finite metric, or NaN for prob_pearson where Pearson's r is undefined (docs/metrics.md)."""
    return math.isfinite(value) or (key.endswith("prob_pearson") and math.isnan(value))

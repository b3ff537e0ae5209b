"""Every metric key the code can emit is documented in docs/metrics.md (docs match the code)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from default_lane import require

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.config import RS_OPTIONS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()

# Configs that together reach every branch of finalize_metrics.
CONFIGS = [
    RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_batch_normalize=True,
                            rollout_rs=",".join(RS_OPTIONS), rollout_rs_threshold="2.0"),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True),
    RolloutCorrectionConfig(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.01),
    RolloutCorrectionConfig(rollout_token_veto_threshold=None),
    RolloutCorrectionConfig(opsm_threshold=0.0, kpop_threshold=0.1, dppo_tv_threshold=0.1,
                            seq_logprob_error_threshold=1.05),
]


def _emitted_keys() -> set[str]:
    torch.manual_seed(0)
    rollout = -torch.rand(4, 8) * 3
    old = rollout + 0.1 * torch.randn(4, 8)
    mask = torch.ones(4, 8, dtype=torch.bool)
    keys: set[str] = set()
    for cfg in CONFIGS:
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        keys |= set(compute_rollout_correction(old, rollout, mask, cfg, advantages=advantages).metrics)
    return keys


def _documented(name: str) -> bool:
    criterion = re.match(r"rollout_rs_((?:token|seq_sum|seq_mean|seq_max)_k[123])(_.+)$", name)
    if criterion:  # per-criterion keys are documented by suffix in the rollout_rs_<c>_<suffix> table
        return f"| `{criterion.group(2)}` |" in DOC
    quantile = re.match(r"(.+_)p\d+$", name)
    if quantile:  # quantiles are documented as a family (p1 ... p99)
        return f"`{name}`" in DOC or f"`{quantile.group(1)}p1`" in DOC
    return f"`{name}`" in DOC


def test_every_emitted_metric_is_documented() -> None:
    keys = _emitted_keys()
    assert len(keys) > 100  # the configs above really reach the per-criterion and IS branches
    undocumented = sorted(k for k in keys if not _documented(k.removeprefix("rollout_corr/")))
    assert undocumented == [], f"add these to docs/metrics.md: {undocumented}"


def test_the_check_would_catch_a_missing_key() -> None:
    assert not _documented("made_up_metric_name")
    assert not _documented("rollout_rs_token_k1_made_up_suffix")


# ---- the trainer's own keys (`nrc train`: metrics.jsonl and MLflow) ----------------------------------------------

def _trainer_keys() -> set[str]:
    """Every key one `nrc train` step can emit besides `rollout_corr/*`, from the code that emits it: the step
    report (with two epochs, a loglinear check and two engines), async staleness, DAPO's refills, penalty and
    filter, routing replay and evaluation (greedy and pass@k)."""
    require("megatron.core", "megatron")
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.harness import metric_names
    from nemo_rollout_correction.harness.routing_replay import ROUTER_AGREEMENT
    from nemo_rollout_correction.losses.step_plan import StepPlan, StepResult
    from nemo_rollout_correction.models.optimizer import UpdateResult
    from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
    from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
    from nemo_rollout_correction.trainer.async_rollouts import staleness_metrics
    from nemo_rollout_correction.trainer.dynamic_sampling import (
        DapoOptions,
        apply_overlong_filter,
        collect_step_rollouts,
    )
    from nemo_rollout_correction.trainer.evaluation import summarize
    from nemo_rollout_correction.trainer.observer import NullObserver
    from nemo_rollout_correction.trainer.policy_update import Update
    from nemo_rollout_correction.trainer.step_report import StepReport, StepTimer

    def batch_of(records: list[PromptRecord], n: int = 2) -> RolloutBatch:
        samples = [RolloutSample(prompt_index=i, prompt_token_ids=[1], token_ids=[2] * (3 + s),
                                 logprobs=[-1.0] * (3 + s), finish_reason="length" if s else "stop",
                                 turn_ids=[0, -1] + [1] * (1 + s) if i else None)  # multi-turn and single-turn
                   for i in range(len(records)) for s in range(n)]
        return RolloutBatch(samples, n=n, seconds=1.0)

    records = [PromptRecord(prompt=f"p{i}") for i in range(8)]
    sums = {"loss": 0.1, "kl_penalty": 0.0, "num_tokens": 8.0, "pg_clipfrac_sum": 1.0, "pg_clipfrac_lower_sum": 0.0,
            "ppo_kl_sum": 0.01, "loglinear_num_tokens": 8.0, "loglinear_abs_error_sum": 0.1,
            "loglinear_sq_error_sum": 0.01, "turn_0/num_tokens": 4.0, "turn_0/sum_k3": 0.01,
            "turn_0/sum_abs_log_ratio": 0.1, "turn_1/num_tokens": 0.0, "turn_1/sum_k3": 0.0,
            "turn_1/sum_abs_log_ratio": 0.0, "lag_0/num_tokens": 4.0, "lag_0/sum_k3": 0.0,
            "lag_0/sum_abs_log_ratio": 0.0, "lag_1/num_tokens": 4.0, "lag_1/sum_k3": 0.01,
            "lag_1/sum_abs_log_ratio": 0.1}
    update = Update(plan=StepPlan("rollout_only", None, None, {}), result=StepResult(sums, {}),
                    applied=UpdateResult(grad_norm=1.0, lr=1e-3, loss_scale=1.0, skipped=False))
    timer = StepTimer()
    timer.record({"rollout_wait": 0.5})
    for phase in ("refit", "step"):
        with timer.phase(phase):
            pass
    report = StepReport(ParallelGroups.single(), NullObserver(), Path("unused.jsonl"), is_main=False, ppo_epochs=2,
                        num_engines=2)
    keys = set(report.metrics(batch_of(records[:2]), torch.tensor([0.0, 1.0, 0.5, 0.5]), [update, update],
                              timer.seconds, engine_refit_seconds=(0.1, 0.2)))
    keys |= set(staleness_metrics([0, 1], 1, 2))
    sampler = PromptSampler(records, prompts_per_step=2, seed=0, shuffle=False)
    calls = iter(range(100))

    def generate(prompts: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
        varied = next(calls) > 0  # the first batch has no reward variance: a refill follows
        return batch_of(prompts), [float(varied and s % 2) for s in range(2 * len(prompts))]

    options = DapoOptions(dynamic_sampling=True, max_refill_batches=2, overlong_penalty=True, overlong_filter=True,
                          overlong_buffer_len=2, max_new_tokens=4)
    rollouts = collect_step_rollouts(sampler.next_batch(), sampler, generate, options)
    keys |= set(rollouts.metrics)
    keys |= set(apply_overlong_filter(rollouts.batch.to_tensors(0)["loss_mask"], rollouts.batch, options)[1])
    keys |= {ROUTER_AGREEMENT}
    keys |= set(summarize([0.0, 1.0, 1.0, 1.0], [3, 4, 3, 4], [False, True, False, True], num_prompts=2,
                          num_samples=2, success_threshold=0.5))
    keys |= metric_names.KNOWN  # incl. the greedy evaluation's keys, which need an engine to be reached
    return keys


def _trainer_key_documented(key: str) -> bool:
    family = re.match(r"(rollout/engine|loss/pg_clipfrac_epoch|eval/pass_at_|rollout_corr/turn_|rollout_corr/lag_)\d+"
                      r"(_refit_s|/\w+)?$", key)
    if family:  # numbered families are documented by their first member
        first = "0" if family.group(1) in ("rollout/engine", "rollout_corr/turn_", "rollout_corr/lag_") else "1"
        return f"`{family.group(1)}{first}{family.group(2) or ''}`" in TRAINER_DOC
    return f"`{key}`" in TRAINER_DOC


TRAINER_DOC = DOC[DOC.index("## The trainer's own keys"):]


def test_every_trainer_metric_is_documented() -> None:
    keys = _trainer_keys()
    assert {"response/length_max", "perf/num_samples", "loss/pg_clipfrac_lower", "timing/rollout_wait_s",
            "loss/pg_clipfrac_epoch2", "rollout/engine1_refit_s", "grpo/refill_batches",
            "grpo/overlong_filtered_fraction", "eval/pass_at_2"} <= keys  # the sources above really emit
    undocumented = sorted(k for k in keys if not k.startswith("rollout_corr/") and not _trainer_key_documented(k))
    assert undocumented == [], f"add these to docs/metrics.md, 'The trainer's own keys': {undocumented}"
    correction = {k for k in keys if k.startswith("rollout_corr/")}  # the trainer's loglinear check, names it reads
    assert {"rollout_corr/loglinear_abs_error_mean", "rollout_corr/loglinear_rmse"} <= correction
    assert "rollout_corr/turn_1/k3_kl" in correction  # the mismatch by turn (multi-turn)
    assert "rollout_corr/lag_1/k3_kl" in correction  # the mismatch by token staleness (async / partial rollouts)
    assert "rollout/token_staleness_max" in keys
    assert [k for k in correction if not (f"`{k}`" in DOC or _documented(k.removeprefix("rollout_corr/"))
                                          or _trainer_key_documented(k))] == []


def test_the_trainer_check_would_catch_a_missing_key() -> None:
    assert not _trainer_key_documented("loss/made_up")
    assert not _trainer_key_documented("rollout/engine0_made_up_s")

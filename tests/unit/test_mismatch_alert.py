"""The mismatch alarm (trainer/mismatch_alert.py): thresholds, floors, what a firing step does, strict mode."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from lag_metrics import lagged

from nemo_rollout_correction.config import ConfigError, load_config
from nemo_rollout_correction.config.mismatch_alert import MismatchAlertConfig
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.trainer.mismatch_alert import (
    ALERT_METRIC,
    FLOORS,
    MismatchAlarm,
    MismatchAlarmError,
    watched_values,
)
from nemo_rollout_correction.trainer.step_report import StepReport

HEALTHY = {"rollout_corr/k3_kl": 1e-11, "rollout_corr/kl": -2e-9, "rollout_corr/token_log_ratio_max": 3e-6,
           "rollout_corr/token_log_ratio_min": -4e-6}
STALE = {"rollout_corr/k3_kl": 2e-3, "rollout_corr/kl": 1.9e-3, "rollout_corr/token_log_ratio_max": 0.2,
         "rollout_corr/token_log_ratio_min": -0.9}


def alarm(log: list[str] | None = None, **kwargs: Any) -> MismatchAlarm:
    sink = log if log is not None else []
    return MismatchAlarm(MismatchAlertConfig(**kwargs), engine_dtype="float32", trainer_dtype="float32",
                         family="dense", log=sink.append)


class TagObserver:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.steps: list[dict[str, float]] = []

    def wants_review(self, step: int) -> bool:
        return False

    def on_step(self, step: int, metrics: dict[str, float], review: Any) -> None:
        self.steps.append(dict(metrics))

    def on_alert(self, step: int, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def test_watched_values_take_the_larger_side_of_the_token_log_ratio() -> None:
    assert watched_values(STALE) == {"k3_kl": 2e-3, "kl": 1.9e-3, "max_abs_log_ratio": 0.9}
    assert watched_values({"reward/mean": 1.0}) == {}  # a skipped update has no rollout_corr metrics


def test_absolute_thresholds_fire_above_and_not_at_or_below() -> None:
    a = alarm(k3_kl=1e-3, max_abs_log_ratio=0.5)
    assert a.check(1, HEALTHY) == []
    fired = a.check(2, STALE)
    assert [(x.name, x.value, x.threshold, x.floor) for x in fired] == [("k3_kl", 2e-3, 1e-3, None),
                                                                        ("max_abs_log_ratio", 0.9, 0.5, None)]
    assert a.check(3, {**STALE, "rollout_corr/k3_kl": 1e-3}) != [] and all(
        x.name != "k3_kl" for x in a.check(3, {**STALE, "rollout_corr/k3_kl": 1e-3}))
    assert "rollout_corr/k3_kl = 2.000e-03 > 1.000e-03 (absolute threshold)" in fired[0].message()


def test_factor_over_floor_uses_the_settings_builtin_floor_or_the_users() -> None:
    floor = FLOORS[("float32", "float32", "dense")]
    a = alarm(factor_over_floor=10.0)
    assert a.thresholds["k3_kl"] == (10.0 * floor["k3_kl"], floor["k3_kl"])
    assert "kl" not in a.thresholds  # k1 has no floor (it can be negative): absolute thresholds only
    fired = a.check(4, STALE)
    assert {x.name for x in fired} == {"k3_kl", "max_abs_log_ratio"}
    assert "10 x floor" in fired[0].message() and "engine float32 / trainer float32 / dense" in fired[0].message()
    own = alarm(factor_over_floor=10.0, floor_k3_kl=1e-3, floor_max_abs_log_ratio=1.0)
    assert own.check(4, STALE) == []  # 2e-3 < 10 x 1e-3; 0.9 < 10 x 1.0
    both = alarm(factor_over_floor=10.0, floor_k3_kl=1e-3, k3_kl=1e-4)
    assert both.thresholds["k3_kl"] == (1e-4, None)  # the lower of the two wins


def test_unmeasured_setting_needs_a_floor_of_the_users() -> None:
    with pytest.raises(ValueError, match="no floor is known for engine float16 / trainer float16 / dense"):
        MismatchAlarm(MismatchAlertConfig(factor_over_floor=5.0), engine_dtype="float16", trainer_dtype="float16",
                      family="dense", log=print)
    a = MismatchAlarm(MismatchAlertConfig(factor_over_floor=5.0, floor_k3_kl=1e-5), engine_dtype="float16",
                      trainer_dtype="float16", family="dense", log=print)
    assert a.thresholds == {"k3_kl": (5e-5, 1e-5)}


def test_nan_never_fires_and_inf_does() -> None:
    a = alarm(k3_kl=1e-3, kl=1e-3)
    assert a.check(1, {"rollout_corr/k3_kl": math.nan, "rollout_corr/kl": math.nan}) == []
    assert [x.name for x in a.check(1, {"rollout_corr/k3_kl": math.inf})] == ["k3_kl"]


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout_correction.alert: alert.k3_kl=0.0 is not allowed"):
        load_config(["rollout_correction.alert.k3_kl=0"])
    with pytest.raises(ConfigError, match=r"factor_over_floor=0.5 is not allowed: must be >= 1"):
        load_config(["rollout_correction.alert.factor_over_floor=0.5"])
    cfg = load_config(["model=tiny_llama", "rollout_correction=bypass_ppo_clip",
                       "rollout_correction.alert.factor_over_floor=20", "rollout.routing_replay=r3"])
    built = MismatchAlarm.from_run(cfg, moe=True, log=print)
    assert built is not None and built.setting == f"engine {cfg.rollout.dtype} / trainer float32 / moe_r3"
    assert MismatchAlarm.from_run(load_config([]), moe=False, log=print) is None  # off by default


def report(tmp_path: Path, a: MismatchAlarm | None, observer: Any) -> StepReport:
    return StepReport(ParallelGroups.single(), observer, tmp_path / "metrics.jsonl", is_main=True, ppo_epochs=1,
                      num_engines=1, alarm=a)


def test_a_firing_step_warns_tags_and_counts(tmp_path: Path) -> None:
    log: list[str] = []
    observer = TagObserver()
    r = report(tmp_path, alarm(log, k3_kl=1e-3), observer)
    r.publish(1, dict(HEALTHY), None)
    r.publish(2, dict(STALE), None)
    r.publish(3, dict(STALE), None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row[ALERT_METRIC] for row in rows] == [0.0, 1.0, 1.0]
    assert [s[ALERT_METRIC] for s in observer.steps] == [0.0, 1.0, 1.0]
    assert len(log) == 2 and "WARNING mismatch alert: step 2: rollout_corr/k3_kl = 2.000e-03 > 1.000e-03" in log[0]
    assert observer.tags["nrc.mismatch_alert.first_step"] == "2"
    assert observer.tags["nrc.mismatch_alert.num_steps"] == "2"
    assert observer.tags["nrc.mismatch_alert"].startswith("step 3: rollout_corr/k3_kl")


def test_no_alarm_configured_adds_no_metric(tmp_path: Path) -> None:
    observer = TagObserver()
    report(tmp_path, None, observer).publish(1, dict(STALE), None)
    assert ALERT_METRIC not in observer.steps[0] and observer.tags == {}


def test_strict_stops_after_the_step_is_recorded(tmp_path: Path) -> None:
    observer = TagObserver()
    r = report(tmp_path, alarm(max_abs_log_ratio=0.5, strict=True), observer)
    r.publish(1, dict(HEALTHY), None)  # a healthy step passes
    with pytest.raises(MismatchAlarmError, match=r"strict=true\): step 2: max \|dlogp\|.* = 9.000e-01 > 5.000e-01"):
        r.publish(2, dict(STALE), None)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # the firing step is on record
    assert "nrc.mismatch_alert" in observer.tags


# ---- under async lag (rollout_corr/lag_<L>/* from the trainer's per-token staleness) ------------------------------



def run_steps(a: MismatchAlarm, steps: list[dict[str, float]]) -> list[float]:
    fired = []
    for step, metrics in enumerate(steps, start=1):
        metrics = dict(metrics)
        a.check_step(step, metrics, TagObserver())
        fired.append(metrics[ALERT_METRIC])
    return fired


def test_a_healthy_async_run_with_staleness_1_does_not_fire() -> None:
    """fp32 engine and trainer, k = 1: step 1 trains version 0 on version 0 (floor), every later step trains tokens
    one version old: their k3 is one update's drift (here 1e-2 +- 25%), 10^8 x the fp32 floor. Then the drift of the
    tiny Llama's real run (tests/integration/test_mismatch_alert_async.py: it shrinks as training settles)."""
    drift = [1.0e-2, 1.2e-2, 0.8e-2, 1.1e-2, 1.25e-2, 0.9e-2, 1.0e-2, 1.85e-2, 8.9e-3, 4.3e-3, 3.8e-3, 1.9e-3, 1.7e-3]
    steps = [lagged({0: 1e-13, 1: 0.0}, dlogp=1e-6)] + [lagged({0: 0.0, 1: d}) for d in drift]
    steps[0]["rollout_corr/lag_1/num_tokens"] = 0.0
    log: list[str] = []
    a = alarm(log, factor_over_floor=10)
    assert run_steps(a, steps) == [0.0] * len(steps), log
    assert a.lag_reference == {1: 1.7e-3} and a.lag_reference_step == {1: 14} and a.lag_steps == {1: 13}
    # the on-policy floor rule on the whole step (no per-staleness split) would fire on every lagged step
    assert all(alarm(factor_over_floor=10).check(s, {k: v for k, v in m.items() if "/lag_" not in k})
               for s, m in enumerate(steps[1:], start=2))


def test_a_lost_sync_under_async_fires_once_the_labelled_lag_grows() -> None:
    """The same run whose weight pushes were lost: the tokens labelled one version old are really s - 1 versions
    old at step s, so their k3 climbs (about quadratically with the real lag) past 10 x the lag-1 reference."""
    steps = [lagged({0: 1e-13}, dlogp=1e-6)] + [lagged({1: 1e-2 * (s - 1) ** 2}) for s in range(2, 8)]
    log: list[str] = []
    a = alarm(log, factor_over_floor=10)
    fired = run_steps(a, steps)
    assert fired[:4] == [0.0, 0.0, 0.0, 0.0]  # steps 2-4 only measure; step 4 is checked against 1e-2 (step 2)
    assert fired[4:] == [1.0, 1.0, 1.0]  # step 5: 16e-2 > 10 x 1e-2
    assert "step 5: rollout_corr/lag_1/k3_kl = 1.600e-01 > 1.000e-01 (10 x the run's least lag-1 k3 (step 2) " \
           "1.0e-02" in log[0], log


def test_lagged_steps_hold_fresh_tokens_to_the_floor_and_keep_absolute_thresholds() -> None:
    """Tokens of the trainer's own version (partial rollouts' newest piece, a DAPO refill) carry no drift: a stale
    engine shows there at once. Absolute thresholds still watch the whole step."""
    a = alarm(factor_over_floor=10)
    fired = a.check(2, lagged({0: 5e-3, 1: 1e-2}))
    assert [(x.name, x.threshold, x.floor) for x in fired] == [("lag_0/k3_kl", 1e-9, 1e-10)]
    b = alarm(factor_over_floor=10, k3_kl=5e-2)
    assert [x.name for x in b.check(2, lagged({0: 0.0, 1: 1e-2}, overall=6e-2))] == ["k3_kl"]
    with pytest.raises(ValueError, match="lag_reference_steps=0"):
        MismatchAlertConfig(factor_over_floor=10, lag_reference_steps=0)


def test_the_measured_tiny_llama_lost_push_fires_at_factor_3_and_its_healthy_run_does_not() -> None:
    """The lag-1 k3 of tests/integration/test_mismatch_alert_async.py's two runs (fp32, k = 1), steps 1-7."""
    healthy = [1.85e-2, 8.88e-3, 4.26e-3, 3.84e-3, 1.86e-3, 1.69e-3]
    lost = [1.85e-2, 3.32e-2, 4.52e-2, 4.44e-2, 5.38e-2, 6.30e-2]
    first = lagged({0: 2.9e-14}, dlogp=1e-6)
    assert run_steps(alarm(factor_over_floor=3, lag_reference_steps=2),
                     [first] + [lagged({1: k}) for k in healthy]) == [0.0] * 7
    assert run_steps(alarm(factor_over_floor=3, lag_reference_steps=2),
                     [first] + [lagged({1: k}) for k in lost]) == [0.0] * 6 + [1.0]


def test_int8_rollouts_have_their_own_floors_a_normal_run_stays_quiet_and_a_broken_one_fires() -> None:
    """rollout.quantization=int8: the alarm's setting is `<dtype>+int8` (`MismatchAlarm.from_run`), whose floors
    hold a normal int8 step (SmolLM2's `nrc audit`: k3 0.055, max |dlogp| 8.8) under 5 x floor, while the bf16
    floors would fire on it; a broken engine (k3 of a few nats) fires."""
    cfg = load_config(["rollout.quantization=int8", "rollout_correction.alert.factor_over_floor=5"])
    a = MismatchAlarm.from_run(cfg, moe=False, log=print)
    assert a is not None and a.setting == "engine bfloat16+int8 / trainer float32 / dense"
    normal = {"rollout_corr/k3_kl": 0.055, "rollout_corr/kl": 0.056, "rollout_corr/token_log_ratio_max": 8.8,
              "rollout_corr/token_log_ratio_min": -6.0}
    assert a.check(1, normal) == []
    bf16 = MismatchAlarm.from_run(load_config(["rollout_correction.alert.factor_over_floor=5"]), moe=False, log=print)
    assert bf16 is not None and {x.name for x in bf16.check(1, normal)} == {"k3_kl", "max_abs_log_ratio"}
    broken = {**normal, "rollout_corr/k3_kl": 3.0, "rollout_corr/token_log_ratio_max": 80.0}
    assert {x.name for x in a.check(2, broken)} == {"k3_kl", "max_abs_log_ratio"}

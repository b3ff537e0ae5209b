"""The mismatch alarm (`rollout_correction.alert`): a step whose trainer/engine mismatch is above its threshold.

Each step `StepReport.publish` hands the step's metrics to `MismatchAlarm.check_step`. A watched statistic
(`config.mismatch_alert.ALERT_THRESHOLDS`: `rollout_corr/k3_kl`, `rollout_corr/kl`, and the step's max |dlogp|
= max(|`token_log_ratio_max`|, |`token_log_ratio_min`|)) fires when it exceeds its absolute threshold or
`factor_over_floor` x its floor: the healthy value of the run's setting (engine dtype x trainer dtype x
dense / MoE / MoE with routing replay), from `FLOORS` (measured by benchmarks/bench_floors.py, docs/audit.md)
or the user's `floor_*` (their model's `nrc audit`). A firing step:

- logs a warning naming the metric, its value, the threshold and the floor it came from;
- sets `alert/mismatch` (the number of statistics that fired; 0 on a healthy step, logged only when an alarm is
  configured) and tags the MLflow run through the observer's `on_alert` (`nrc.mismatch_alert`: the latest
  message; `nrc.mismatch_alert.first_step`, `nrc.mismatch_alert.num_steps`);
- with `alert.strict`, stops the run: `MismatchAlarmError` after the step's metrics are written, on every rank
  at the same step (one 1-element all-reduce, as the preemption check), so the run closes FAILED with the
  message as its `nrc.error`.

Under async lag (a step that trains tokens sampled L >= 1 versions before the trainer's, async or partial rollouts:
the step's `rollout_corr/lag_<L>/*`, computed by the trainer from the per-token versions), a token's mismatch is the
engine/trainer floor plus the policy's drift over L updates, which the floors do not cover. There the floor rule
(`factor_over_floor`) applies per staleness instead of to the whole step: the lag-0 tokens' k3
(`rollout_corr/lag_0/k3_kl`) against factor x floor, and the lag-L tokens' k3 against factor x max(floor, the run's
own lag-L reference), the least lag-L k3 of the earlier steps, once `lag_reference_steps` steps had lag-L tokens
(those first steps only measure). A lost or stopped sync makes a token labelled L versions old really older, so its
k3 climbs away from the least value seen; the intended lag stays near it (one update's drift shrinks as training
settles). max |dlogp| has no per-staleness split, so its floor rule is off on lagged
steps; absolute thresholds apply to the whole step's statistics as always (docs/acceptable_mismatch.md).

What the alarm has learnt (the lag references, and the first step and count of firing steps that the MLflow tags
carry) is saved with every checkpoint (`state_dict`, in the checkpoint's `meta.json`) and restored on resume
(`load_state_dict`), so a resumed run fires exactly where the uninterrupted one would instead of re-learning its
references from the resume on. The metrics it reads are the same on every rank (reduced over dp x cp, sent from
the last pipeline stage), so the logging rank's state serves every rank.

The metrics are those every mode computes: decoupled (`old_logprobs` vs `rollout_logprobs`), bypass (the first
loss pass's logprobs vs `rollout_logprobs`) and metrics-only alike. A NaN statistic (undefined on the batch) never
fires; an infinite one does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_rollout_correction.config.mismatch_alert import ALERT_THRESHOLDS, MismatchAlertConfig
from nemo_rollout_correction.distributed.runtime import any_rank
from nemo_rollout_correction.harness import metric_names as mn

__all__ = ["ALERT_METRIC", "FLOORS", "Alert", "MismatchAlarm", "MismatchAlarmError", "floor_for", "lag_values",
           "watched_values"]

ALERT_METRIC = mn.ALERT_MISMATCH
"""Per step: how many watched statistics fired (0: healthy); logged only when an alarm is configured."""

FloorKey = tuple[str, str, str]  # (engine dtype[+quantization], trainer dtype, family: "dense" | "moe" | "moe_r3")

FLOORS: dict[FloorKey, dict[str, float]] = {
    # Healthy values on sampled tokens (rollout_corr/k3_kl and max |dlogp|) per setting: the largest measured here,
    # rounded up, over SmolLM2-135M (`nrc audit` and 6-step training runs: docs/audit.md, docs/experiments.md) and
    # the tiny random Llama and Qwen3-MoE (benchmarks/bench_floors.py, docs/audit.md "Floors"). SmolLM2 sets every
    # dense value (the tiny models sit far lower); the MoE rows take the dense value where the tiny MoE is below
    # it. Model-dependent: set floor_* to your model's `nrc audit` values.
    ("float32", "float32", "dense"): {"k3_kl": 1e-10, "max_abs_log_ratio": 1e-4},
    ("float16", "float32", "dense"): {"k3_kl": 5e-4, "max_abs_log_ratio": 0.05},
    ("bfloat16", "float32", "dense"): {"k3_kl": 3e-3, "max_abs_log_ratio": 0.5},
    ("float32", "bfloat16", "dense"): {"k3_kl": 2e-3, "max_abs_log_ratio": 0.5},
    ("bfloat16", "bfloat16", "dense"): {"k3_kl": 3e-3, "max_abs_log_ratio": 0.5},
    ("float32", "float32", "moe"): {"k3_kl": 1e-10, "max_abs_log_ratio": 1e-4},
    ("bfloat16", "float32", "moe"): {"k3_kl": 3e-3, "max_abs_log_ratio": 0.5},
    ("float32", "bfloat16", "moe"): {"k3_kl": 2e-3, "max_abs_log_ratio": 0.5},
    ("bfloat16", "bfloat16", "moe"): {"k3_kl": 3e-3, "max_abs_log_ratio": 0.5},
    ("float32", "float32", "moe_r3"): {"k3_kl": 1e-10, "max_abs_log_ratio": 1e-4},
    ("bfloat16", "float32", "moe_r3"): {"k3_kl": 3e-3, "max_abs_log_ratio": 0.5},
    ("float32", "bfloat16", "moe_r3"): {"k3_kl": 2e-3, "max_abs_log_ratio": 0.5},
    ("bfloat16", "bfloat16", "moe_r3"): {"k3_kl": 3e-3, "max_abs_log_ratio": 0.5},
    # rollout.quantization=int8 (W8A8, engine key "<dtype>+int8"): `nrc audit rollout.quantization=int8` on
    # SmolLM2-135M measured k3 5.5e-2 (41x the bf16 engine's 1.3e-3) and max |dlogp| 8.8 over 2,905 tokens, almost
    # all from the per-token activation quantization (docs/audit.md, "Quantized rollouts"); dense models only.
    ("bfloat16+int8", "float32", "dense"): {"k3_kl": 0.1, "max_abs_log_ratio": 10.0},
    ("bfloat16+int8", "bfloat16", "dense"): {"k3_kl": 0.1, "max_abs_log_ratio": 10.0},
    ("float32+int8", "float32", "dense"): {"k3_kl": 0.1, "max_abs_log_ratio": 10.0},
}


def floor_for(engine_dtype: str, trainer_dtype: str, family: str) -> dict[str, float] | None:
    """The built-in floors of a setting, or None when it was not measured (then only `floor_*` can serve)."""
    return FLOORS.get((engine_dtype, trainer_dtype, family))


def watched_values(metrics: Mapping[str, float]) -> dict[str, float]:
    """The watched statistics of a step's metrics (absent when the step has none: a skipped update)."""
    out: dict[str, float] = {}
    if mn.RC_K3_KL in metrics:
        out["k3_kl"] = float(metrics[mn.RC_K3_KL])
    if mn.RC_KL in metrics:
        out["kl"] = float(metrics[mn.RC_KL])
    high, low = metrics.get(mn.RC_TOKEN_LOG_RATIO_MAX), metrics.get(mn.RC_TOKEN_LOG_RATIO_MIN)
    if high is not None and low is not None:
        out["max_abs_log_ratio"] = max(abs(float(high)), abs(float(low)))
    return out


_LAG_K3 = re.compile(r"rollout_corr/lag_(\d+)/k3_kl$")


def lag_values(metrics: Mapping[str, float]) -> dict[int, tuple[float, float]]:
    """Per token staleness L: (`rollout_corr/lag_<L>/k3_kl`, `rollout_corr/lag_<L>/num_tokens`) of a step's metrics
    (async / partial rollouts; empty otherwise)."""
    out: dict[int, tuple[float, float]] = {}
    for key, value in metrics.items():
        match = _LAG_K3.match(key)
        if match:
            lag = int(match.group(1))
            out[lag] = (float(value), float(metrics.get(f"rollout_corr/lag_{lag}/num_tokens", 0.0)))
    return out


@dataclass(frozen=True)
class Alert:
    """One statistic above its threshold at one step."""

    step: int
    name: str
    value: float
    threshold: float
    floor: float | None  # the floor the threshold came from (factor_over_floor), None for an absolute one
    setting: str
    basis: str = ""  # lagged tokens: what `floor` is when it is the run's own lag reference

    def message(self) -> str:
        """`step 3: rollout_corr/k3_kl = 2.1e-03 > 1.0e-04 (10 x floor 1.0e-05 of engine bfloat16 / ...)`."""
        if self.floor is not None and self.basis:
            source = f"{self.threshold / self.floor:g} x {self.basis} {self.floor:.1e}"
        elif self.floor is not None:
            source = f"{self.threshold / self.floor:g} x floor {self.floor:.1e} of {self.setting}"
        else:
            source = "absolute threshold"
        return f"step {self.step}: {_metric_name(self.name)} = {self.value:.3e} > {self.threshold:.3e} ({source})"


def _metric_name(name: str) -> str:
    return "max |dlogp| (rollout_corr/token_log_ratio_max/min)" if name == "max_abs_log_ratio" \
        else f"rollout_corr/{name}"  # lagged steps: rollout_corr/lag_<L>/k3_kl


class MismatchAlarmError(RuntimeError):
    """`alert.strict`: a step's mismatch is above its threshold; the run stops (FAILED)."""


class MismatchAlarm:
    """The thresholds of one run and what a firing step does (module docstring).

    Args:
        cfg: `rollout_correction.alert`.
        engine_dtype, trainer_dtype: `rollout.dtype` (with `+int8` under `rollout.quantization=int8`),
            `model.dtype` (the floors' setting).
        family: "dense", "moe" (own routing) or "moe_r3" (rollout routing replayed).
        log: the trainer's console (the logging rank's; a no-op elsewhere).
    """

    def __init__(self, cfg: MismatchAlertConfig, *, engine_dtype: str, trainer_dtype: str, family: str,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.log = cfg, log
        self.setting = f"engine {engine_dtype} / trainer {trainer_dtype} / {family}"
        builtin = floor_for(engine_dtype, trainer_dtype, family) or {}
        floors = {"k3_kl": cfg.floor_k3_kl if cfg.floor_k3_kl is not None else builtin.get("k3_kl"),
                  "max_abs_log_ratio": cfg.floor_max_abs_log_ratio if cfg.floor_max_abs_log_ratio is not None
                  else builtin.get("max_abs_log_ratio")}
        if cfg.factor_over_floor is not None and all(v is None for v in floors.values()):
            raise ValueError(f"rollout_correction.alert.factor_over_floor is set but no floor is known for "
                             f"{self.setting} (measured: {sorted(FLOORS)}); set rollout_correction.alert.floor_k3_kl "
                             "and/or floor_max_abs_log_ratio to your model's `nrc audit` values")
        # name -> (threshold, floor or None): the lower of the absolute threshold and factor x floor
        self.thresholds: dict[str, tuple[float, float | None]] = {}
        self.absolute: dict[str, float] = {}  # name -> absolute threshold
        self.over_floor: dict[str, tuple[float, float]] = {}  # name -> (factor x floor, floor)
        for name in ALERT_THRESHOLDS:
            candidates: list[tuple[float, float | None]] = []
            absolute = getattr(cfg, name)
            if absolute is not None:
                candidates.append((float(absolute), None))
                self.absolute[name] = float(absolute)
            floor = floors.get(name)
            if cfg.factor_over_floor is not None and floor is not None:
                candidates.append((cfg.factor_over_floor * floor, floor))
                self.over_floor[name] = (cfg.factor_over_floor * floor, floor)
            if candidates:
                self.thresholds[name] = min(candidates, key=lambda c: c[0])
        # async lag: per staleness L >= 1, the least k3 of the steps with lag-L tokens so far, its step, their count
        self.lag_reference: dict[int, float] = {}
        self.lag_reference_step: dict[int, int] = {}
        self.lag_steps: dict[int, int] = {}
        self.first_step: int | None = None
        self.num_steps = 0
        self._pending: list[Alert] = []  # the alerts of the step being published

    @classmethod
    def from_run(cls, cfg: Any, *, moe: bool, log: Callable[[str], None]) -> MismatchAlarm | None:
        """The alarm of a `TrainConfig` (None when no threshold is set)."""
        alert = getattr(cfg.rollout_correction, "alert", None)
        if alert is None or not alert.enabled:
            return None
        family = ("moe_r3" if cfg.rollout.routing_replay == "r3" else "moe") if moe else "dense"
        quantization = getattr(cfg.rollout, "quantization", "none")
        engine = cfg.rollout.dtype if quantization == "none" else f"{cfg.rollout.dtype}+{quantization}"
        return cls(alert, engine_dtype=engine, trainer_dtype=cfg.model.dtype, family=family, log=log)

    def check(self, step: int, metrics: Mapping[str, float]) -> list[Alert]:
        """The statistics of `metrics` above their thresholds (pure; NaN never fires, inf does). A step with lagged
        tokens (`lag_values`) holds its k3 per staleness to the floor rule (module docstring)."""
        lags = lag_values(metrics)
        if not any(lag > 0 and count > 0 for lag, (_, count) in lags.items()):
            out = []
            for name, value in watched_values(metrics).items():
                if name in self.thresholds and not math.isnan(value):
                    threshold, floor = self.thresholds[name]
                    if value > threshold:
                        out.append(Alert(step, name, value, threshold, floor, self.setting))
            return out
        out = [Alert(step, name, value, self.absolute[name], None, self.setting)
               for name, value in watched_values(metrics).items()
               if name in self.absolute and not math.isnan(value) and value > self.absolute[name]]
        if "k3_kl" not in self.over_floor or self.cfg.factor_over_floor is None:
            return out
        limit, floor = self.over_floor["k3_kl"]
        factor = self.cfg.factor_over_floor
        for lag, (k3, count) in sorted(lags.items()):
            if count <= 0 or math.isnan(k3):
                continue
            name = f"lag_{lag}/k3_kl"
            if lag == 0:
                if k3 > limit:
                    out.append(Alert(step, name, k3, limit, floor, self.setting))
            elif self.lag_steps.get(lag, 0) >= self.cfg.lag_reference_steps:
                reference = max(floor, self.lag_reference[lag])
                if k3 > factor * reference:
                    out.append(Alert(step, name, k3, factor * reference, reference, self.setting,
                                     basis=f"the run's least lag-{lag} k3 (step {self.lag_reference_step[lag]})"))
        return out

    def _measure_lag_references(self, step: int, metrics: Mapping[str, float]) -> None:
        """Every step with lag-L tokens updates the run's lag-L reference: the least lag-L k3 so far."""
        for lag, (k3, count) in lag_values(metrics).items():
            if lag > 0 and count > 0 and not math.isnan(k3):
                self.lag_steps[lag] = self.lag_steps.get(lag, 0) + 1
                if k3 < self.lag_reference.get(lag, math.inf):
                    self.lag_reference[lag], self.lag_reference_step[lag] = k3, step

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the alarm learnt so far, as JSON data (the lag references keyed by the staleness as a string)."""
        return {"lag_reference": {str(lag): value for lag, value in sorted(self.lag_reference.items())},
                "lag_reference_step": {str(lag): s for lag, s in sorted(self.lag_reference_step.items())},
                "lag_steps": {str(lag): n for lag, n in sorted(self.lag_steps.items())},
                "first_step": self.first_step, "num_steps": self.num_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict()` (a resumed run): the same references, counts and tags."""
        try:
            self.lag_reference = {int(k): float(v) for k, v in state["lag_reference"].items()}
            self.lag_reference_step = {int(k): int(v) for k, v in state["lag_reference_step"].items()}
            self.lag_steps = {int(k): int(v) for k, v in state["lag_steps"].items()}
            first = state["first_step"]
            self.first_step = None if first is None else int(first)
            self.num_steps = int(state["num_steps"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"the checkpoint's mismatch alarm state is malformed ({type(exc).__name__}: {exc}); "
                             f"expected MismatchAlarm.state_dict() data, got {dict(state)!r}") from None
        lags = set(self.lag_reference)
        if lags != set(self.lag_reference_step) or not lags <= set(self.lag_steps):
            raise ValueError(f"the checkpoint's mismatch alarm state is inconsistent: lag references for "
                             f"{sorted(self.lag_reference)}, their steps for {sorted(self.lag_reference_step)}, "
                             f"step counts for {sorted(self.lag_steps)}")

    def check_step(self, step: int, metrics: dict[str, float], observer: Any) -> None:
        """Check step `step` (every rank, collective under `strict`): adds `alert/mismatch` to `metrics`, warns
        and tags through `observer` when it fires, and under `strict` raises `MismatchAlarmError` on every rank.
        Call it before the metrics are written, and `stop_if_strict` after."""
        alerts = self.check(step, metrics)
        self._measure_lag_references(step, metrics)
        metrics[ALERT_METRIC] = float(len(alerts))
        self._pending = alerts
        if not alerts:
            return
        self.num_steps += 1
        if self.first_step is None:
            self.first_step = step
        for alert in alerts:
            self.log(f"[nrc train] WARNING mismatch alert: {alert.message()}")
        on_alert = getattr(observer, "on_alert", None)  # observers written before the alarm may lack it
        if on_alert is not None:
            on_alert(step, {"nrc.mismatch_alert": "; ".join(a.message() for a in alerts),
                            "nrc.mismatch_alert.first_step": str(self.first_step),
                            "nrc.mismatch_alert.num_steps": str(self.num_steps)})

    def stop_if_strict(self, step: int) -> None:
        """Under `strict`: raise `MismatchAlarmError` on every rank when the step fired on any (collective)."""
        if not self.cfg.strict:
            return
        alerts = self._pending
        if any_rank(bool(alerts)):
            detail = "; ".join(a.message() for a in alerts) or "on another rank"
            raise MismatchAlarmError(
                f"mismatch alarm (rollout_correction.alert.strict=true): {detail}. The engine no longer samples "
                "from the policy the trainer holds (a lost weight sync, a wrong engine dtype or setting); see "
                "docs/acceptable_mismatch.md")


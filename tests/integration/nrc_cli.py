"""What the `nrc train` CLI tests share: the tiny fast run's overrides, a clean environment, the metrics file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# 4 prompts x 4 samples x 16 tokens per step on the tiny random Llama, lr high enough that a step moves it.
# rollout.dtype=float32: these tests compare runs and layouts to 1e-6 and check that the engine and the trainer
# agree after a refit, which needs the engine at the trainer's precision (the default is bfloat16).
TINY_FAST = [
    "model=tiny_llama",
    "rollout.dtype=float32",
    "task.prompts_per_step=4",
    "rollout.num_samples_per_prompt=4",
    "rollout.max_new_tokens=16",
    "policy.micro_batch_size=8",
    "policy.lr=1e-3",
]


def cli_env() -> dict[str, str]:
    """This process's environment without an inherited torchrun launch (each job starts its own) and with
    MLflow's telemetry off."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The rows of `<out>/metrics.jsonl`, one per step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# Metrics reported as NaN where they are undefined on a batch (docs/metrics.md), never as a made-up number.
UNDEFINED_AS_NAN = frozenset({"rollout_corr/prob_pearson"})


def nan_metrics(row: dict[str, Any]) -> list[str]:
    """The keys of a `metrics.jsonl` row that are NaN although they are always defined (NaN != NaN)."""
    return [key for key, value in row.items() if value != value and key not in UNDEFINED_AS_NAN]


def deterministic(m: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics without wall-clock values (`timing/*`, throughputs, `rollout/engine<e>_refit_s`); NaN (an
    undefined metric, docs/metrics.md) as "nan" so that two undefined values compare equal."""
    return {k: "nan" if v != v else v for k, v in m.items()
            if not k.startswith("timing/") and not k.endswith(("_per_s", "_refit_s"))}


# What a recorded run may differ in on another machine (CPU kernels, vector width): fp32 rounding. Counts, token
# totals, rewards (of identical tokens), the optimizer's schedule and the step are exact across machines.
EXACT_PREFIXES = ("step", "perf/", "reward/", "response/", "optim/", "rollout/", "rollout_corr/num_",
                  "rollout_corr/nonfinite_")
# Elsewhere fp32 rounding: losses, norms and perplexities moved by at most 4e-7 relative between this machine's
# default (AVX-512) and AVX2 kernel dispatch over 3 steps of the fp32 tiny Llama (measured 2026-11-28), so 1e-5.
RECORDED_REL = 1e-5
# With an fp32 engine and an fp32 trainer the mismatch metrics (rollout_corr/*) ARE rounding: log-ratios of a few
# fp32 ulps (<= 1e-6), and rollout_is_std = sqrt(E[w^2] - E[w]^2) in fp32 turns a cancelling 6e-8 into 2.4e-4
# (measured between the two dispatches), so they are compared to 1e-3 absolute; a real mismatch is far above.
ROUNDOFF_ABS = 1e-3


def assert_matches_recorded(got: dict[str, Any], want: dict[str, Any], keys: tuple[str, ...] | None = None) -> None:
    """Compare a step's metrics with a step recorded on another machine: exact for what is exact across machines
    (`EXACT_PREFIXES`), fp32 rounding's tolerance for the rest (`RECORDED_REL`, `ROUNDOFF_ABS`); NaN equals NaN;
    wall-clock values are skipped. `keys`: only these (default: every recorded key)."""
    got, want = deterministic(got), deterministic(want)
    if keys is None:
        assert set(got) == set(want), f"metrics added or lost: {sorted(set(got) ^ set(want))}"
    for key in keys or tuple(want):
        a, b = got[key], want[key]
        if key.startswith(EXACT_PREFIXES) or isinstance(b, str):
            assert a == b, f"{key}: {a!r} != recorded {b!r}"
        elif key.startswith("rollout_corr/"):
            assert abs(a - b) <= ROUNDOFF_ABS, f"{key}: {a!r} vs recorded {b!r} (abs {ROUNDOFF_ABS})"
        else:
            assert abs(a - b) <= RECORDED_REL * abs(b), f"{key}: {a!r} vs recorded {b!r} (rel {RECORDED_REL})"


def train_two_steps(args: list[str], cwd: Path, out: Path) -> list[dict[str, Any]]:
    """Run `nrc train` with `args` (which set `run.num_steps=2` and `run.output_dir=out`), check that it exited 0 and
    logged steps 1 and 2 with no NaN beyond the undefined-as-NaN metrics; returns those rows."""
    proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *args], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert not nan_metrics(row), nan_metrics(row)
    return rows

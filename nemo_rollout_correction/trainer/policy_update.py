"""`PolicyUpdate`: a step's optimizer updates of the Megatron policy, from the step's batch tensors.

What it owns (and is the only part of the trainer to touch): the rollout-corrected loss, the optimizer (Megatron
DDP + optimizer + LR schedule, models/optimizer.py), the cut of a step's samples into mini-batches and this
rank's microbatches, the no-grad passes (old and reference logprobs), and each update's phases
plan -> forward/backward -> optimizer step -> finish. It reads the policy and the reference policy it is
handed; it does not touch the engines, the sampler, metrics files or checkpoints.

Each phase leaves an immutable record (one job each, nothing filled in later):

- `Microbatch`: the cut (this dp rank's rows, trimmed to the longest, this CP rank's share of the tokens; with
  `policy.sequence_packing` also packed for the forward, with `policy.prefix_sharing` each prompt once per pack
  (`shares_prefixes`), the logprobs unpacked back to `[rows, width - 1]`, so every later consumer reads the
  padded layout; `policy.max_tokens_per_microbatch` fills them by tokens);
- `Scored`: the no-grad passes before the step's first update (`score`);
- `MicrobatchPass`: what the loss pass computed for one microbatch (its logprobs; loglinear pi_old);
- `Update`: one optimizer update (its plan, reduced statistics, what the optimizer did, its passes).

The loglinear `old_logprobs` (AReaL's interpolation, `rollout_correction.old_logprob_source=loglinear`) are
computed in the loss pass from the update's index, which every call receives explicitly.

First forward as pi_old (`grpo.reuse_first_forward_old_logprobs`, `reuses_first_forward`): the step's first
update runs with the weights pi_old has, so its forward's logprobs are pi_old exactly, and the old-logprob pass
skips that update's mini-batch. The decoupled plan needs pi_old of every microbatch before the first backward
(global denominators, rejection masks), so that update forwards every microbatch first, keeping the graphs
(`models.schedule.forward_microbatches`), plans from the detached logprobs, then backpropagates through
Megatron's schedule. The forward is the same computation as the no-grad pass's (same microbatches, same
kernels), so metrics and weights are those of the run with the pass, bit for bit (tests/integration/
test_reuse_old_logprobs.py). The other mini-batches of the step still get the pass (later updates move the
weights); the first mini-batch's `Scored` then carry the reused logprobs for later epochs and the review.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from nemo_rollout_correction.config.schema import ConfigError, TrainConfig
from nemo_rollout_correction.core.devices import tensor_fields_to
from nemo_rollout_correction.core.loglinear import loglinear_alpha, loglinear_error_partials, loglinear_old_logprobs
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.core.segments import Segments, turn_mismatch_sums
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage
from nemo_rollout_correction.harness import routing_replay
from nemo_rollout_correction.harness.scoring import score_microbatches, shard_tokens
from nemo_rollout_correction.harness.settings import replay_options
from nemo_rollout_correction.losses.rollout_corrected_pg import RolloutCorrectedPolicyLoss
from nemo_rollout_correction.losses.step_plan import (
    DenominatorStrategy,
    StepPlan,
    StepResult,
    StepStats,
    denominator_strategy,
    finish_step,
    microbatch_loss,
    plan_step,
)
from nemo_rollout_correction.models.optimizer import OptimizerSettings, UpdateResult, build_policy_optimizer
from nemo_rollout_correction.models.packing import PackedRows
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import forward_microbatches, run_microbatches
from nemo_rollout_correction.rollout.partial import max_token_staleness, staleness_mismatch_sums

__all__ = [
    "Microbatch",
    "MicrobatchPass",
    "PhaseTimer",
    "PolicyUpdate",
    "Scored",
    "Update",
    "first_loss_position",
    "microbatch_rows",
    "row_loss_starts",
    "train_rows",
]

PhaseTimer = Callable[[str], AbstractContextManager[None]]
"""`timer(phase)`: a context manager adding the seconds inside to the step's `timing/<phase>_s`."""


@dataclass(frozen=True)
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
    staleness: Tensor | None = None  # async rollouts: [rows] steps between each row's generating policy and this step
    segments: Segments | None = None  # multi-turn: the turn of each token (core/segments.py), this CP rank's share
    token_staleness: Tensor | None = None  # async / partial rollouts: per token, steps since its version (-1: none)
    logit_start: int = 0  # the first position whose logits are computed: none before it is in loss_mask
    packed: PackedRows | None = None  # policy.sequence_packing: the rows packed for the forward (models/packing.py)


@dataclass(frozen=True)
class Scored:
    """The no-grad passes of one microbatch before the step's first update (last pipeline stage; None elsewhere).

    old_logprobs: decoupled mode with `old_logprob_source=forward`: pi_old. ref_logprobs: with a KL penalty, the
    reference policy's. check_old_logprobs: loglinear check steps: the forward's pi_old, to measure the
    interpolation's error against.
    """

    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    check_old_logprobs: Tensor | None = None


@dataclass(frozen=True)
class MicrobatchPass:
    """What one update's loss pass computed for one microbatch (last pipeline stage).

    logprobs: the pass's logprobs, detached (the policy before this update). old_logprobs: loglinear mode's
    interpolated pi_old of this update (None otherwise).
    """

    logprobs: Tensor
    old_logprobs: Tensor | None


@dataclass(frozen=True)
class Update:
    """One optimizer update of a step: its loss plan, its reduced statistics, what the optimizer did, and per
    microbatch what its loss pass computed (empty on stages other than the last). reused_old_logprobs: its
    `old_logprobs` are its own forward's (`PolicyUpdate.reuses_first_forward`), not an old-logprob pass's."""

    plan: StepPlan
    result: StepResult
    applied: UpdateResult
    passes: tuple[MicrobatchPass, ...] = ()
    reused_old_logprobs: bool = False


def first_loss_position(loss_mask: Tensor) -> int:
    """The first column of `loss_mask` (`[rows, seq]`) that is in the loss for any row, 0 if none is: the logits
    before it are never read (`Microbatch.logit_start`)."""
    columns = loss_mask.any(0).nonzero()
    return int(columns[0, 0]) if len(columns) else 0


def row_loss_starts(loss_mask: Tensor) -> Tensor:
    """`[rows]`: per row of `loss_mask` (`[rows, seq]`) its first column in the loss, 0 for a row without one."""
    first = loss_mask.to(torch.int8).argmax(-1)
    return torch.where(loss_mask.any(-1), first, torch.zeros_like(first))


def _bin_cost(lengths: list[int], packed: bool) -> int:
    """Tokens a microbatch of rows with these lengths computes: their sum packed, rows x longest padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def _token_bins(rows: list[int], lengths: Tensor, budget: int, packed: bool) -> list[list[int]]:
    """First-fit decreasing: rows longest first, each into the first microbatch it fits in (`_bin_cost` <=
    `budget`), else a new one (a row longer than the budget is a microbatch of its own)."""
    bins: list[list[int]] = []
    for row in sorted(rows, key=lambda r: (-int(lengths[r]), r)):
        for members in bins:
            if _bin_cost([int(lengths[r]) for r in [*members, row]], packed) <= budget:
                members.append(row)
                break
        else:
            bins.append([row])
    return bins


def _split_to(bins: list[list[int]], count: int, lengths: Tensor, packed: bool) -> list[list[int]]:
    """`bins` split until there are `count`: the costliest microbatch of several rows is halved each time."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise ValueError(
                f"policy.max_tokens_per_microbatch: another data-parallel rank needs {count} microbatches, more than "
                f"this rank's {sum(len(b) for b in bins)} rows (every rank must run the same number); raise "
                "policy.max_tokens_per_microbatch")
        widest = max(splittable, key=lambda b: _bin_cost([int(lengths[r]) for r in b], packed))
        bins.remove(widest)
        half = len(widest) // 2
        bins += [widest[:half], widest[half:]]
    return bins


def microbatch_rows(samples: Tensor, lengths: Tensor, *, dp_size: int, dp_rank: int, micro_batch_size: int,
                    max_tokens: int = 0, packed: bool = False) -> list[Tensor]:
    """The rows (indices into the step's samples) of each of dp rank `dp_rank`'s microbatches of one mini-batch.

    Its rows are its contiguous slice of `samples`. `max_tokens = 0`: `micro_batch_size` rows each, in order.
    `max_tokens > 0` (`policy.max_tokens_per_microbatch`): filled by tokens (`_token_bins`; `lengths` `[samples]`
    are every sample's prompt + response tokens). Every dp rank must run as many microbatches (Megatron's
    schedule and DDP's gradient reduction pair them up): each rank plans every rank's slice (all hold the step's
    lengths, so no communication), and splits its own microbatches until it has as many as the rank with the
    most. Rows keep their order inside a microbatch; microbatches are ordered by their first row.
    """
    slices = torch.tensor_split(samples, dp_size)
    mine = slices[dp_rank]
    if max_tokens <= 0:
        return [mine[start:start + micro_batch_size] for start in range(0, len(mine), micro_batch_size)]
    plans = [_token_bins(part.tolist(), lengths, max_tokens, packed) for part in slices]
    bins = _split_to(plans[dp_rank], max(len(p) for p in plans), lengths, packed)
    ordered = sorted((sorted(b) for b in bins), key=lambda b: b[0])
    return [torch.tensor(b, dtype=samples.dtype) for b in ordered]


def prefix_sharing_unsupported(policy: MegatronPolicy, reference: MegatronPolicy | None) -> str | None:
    """Why the policy (or the reference policy, which scores the same packs) cannot forward shared-prefix packs
    (`models.prefix_sharing`), or None."""
    for model in (policy, reference):
        if model is not None and model.prefix_sharing_unsupported is not None:
            return f"{model.prefix_sharing_unsupported} (layer spec {model.layer_spec})"
    return None


def shares_prefixes(cfg: TrainConfig, policy: MegatronPolicy, reference: MegatronPolicy | None) -> bool:
    """Whether the update's packs share their rows' prefixes: `policy.prefix_sharing` resolved (null: wherever the
    microbatches are packed and the models can; true where they cannot: ConfigError naming why)."""
    setting = cfg.policy.prefix_sharing
    if setting is False or not cfg.packs_sequences:
        return False
    unsupported = prefix_sharing_unsupported(policy, reference)
    if setting is True and unsupported is not None:
        raise ConfigError(f"policy.prefix_sharing=true is not built here: {unsupported}; shared prefixes need the "
                          "local layer spec's attention (models/prefix_sharing.py); set policy.prefix_sharing=null "
                          "or false")
    return unsupported is None


def train_rows(num_samples: int, num_mini_batches: int, dp_size: int, dp_rank: int) -> Tensor:
    """The rows data-parallel rank `dp_rank` trains: its contiguous slice of every mini-batch (`PolicyUpdate.cut`)."""
    samples = torch.arange(num_samples)
    parts = torch.tensor_split(samples, num_mini_batches)
    return torch.cat([torch.tensor_split(part, dp_size)[dp_rank] for part in parts])


class PolicyUpdate:
    """The step's updates of `policy` (module docstring): loss, optimizer, microbatches, no-grad passes.

    Args:
        cfg: the run's config (`grpo.*`, `policy.*`, `rollout_correction`, `rollout.max_new_tokens`).
        groups: this rank's parallel groups.
        policy: the policy to train; reference: the initial policy for the KL penalty (None without one).
        pad_id: the tokenizer's pad id (CP padding).
    """

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, policy: MegatronPolicy,
                 reference: MegatronPolicy | None, *, pad_id: int) -> None:
        self.cfg, self.groups, self.policy, self.reference, self.pad_id = cfg, groups, policy, reference, pad_id
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
        self.replay = replay_options(cfg)
        self.shares_prefixes = shares_prefixes(cfg, policy, reference)
        # Megatron DDP + optimizer (fp32 main weights for bf16/fp16) + LR schedule: models/optimizer.py.
        self.optim = build_policy_optimizer(
            policy.model, OptimizerSettings.from_config(cfg.policy, total_updates=cfg.total_optimizer_updates))

    @property
    def strategy(self) -> DenominatorStrategy:
        """Where each update's loss denominator comes from (`losses.step_plan.denominator_strategy`)."""
        return denominator_strategy(self.rc_cfg, kl_penalty_on=self.reference is not None)

    @property
    def reuses_first_forward(self) -> bool:
        """Whether the step's first update takes its mini-batch's `old_logprobs` from its own forward (module
        docstring): `grpo.reuse_first_forward_old_logprobs`, decoupled mode with `old_logprob_source=forward`
        (the only mode with an old-logprob pass to save), and PP = 1 (forwarding every microbatch before the
        first backward needs the stages' activation exchange, which only Megatron's schedule does)."""
        return (self.cfg.grpo.reuse_first_forward_old_logprobs and self.strategy == "decoupled"
                and self.groups.pp_size == 1)

    @property
    def uses_loglinear(self) -> bool:
        """Decoupled mode with `old_logprobs` interpolated in the loss pass instead of scored by a forward."""
        return not self.rc_cfg.bypass_mode and self.rc_cfg.old_logprob_source == "loglinear"

    # ---- the cut ----------------------------------------------------------------------------------------

    def train_rows(self, num_samples: int, dp_rank: int) -> Tensor:
        """The rows data-parallel rank `dp_rank` trains (`train_rows` with this run's mini-batches)."""
        return train_rows(num_samples, self.cfg.grpo.num_mini_batches, self.groups.dp_size, dp_rank)

    def cut(self, tensors: dict[str, Tensor], advantages: Tensor) -> list[list[Microbatch]]:
        """The step's samples cut into `grpo.num_mini_batches` contiguous mini-batches, each as this dp rank's
        microbatches (one mini-batch: exactly the single update of earlier versions). Starts the step's
        routing replay (MoE: each microbatch's captured routing is attached as it is cut)."""
        routing_replay.begin_step(self.policy)
        samples = torch.arange(tensors["input_ids"].shape[0])
        return [self._microbatches(tensors, advantages, part)
                for part in torch.tensor_split(samples, self.cfg.grpo.num_mini_batches)]

    def _microbatches(self, tensors: dict[str, Tensor], advantages: Tensor, samples: Tensor) -> list[Microbatch]:
        """This dp rank's contiguous slice of `samples`, cut into microbatches (`microbatch_rows`) trimmed to their
        longest row; with `policy.sequence_packing` each also carries its rows packed for the forward."""
        policy_cfg = self.cfg.policy
        all_lengths = tensors["prompt_lengths"] + tensors["response_lengths"]
        out = []
        for idx in microbatch_rows(samples, all_lengths, dp_size=self.groups.dp_size, dp_rank=self.groups.dp_rank,
                                   micro_batch_size=policy_cfg.micro_batch_size,
                                   max_tokens=policy_cfg.max_tokens_per_microbatch,
                                   packed=self.cfg.packs_sequences):
            lengths = all_lengths[idx]
            width = int(lengths.max())
            input_ids = tensors["input_ids"][idx, :width]
            rollout_logprobs = tensors["rollout_logprobs"][idx, : width - 1]
            loss_mask = tensors["loss_mask"][idx, : width - 1]
            token_tensors = {"rollout_logprobs": rollout_logprobs, "loss_mask": loss_mask}
            if "turn_index" in tensors:  # multi-turn: the turn of each token travels with its shard
                token_tensors["turn_index"] = tensors["turn_index"][idx, : width - 1]
            if "token_staleness" in tensors:  # async / partial rollouts: so does each token's staleness
                token_tensors["token_staleness"] = tensors["token_staleness"][idx, : width - 1]
            shard = shard_tokens(input_ids, token_tensors, self.groups, pad_id=self.pad_id)  # this CP rank's tokens
            input_ids, labels, position_ids = shard.input_ids, shard.labels, shard.position_ids
            rollout_logprobs, loss_mask = shard.tokens["rollout_logprobs"], shard.tokens["loss_mask"]
            routing_replay.attach_microbatch(self.policy, tensors, idx, input_ids, position_ids)
            # no CP (positions in order): the output layer and the log-softmax skip the prompt positions no loss reads
            logit_start = first_loss_position(loss_mask) if labels is None and self.policy.cuts_logits else 0
            packed = None
            if self.cfg.packs_sequences:  # never with CP (config/schema.py): the rows are whole here
                packed = PackedRows.of(input_ids, lengths, row_loss_starts(loss_mask),
                                       share_prefixes=self.shares_prefixes)
                logit_start = 0
            mb = Microbatch(
                input_ids=input_ids, rollout_logprobs=rollout_logprobs, loss_mask=loss_mask,
                advantages=advantages[idx], rows=idx, labels=labels, position_ids=position_ids,
                staleness=tensors["staleness"][idx] if "staleness" in tensors else None,
                segments=(Segments(shard.tokens["turn_index"], self.cfg.rollout.max_turns)
                          if "turn_index" in shard.tokens else None),
                token_staleness=shard.tokens.get("token_staleness"), logit_start=logit_start, packed=packed,
            )
            out.append(tensor_fields_to(mb, self.policy.device, keep=("rows",)))  # rows index host tensors
        return out

    # ---- the step ---------------------------------------------------------------------------------------------

    def run(self, mini_batches: list[list[Microbatch]], step: int,
            timer: PhaseTimer) -> tuple[list[Scored], list[Update]]:
        """Step `step`'s (0-based) no-grad passes and updates: `grpo.ppo_epochs` passes over the mini-batches.

        Returns per microbatch (all mini-batches, in order) its `Scored` record, with the first mini-batch's
        `old_logprobs` those of the first update's forward when it reused them, and the updates in order.
        """
        reused = len(mini_batches[0]) if mini_batches and self.reuses_first_forward else 0
        scored = self.score([mb for mini in mini_batches for mb in mini], step, timer, reused=reused)
        updates: list[Update] = []
        for _epoch in range(self.cfg.grpo.ppo_epochs):
            offset = 0
            for microbatches in mini_batches:
                mine = scored[offset:offset + len(microbatches)]
                offset += len(microbatches)
                updates.append(self.update(microbatches, mine, len(updates), timer))
                if len(updates) == 1 and reused:  # pi_old of the first mini-batch: its first forward's
                    scored[:reused] = [replace(s, old_logprobs=p.logprobs)
                                       for s, p in zip(scored[:reused], updates[0].passes, strict=True)]
        return scored, updates

    # ---- the no-grad passes -------------------------------------------------------------------------------

    def score(self, microbatches: list[Microbatch], step: int, timer: PhaseTimer, *, reused: int = 0) -> list[Scored]:
        """The no-grad passes before step `step`'s (0-based) first update, per microbatch: `old_logprobs`
        (`timing/old_logprob_s`) and the reference's (`timing/ref_logprob_s`). The first `reused` microbatches
        get no old-logprob pass: the first update's forward supplies theirs (`reuses_first_forward`)."""
        self.policy.model.train()
        with timer("old_logprob"):
            scored_old = self._score_old(microbatches[reused:], step)
        old: list[Tensor | None] | None = None if scored_old is None else [None] * reused + list(scored_old)
        with timer("ref_logprob"):
            ref = self._score(self.reference, microbatches) if self.reference is not None else None
        loglinear = self.uses_loglinear
        out = []
        for i in range(len(microbatches)):
            forward = old[i] if old is not None and i < len(old) else None  # None where reused
            out.append(Scored(old_logprobs=None if loglinear else forward,
                              ref_logprobs=ref[i] if ref is not None and i < len(ref) else None,
                              check_old_logprobs=forward if loglinear else None))
        return out

    def _score_old(self, microbatches: list[Microbatch], step: int) -> list[Tensor] | None:
        """Decoupled mode: the policy's logprobs before the step's first update (last stage; None elsewhere).

        With `old_logprob_source=loglinear` the pass runs only on the `loglinear_check_every` steps, where its
        result is kept to measure the interpolation's error.
        """
        if self.rc_cfg.bypass_mode:
            return None
        if self.uses_loglinear:
            every = self.rc_cfg.loglinear_check_every
            if not (every and (step + 1) % every == 0):
                return None
        return self._score(self.policy, microbatches)

    def _score(self, policy: MegatronPolicy, microbatches: list[Microbatch]) -> list[Tensor] | None:
        """No-grad logprobs of every microbatch (last pipeline stage; None on the others)."""
        labels = [mb.labels for mb in microbatches if mb.labels is not None]  # CP shares; empty without CP
        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        starts = [mb.logit_start for mb in microbatches] if policy.cuts_logits and not labels else None
        return score_microbatches(policy, [mb.input_ids for mb in microbatches], self.replay, labels=labels,
                                  position_ids=positions, starts=starts, packed=self._packs(microbatches))

    @staticmethod
    def _packs(microbatches: Sequence[Microbatch]) -> list[PackedRows] | None:
        """Every microbatch's packed rows (`policy.sequence_packing`), else None."""
        packs = [mb.packed for mb in microbatches if mb.packed is not None]
        return packs if packs and len(packs) == len(microbatches) else None

    # ---- one update -----------------------------------------------------------------------------------------

    def update(self, microbatches: list[Microbatch], scored: Sequence[Scored], index: int,
               timer: PhaseTimer) -> Update:
        """The step's `index`-th optimizer update, on one mini-batch: plan, forward/backward, optimizer step,
        finish (`timing/correction_s` and `timing/train_s`)."""
        first_forward = None
        if index == 0 and self.reuses_first_forward:  # pi_old = this forward (module docstring)
            with timer("train"):
                first_forward = self._forward_with_graph(microbatches)
            scored = [replace(s, old_logprobs=lp.detach()) for s, lp in zip(scored, first_forward, strict=True)]
        with timer("correction"):
            plan = self.plan(microbatches, scored, index)
        with timer("train"):
            stats, passes = self.forward_backward(microbatches, scored, plan, index, logprobs=first_forward)
            applied = self.optim.step()
        with timer("correction"):
            result = StepResult({}, {})
            if self.policy.is_last_stage:
                for k in range(self.cfg.rollout.max_turns if self.cfg.rollout.max_turns > 1 else 0):  # same keys
                    for key in (f"turn_{k}/num_tokens", f"turn_{k}/sum_k3", f"turn_{k}/sum_abs_log_ratio"):
                        stats.sums.setdefault(key, 0.0)  # on every rank, microbatches or not
                result = finish_step(plan, stats, self.rc_cfg, self.groups, agg_mode=self.loss_fn.agg_mode)
            result = broadcast_from_last_stage(result, self.groups)
        return Update(plan=plan, result=result, applied=applied, passes=passes,
                      reused_old_logprobs=first_forward is not None)

    def _forward_with_graph(self, microbatches: list[Microbatch]) -> list[Tensor]:
        """Every microbatch's logprobs `[rows, local_seq]` with gradient, the graphs kept for `forward_backward`
        (PP = 1: this rank is the last stage). The training model and the loss pass's logprob call, so the
        values are the ones the loss pass would compute."""
        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        logits = forward_microbatches(self.optim.module, [mb.input_ids for mb in microbatches],
                                      position_ids=positions or None,
                                      output_starts=[mb.logit_start for mb in microbatches],
                                      packed=self._packs(microbatches))
        return [self._logprobs(mb, out) for mb, out in zip(microbatches, logits, strict=True)]

    def _logprobs(self, mb: Microbatch, logits: Tensor) -> Tensor:
        """`[rows, local_seq]` logprobs of the microbatch's tokens from its logits (next-token shift, CP labels, or
        the packed rows' logits unpacked)."""
        if mb.packed is not None:
            return self.policy.packed_logprobs(logits, mb.packed, **self.replay)
        if mb.labels is None:
            return self.policy.logprobs_from_logits(logits, mb.input_ids, start=mb.logit_start, **self.replay)
        return self.policy.label_logprobs(logits, mb.labels, **self.replay)

    def plan(self, microbatches: list[Microbatch], scored: Sequence[Scored], index: int) -> StepPlan:
        """The update's loss plan (`losses.step_plan.plan_step`); the `prepass` strategy scores first.

        Every stage joins the pre-pass schedule; only the last stage plans (the others get an empty plan).
        """
        current = self._score(self.policy, microbatches) if self.strategy == "prepass" else None
        if not self.policy.is_last_stage:
            return StepPlan(self.strategy, None, None, {})
        reference: list[Tensor] | None = current
        if current is not None and self.uses_loglinear:  # the pre-pass judges the interpolated pi_old
            reference = [loglinear_old_logprobs(mb.rollout_logprobs, cur, self.loglinear_alpha(mb, index))
                         for mb, cur in zip(microbatches, current, strict=True)]
        if reference is None and not self.rc_cfg.bypass_mode:  # decoupled: the forward's pi_old
            reference = [s.old_logprobs for s in scored if s.old_logprobs is not None]
        return plan_step(self.loss_fn, self.strategy, [mb.rollout_logprobs for mb in microbatches],
                         [mb.loss_mask for mb in microbatches], self.groups, reference_logprobs=reference,
                         advantages=[mb.advantages for mb in microbatches],
                         kl_coef=self.cfg.grpo.kl_coef, kl_estimator=self.cfg.grpo.kl_estimator,
                         segments=[mb.segments for mb in microbatches])

    def forward_backward(self, microbatches: list[Microbatch], scored: Sequence[Scored], plan: StepPlan,
                         index: int, *, logprobs: Sequence[Tensor] | None = None,
                         ) -> tuple[StepStats, tuple[MicrobatchPass, ...]]:
        """Forward with gradient, loss and backward of every microbatch through Megatron's schedule on the
        DDP model; the schedule ends with Megatron's `finalize_model_grads` (dp x cp reduction, tied
        embeddings, the post-scaled division). Returns the pass's statistics (last stage) and per microbatch
        what it computed (empty on other stages).

        logprobs: per microbatch, logprobs already forwarded with their graphs (`_forward_with_graph`): the
        schedule then only computes the losses and backpropagates through those graphs.
        """
        self.optim.zero_grad()
        stats = StepStats()
        passes: dict[int, MicrobatchPass] = {}

        def loss_hook(i: int, logits: Tensor) -> tuple[Tensor, Tensor | None]:  # last stage
            current = logprobs[i] if logprobs is not None else self._logprobs(microbatches[i], logits)
            loss, count, passes[i] = self._microbatch_loss(microbatches[i], scored[i], plan, i, index, current, stats)
            return loss, count

        positions = [mb.position_ids for mb in microbatches if mb.position_ids is not None]
        # With `logprobs` the schedule is handed each one as its "output" (the loss hook ignores it): the
        # backward of the loss reaches the model through the kept graph.
        run_microbatches(self.optim.module, [mb.input_ids for mb in microbatches], loss_hook,
                         forward_only=False, position_ids=positions or None,
                         outputs=list(logprobs) if logprobs is not None else None,
                         output_starts=[mb.logit_start for mb in microbatches], packed=self._packs(microbatches))
        return stats, tuple(passes[i] for i in sorted(passes))

    def _microbatch_loss(self, mb: Microbatch, scored: Scored, plan: StepPlan, i: int, index: int,
                         logprobs: Tensor, stats: StepStats) -> tuple[Tensor, Tensor | None, MicrobatchPass]:
        """Microbatch `i`'s loss of update `index` from its logprobs `[rows, local_seq]` with gradient (last
        stage); adds to the pass's `stats`."""
        old = scored.old_logprobs
        if self.uses_loglinear:
            old = self._loglinear_old_logprobs(mb, scored, logprobs, index, stats)
        loss, count = microbatch_loss(plan, self.loss_fn, i, logprobs, mb.rollout_logprobs, mb.advantages,
                                      mb.loss_mask, self.groups, stats, old_logprobs=old,
                                      ref_logprobs=scored.ref_logprobs, segments=mb.segments)
        if mb.segments is not None:  # multi-turn: the mismatch by turn index (rollout_corr/turn_<k>/*)
            reference = old if old is not None else logprobs
            for key, value in turn_mismatch_sums(reference, mb.rollout_logprobs, mb.loss_mask, mb.segments.ids,
                                                 mb.segments.count).items():
                stats.add(key, value)
        if mb.token_staleness is not None:  # the mismatch by token staleness (rollout_corr/lag_<L>/*)
            reference = old if old is not None else logprobs
            rollout = self.cfg.rollout
            num_lags = 1 + max_token_staleness(rollout.max_staleness, rollout.partial_max_tokens_per_step,
                                               rollout.max_new_tokens)
            for key, value in staleness_mismatch_sums(reference, mb.rollout_logprobs, mb.loss_mask,
                                                      mb.token_staleness, num_lags).items():
                stats.add(key, value)
        interpolated = old if self.uses_loglinear else None
        return loss, count, MicrobatchPass(logprobs=logprobs.detach(), old_logprobs=interpolated)

    def loglinear_alpha(self, mb: Microbatch, index: int) -> Tensor:
        """AReaL's interpolation weight for the step's `index`-th update (`core.loglinear.loglinear_alpha`).

        Versions count this step's optimizer updates. The step is synchronous: the engine sampled with the
        weights pi_old has (v_b = v_old = 0), and the k-th update trains v_theta = k. So alpha = 1 for the first
        update (pi_old is the current policy exactly) and 0 after it (pi_old falls back to the rollout policy).
        With async rollouts (`mb.staleness` set) a row sampled d steps ago has v_b = -d x (updates per step), so
        alpha = d U / (k + d U): still 1 for the first update, and between 0 and 1 after it.
        """
        if mb.staleness is None:
            return loglinear_alpha(0, 0, index)
        # Async: row r was sampled d_r steps ago, i.e. d_r x (updates per step) updates before pi_old.
        per_step = self.cfg.grpo.num_mini_batches * self.cfg.grpo.ppo_epochs
        behave = -(mb.staleness.to(torch.float64) * per_step)[:, None]  # [rows, 1]
        return loglinear_alpha(behave, 0, index)

    def _loglinear_old_logprobs(self, mb: Microbatch, scored: Scored, logprobs: Tensor, index: int,
                                stats: StepStats) -> Tensor:
        """`old_logprobs` `[rows, local_seq]` interpolated from the rollout and the loss pass's logprobs; on check
        steps the error against the forward's pi_old is added to `stats` (summed over dp x cp by `finish_step`)."""
        old = loglinear_old_logprobs(mb.rollout_logprobs, logprobs, self.loglinear_alpha(mb, index))
        if scored.check_old_logprobs is not None:
            partials = loglinear_error_partials(old, scored.check_old_logprobs, mb.loss_mask)
            for key in ("abs_error_sum", "sq_error_sum", "num_tokens"):
                stats.add(f"loglinear_{key}", float(partials[key]))
        return old

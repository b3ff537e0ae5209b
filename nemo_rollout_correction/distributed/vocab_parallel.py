"""Vocab-parallel logprobs of the sampled tokens from tensor-parallel (TP) sharded logits.

Megatron-Core's output layer is column-parallel: each TP rank holds the logits of a contiguous
slice of the vocabulary, `[..., vocab / tp]`. `vocab_parallel_logprobs` returns, on every TP rank,
the log-probability of each sampled token under the full-vocabulary softmax (fp32, replicated
across TP: docs/design.md's reduction contract then forbids reducing anything over TP again), with
optional entropy, and optionally replays vLLM's sampler (temperature, top-k, top-p) so the
trainer's logprobs live on the same support as vLLM's `processed_logprobs`.

How it is computed (N = number of tokens, V_l = vocab / tp):

- no top-k / top-p: the row maximum is MAX-all-reduced over TP (`[N]` fp32), then ONE SUM
  all-reduce carries `[N, 3]` (or `[N, 4]` with entropy) per-row partials: the sum of
  `exp(x - max)` over the shard, the shifted target logit from the rank that owns the target id
  (0 elsewhere), an ownership/support code, and `sum exp(x - max) * (x - max)` for the entropy.
  Two collectives, `16 N` (`20 N`) bytes contributed per rank.
- top-k and/or top-p: the support threshold (the smallest kept logit of each row) is found from
  each rank's local top candidates: ONE all-gather of `[N, c + 3]` fp32 (c local top values, the
  c-th value, how many shard entries equal it, and the shard's log-sum-exp), which determines the
  global maximum, the global k-th value and the exact top-p cut whenever the nucleus lies within
  the gathered candidates (always with top-k, where c = k). Rows whose nucleus does not fit are
  re-gathered with 32x more candidates, and finally with the whole shard (the exact fallback);
  then the same SUM all-reduce as above, restricted to the kept support.

The math lives in plain functions (`scaled_logits`, `local_candidates`,
`support_from_candidates`, `shard_partials`, `finish_partials`, `logits_grad`); the collectives
live only in `_VocabParallelLogprob`, a thin `torch.autograd.Function` whose backward is local to
the shard (`(onehot - softmax) / T` over the kept support, plus the entropy term) and issues no
collective. The caller's logits are never modified; fp32 copies are made as needed and the
softmax is recomputed in backward from the saved input shard instead of keeping an fp32
`[N, V_l]` buffer alive.

With `tp_group` None or of size 1 the result is `torch.log_softmax(...).gather(...)` on one
process, bit for bit, and no collective is issued.

See docs/vocab_parallel.md for the sampling-replay semantics against vLLM and NeMo-RL, the
collective count and bytes per call, and what is verified on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from nemo_rollout_correction.distributed.reduce import all_gather_flat

__all__ = [
    "ESCALATION_FACTOR",
    "STATUS_KEPT",
    "STATUS_OUT_OF_SUPPORT",
    "SamplingReplay",
    "SupportThreshold",
    "active_filters",
    "finish_partials",
    "local_candidates",
    "logits_grad",
    "scaled_logits",
    "shard_partials",
    "support_counts",
    "support_from_candidates",
    "vocab_parallel_logprobs",
]

NEG_INF = float("-inf")
ESCALATION_FACTOR = 32
"""Top-p rows whose nucleus does not fit in the gathered candidates are re-gathered with this many
times more candidates per rank (then with the whole shard)."""

STATUS_OUT_OF_SUPPORT = 1.0
"""Summed status code of a row whose target is owned by exactly one rank and filtered out."""
STATUS_KEPT = 3.0
"""Summed status code of a row whose target is owned by exactly one rank and kept (owned + 2 * kept)."""


# ---- configuration -----------------------------------------------------------------------------


def active_filters(top_k: int | None, top_p: float | None) -> tuple[int | None, float | None]:
    """vLLM's convention for disabled sampling filters, the one place it is written: `top_k` None or <= 0
    (vLLM's 0 / -1) and `top_p` None or >= 1 mean no filtering and come back as None."""
    k = None if top_k is None or top_k <= 0 else int(top_k)
    p = None if top_p is None or top_p >= 1.0 else float(top_p)
    return k, p


@dataclass(frozen=True)
class SamplingReplay:
    """vLLM's sampling transformations to replay, normalised (disabled filters are None).

    Build with `SamplingReplay.create(...)`, which validates and applies vLLM's conventions for
    disabled filters.
    """

    temperature: float = 1.0
    """Logits are divided by this (> 0) before anything else."""
    top_k: int | None = None
    """Keep the tokens whose scaled logit is >= the k-th largest (ties kept); None: disabled."""
    top_p: float | None = None
    """Keep the smallest top set with mass >= top_p (tie-inclusive); None: disabled."""
    top_p_candidates: int = 64
    """Local candidates per rank gathered first for top-p without top-k (escalates as needed)."""

    @classmethod
    def create(cls, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, *,
               vocab_size: int, top_p_candidates: int = 64) -> SamplingReplay:
        """Validate and normalise: `top_k` None, <= 0 (vLLM's 0 / -1) or >= `vocab_size` and
        `top_p` None or >= 1 mean no filtering, as in vLLM. Raises ValueError on a non-positive or
        non-finite temperature (greedy decoding has no distribution to replay), on `top_p <= 0`
        and on `top_p_candidates < 1`."""
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r} (vLLM treats "
                             "temperature < 1e-5 as greedy decoding, which has no distribution to replay)")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
            raise ValueError(f"top_k must be an int or None, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and math.isfinite(top_p) and top_p > 0):
            raise ValueError(f"top_p must lie in (0, 1] (1 disables it), got {top_p!r}")
        if top_p_candidates < 1:
            raise ValueError(f"top_p_candidates must be >= 1, got {top_p_candidates}")
        k, p = active_filters(top_k, top_p)
        if k is not None and k >= vocab_size:
            k = None
        return cls(float(temperature), k, p, int(top_p_candidates))

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p filtering is active."""
        return self.top_k is not None or self.top_p is not None

    @property
    def first_candidates(self) -> int:
        """Candidates per rank of the first gather: k with top-k (always enough), else the top-p setting."""
        return self.top_k if self.top_k is not None else self.top_p_candidates


# ---- pure math (no collectives) ----------------------------------------------------------------


def scaled_logits(logits: Tensor, temperature: float, *, vocab_start: int = 0, vocab_size: int | None = None
                  ) -> Tensor:
    """fp32 logits divided by the temperature, with ids >= `vocab_size` (vocab padding) set to -inf.

    logits: `[..., V_l]` any float dtype; the shard of global ids `[vocab_start, vocab_start + V_l)`.
    Returns `[..., V_l]` float32. Never writes to `logits`; it may return `logits` itself (fp32,
    temperature 1, no padding), so callers must not write to the result either. Differentiable.
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    width = x.shape[-1]
    if vocab_size is not None and vocab_start + width > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + width, device=x.device)
        x = x.masked_fill(ids >= vocab_size, NEG_INF)
    return x


def local_candidates(x: Tensor, num: int, *, ties: bool = True, log_normalizer: bool = True) -> Tensor:
    """The payload a rank contributes to the support search: `[N, num + 3]` float32.

    x: `[N, V_l]` scaled fp32 logits of this rank's shard.
    Columns: the `num` largest values in descending order (when `V_l <= num`: the whole shard,
    unsorted, padded with -inf: the search sorts the merged lists anyway);
    the `num`-th largest value `L` (-inf when the whole shard fits, i.e. the list is complete);
    the number of shard entries equal to `L` (0 when complete); the shard's log-sum-exp.
    Every global token whose logit is > max over ranks of `L` is in the union of the lists, and
    the counts recover the exact multiplicity of that boundary value (see
    `support_from_candidates`). The last two columns cost a pass over the shard each; with
    `ties` / `log_normalizer` False they are left 0 (top-k alone needs neither, top-k with top-p
    needs no log-normaliser).
    """
    rows, width = x.shape
    out = x.new_zeros(rows, num + 3)
    if width <= num:  # complete: nothing of this shard lies below the list
        out[:, :width] = x
        out[:, width:num + 1] = NEG_INF
    else:
        out[:, :num] = x.topk(num, dim=-1, sorted=True).values
        boundary = out[:, num - 1]
        out[:, num] = boundary
        if ties:
            out[:, num + 1] = (x == boundary[:, None]).sum(dim=-1)
    if log_normalizer:
        out[:, num + 2] = torch.logsumexp(x, dim=-1) if width else NEG_INF
    return out


@dataclass(frozen=True)
class SupportThreshold:
    """Per-row outcome of the support search (all `[N]`)."""

    threshold: Tensor
    """float32: the smallest kept scaled logit; a token is kept iff its scaled logit >= this."""
    row_max: Tensor
    """float32: the global maximum scaled logit of the row."""
    resolved: Tensor
    """bool: whether the gathered candidates determined the threshold (else gather more)."""


def support_from_candidates(gathered: Tensor, replay: SamplingReplay) -> SupportThreshold:
    """The global top-k / top-p threshold of each row from every rank's `local_candidates`.

    gathered: `[tp, N, c + 3]` float32, rank r's payload at index r (identical on every rank).
    Semantics (vLLM's sort-based `apply_top_k_top_p`): top-k keeps the tokens whose logit is >= the
    global k-th largest (ties kept); top-p then keeps a token iff the probability mass of the
    tokens with a strictly larger logit, under the softmax of the top-k-filtered logits, is
    < top_p. The largest token is always kept. Mass comparisons run in float64.

    Exactness: with `L` = the largest per-rank boundary value, every token > `L` is in the gathered
    lists and the number of tokens == `L` is known exactly, so the multiset of logits >= `L` is
    known. A top-k threshold is >= `L` (c >= k); a top-p cut is determined when the known tokens
    carry mass >= top_p (everything below `L` is then dropped) or nothing lies below `L`.
    `resolved` is False where neither holds.
    """
    tp, rows, width = gathered.shape
    num = width - 3
    per_rank = gathered.permute(1, 0, 2)  # [N, tp, c + 3]
    lists = per_rank[..., :num]  # [N, tp, c]
    bound_r, ties_r, lse_r = per_rank[..., num], per_rank[..., num + 1], per_rank[..., num + 2]
    values = lists.reshape(rows, tp * num)
    row_max = values.amax(dim=-1) if values.numel() else values.new_empty(rows)
    threshold = values.new_full((rows,), NEG_INF)
    resolved = torch.ones(rows, dtype=torch.bool, device=values.device)
    if replay.top_k is not None:
        if replay.top_k > tp * num:
            raise ValueError(f"top_k={replay.top_k} needs at least {replay.top_k} candidates, got {tp * num}")
        threshold = values.topk(replay.top_k, dim=-1).values[:, -1]
    if replay.top_p is None:
        return SupportThreshold(threshold, row_max, resolved)

    bound = bound_r.amax(dim=-1)  # [N]
    # Exact number of global tokens equal to the boundary value.
    in_lists = (lists == bound[:, None, None]).sum(dim=-1).to(torch.float64)
    count_bound = torch.where(bound_r == bound[:, None], ties_r.to(torch.float64), in_lists).sum(dim=-1)
    above = values > bound[:, None]
    cand = torch.cat([torch.where(above, values, NEG_INF), bound[:, None]], dim=-1)  # [N, tp*c + 1]
    weight = torch.cat([above.to(torch.float64), count_bound[:, None]], dim=-1)
    cand, order = cand.sort(dim=-1, descending=True)
    weight = weight.gather(-1, order)
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0).to(torch.float64)
    mass = weight * torch.exp(cand.to(torch.float64) - shift[:, None])  # unnormalised probabilities
    in_k = cand >= threshold[:, None]
    if replay.top_k is not None:
        mass = torch.where(in_k, mass, 0.0)
        total = mass.sum(dim=-1)
    else:
        total = torch.exp(lse_r.to(torch.float64) - shift[:, None]).sum(dim=-1)
    # Exclusive cumulative mass in descending order. At the first entry of a group of equal values
    # it is the mass of the strictly larger logits, so the cut (the smallest value whose first
    # entry passes) keeps whole tie groups, whatever their order inside the sort.
    before = torch.cumsum(mass, dim=-1) - mass
    keep = (before / total[:, None] < replay.top_p) & (weight > 0) & in_k
    cut = torch.where(keep, cand, float("inf")).amin(dim=-1) if cand.numel() else threshold
    threshold = torch.maximum(threshold, cut)
    if replay.top_k is None:
        known = mass.sum(dim=-1)
        resolved = (bound == NEG_INF) | (known / total >= replay.top_p)
    return SupportThreshold(threshold, row_max, resolved)


def shard_partials(x: Tensor, row_max: Tensor, threshold: Tensor | None, local_target: Tensor, owned: Tensor,
                   *, entropy: bool) -> Tensor:
    """This shard's SUM-reducible partials of each row: `[N, 3]` (`[N, 4]` with entropy) float32.

    x: `[N, V_l]` scaled fp32 logits; row_max: `[N]` global row maximum; threshold: `[N]` smallest
    kept logit (None: keep everything); local_target: `[N]` int64 target index inside the shard
    (any value where not owned); owned: `[N]` bool, whether this shard holds the target id.
    Columns: `sum exp(x - max)` over the kept entries; the target's `x - max` where owned (else 0);
    a status code `owned + 2 * (owned and kept)` (its sum over ranks is `STATUS_KEPT` or
    `STATUS_OUT_OF_SUPPORT` for a valid target); with entropy, `sum exp(x - max) * (x - max)`.
    """
    rows, width = x.shape
    shifted = x - row_max[:, None]
    if threshold is not None:
        shifted.masked_fill_(x < threshold[:, None], NEG_INF)  # a fresh tensor: exp() gives 0 off the support
    exp = shifted.exp()
    out = x.new_empty(rows, 4 if entropy else 3)
    out[:, 0] = exp.sum(dim=-1)
    index = local_target.clamp(0, max(width - 1, 0))[:, None]
    target = x.gather(-1, index).squeeze(-1) if width else x.new_zeros(rows)
    target_kept = owned if threshold is None else owned & (target >= threshold)
    out[:, 1] = torch.where(owned, target - row_max, 0.0)
    out[:, 2] = owned.to(x.dtype) + 2.0 * target_kept.to(x.dtype)
    if entropy:
        out[:, 3] = torch.where(exp > 0, exp * shifted, 0.0).sum(dim=-1)
    return out


def finish_partials(reduced: Tensor, *, entropy: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """Logprobs, entropy and log-normaliser from the TP-summed `shard_partials` (`[N]` each, fp32).

    logprob: `x_t - max - log Z` where the target is kept; -inf where it is filtered out (outside
    the replayed sampler's support); NaN where no rank (or more than one) owns the target id.
    entropy: `log Z - sum exp(x - max) (x - max) / Z` over the kept support (None unless asked).
    log_z: `log Z`, `Z = sum_kept exp(x - max)`.
    """
    log_z = reduced[:, 0].log()
    status = reduced[:, 2]
    logprob = torch.where(status == STATUS_KEPT, reduced[:, 1] - log_z,
                          torch.where(status == STATUS_OUT_OF_SUPPORT, NEG_INF, float("nan")))
    ent = log_z - reduced[:, 3] / reduced[:, 0] if entropy else None
    return logprob, ent, log_z


def logits_grad(x: Tensor, row_max: Tensor, log_z: Tensor, threshold: Tensor | None, local_target: Tensor,
                target_kept: Tensor, grad_logprob: Tensor | None, entropy: Tensor | None,
                grad_entropy: Tensor | None, temperature: float) -> Tensor:
    """Gradient w.r.t. the shard's raw logits: `[N, V_l]` float32, local (no collective).

    With p the kept-support softmax (0 off the support) and g, h the incoming gradients of the
    logprob and the entropy of each row: `(g * (onehot(target) - p) - h * p * (log p + H)) / T`,
    the onehot only where the target is owned and kept: exactly what autograd gives for
    `log_softmax(masked_fill(x / T, ~kept, -inf))` (the filter is a constant mask).
    """
    logp = (x - row_max[:, None]).sub_(log_z[:, None])
    if threshold is not None:
        logp.masked_fill_(x < threshold[:, None], NEG_INF)
    prob = logp.exp()
    term: Tensor | None = None
    if grad_entropy is not None and entropy is not None:
        # where(), not a product with a mask: p * log p is 0 * -inf off the support.
        term = torch.where(prob > 0, prob * logp.add_(entropy[:, None]), 0.0).mul_(grad_entropy[:, None])
    del logp
    grad = prob.zero_() if grad_logprob is None else prob.mul_(-grad_logprob[:, None])
    if grad_logprob is not None and x.shape[-1]:
        index = local_target.clamp(0, x.shape[-1] - 1)[:, None]
        grad.scatter_add_(-1, index, torch.where(target_kept, grad_logprob, 0.0)[:, None])
    if term is not None:
        grad.sub_(term)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def support_counts(logprobs: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
    """How many (masked) tokens fell outside the replayed support (-inf) or had an invalid id (NaN).

    Returns int64 scalar tensors `num_out_of_support_tokens` and `num_invalid_target_tokens` (no
    host sync). Values are replicated across TP: add them to the dp x cp partials, never reduce
    them over TP. A non-zero out-of-support count means vLLM sampled a token the trainer's replay
    of its sampler excludes: a support mismatch (different logits near the cut, or different
    sampling parameters), not something vLLM could have produced from these logits.
    """
    select = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask.bool()
    return {
        "num_out_of_support_tokens": (torch.isneginf(logprobs) & select).sum(),
        "num_invalid_target_tokens": (torch.isnan(logprobs) & select).sum(),
    }


# ---- the support search, given a gather --------------------------------------------------------


Gather = Callable[[Tensor], Tensor]


def _support(x: Tensor, replay: SamplingReplay, gather: Gather) -> SupportThreshold:
    """Support search with escalation: gather candidates, re-gather unresolved rows with more.

    Every rank holds the same gathered tensors and runs the same deterministic math on them, so
    all ranks agree on the unresolved rows (and thus on the shape of the next gather). Checking
    for unresolved rows is one host sync per round, only for top-p without top-k.
    """
    num = replay.first_candidates
    need = {"ties": replay.top_p is not None, "log_normalizer": replay.top_p is not None and replay.top_k is None}
    found = support_from_candidates(gather(local_candidates(x, num, **need)), replay)
    if replay.top_p is None or replay.top_k is not None:
        return found  # top-k bounds the candidates: always resolved
    threshold, row_max, resolved = found.threshold, found.row_max, found.resolved
    width = x.shape[-1]
    while not bool(resolved.all()):
        if num >= width:  # complete lists leave nothing below the boundary: cannot happen
            raise RuntimeError("internal error: top-p support unresolved with complete candidate lists")
        rows = (~resolved).nonzero().squeeze(-1)
        num = min(num * ESCALATION_FACTOR, width)  # same on every rank: shards have equal widths
        again = support_from_candidates(gather(local_candidates(x[rows], num, **need)), replay)
        threshold = threshold.index_copy(0, rows, again.threshold)
        resolved = resolved.index_copy(0, rows, again.resolved)
    return SupportThreshold(threshold, row_max, resolved)


# ---- the autograd Function (collectives live here) ---------------------------------------------


@dataclass(frozen=True)
class _Call:
    """Non-tensor arguments of one call."""

    replay: SamplingReplay
    vocab_start: int
    vocab_size: int | None
    entropy: bool
    group: ProcessGroup
    group_size: int


class _VocabParallelLogprob(torch.autograd.Function):
    """Forward: the TP collectives and the shard math. Backward: local gradient, no collective."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, local_target: Tensor, owned: Tensor,
                call: _Call) -> tuple[Tensor, Tensor]:
        width = logits.shape[-1]
        x = scaled_logits(logits.reshape(-1, width), call.replay.temperature, vocab_start=call.vocab_start,
                          vocab_size=call.vocab_size)
        threshold: Tensor | None = None
        if call.replay.filters:
            def gather(payload: Tensor) -> Tensor:
                return all_gather_flat(payload, group=call.group, group_size=call.group_size)

            found = _support(x, call.replay, gather)
            row_max, threshold = found.row_max, found.threshold
        else:
            row_max = x.amax(dim=-1) if width else x.new_full((x.shape[0],), NEG_INF)
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=call.group)
        partials = shard_partials(x, row_max, threshold, local_target, owned, entropy=call.entropy)
        dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=call.group)
        logprob, ent, log_z = finish_partials(partials, entropy=call.entropy)
        target_kept = owned & (partials[:, 2] == STATUS_KEPT)
        placeholder = ent if ent is not None else logprob.new_zeros(0)
        ctx.save_for_backward(logits, local_target, target_kept, row_max, log_z,
                              threshold if threshold is not None else row_max.new_zeros(0), placeholder)
        ctx.call = call
        ctx.set_materialize_grads(False)
        if ent is None:
            ctx.mark_non_differentiable(placeholder)
        shape = logits.shape[:-1]
        return logprob.view(shape), placeholder.view(shape) if ent is not None else placeholder

    @staticmethod
    @once_differentiable  # the saved statistics are constants: no honest second derivative
    def backward(ctx: Any, grad_logprob: Tensor | None, grad_entropy: Tensor | None
                 ) -> tuple[Tensor | None, None, None, None]:
        logits, local_target, target_kept, row_max, log_z, threshold, ent = ctx.saved_tensors
        call: _Call = ctx.call
        if grad_logprob is None and (grad_entropy is None or not call.entropy):
            return None, None, None, None
        width = logits.shape[-1]
        x = scaled_logits(logits.reshape(-1, width), call.replay.temperature, vocab_start=call.vocab_start,
                          vocab_size=call.vocab_size)
        grad = logits_grad(
            x, row_max, log_z, threshold if call.replay.filters else None, local_target, target_kept,
            None if grad_logprob is None else grad_logprob.reshape(-1).float(),
            ent if call.entropy else None,
            None if grad_entropy is None or not call.entropy else grad_entropy.reshape(-1).float(),
            call.replay.temperature,
        )
        return grad.view(logits.shape).to(logits.dtype), None, None, None


# ---- the entry point ---------------------------------------------------------------------------


@overload
def vocab_parallel_logprobs(logits_shard: Tensor, target_ids: Tensor, tp_group: ProcessGroup | None = None, *,
                            vocab_start: int | None = None, vocab_size: int | None = None,
                            temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                            return_entropy: Literal[False] = False, top_p_candidates: int = 64) -> Tensor: ...


@overload
def vocab_parallel_logprobs(logits_shard: Tensor, target_ids: Tensor, tp_group: ProcessGroup | None = None, *,
                            vocab_start: int | None = None, vocab_size: int | None = None,
                            temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                            return_entropy: Literal[True], top_p_candidates: int = 64) -> tuple[Tensor, Tensor]: ...


def vocab_parallel_logprobs(
    logits_shard: Tensor,
    target_ids: Tensor,
    tp_group: ProcessGroup | None = None,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    return_entropy: bool = False,
    top_p_candidates: int = 64,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of `target_ids` under the full-vocabulary (processed) distribution.

    logits_shard: `[batch, seq, V_l]` (any leading shape), any float dtype: this TP rank's slice of
        the vocabulary, global ids `[vocab_start, vocab_start + V_l)`. Computed in fp32; never
        modified.
    target_ids: `[batch, seq]` (the leading shape of `logits_shard`) global vocabulary ids.
    tp_group: the tensor-parallel group; None or size 1: one process, no collective, and the result
        equals `torch.log_softmax(processed logits.float(), -1).gather(...)` exactly.
    vocab_start: first global id of this shard (default `tp_rank * V_l`, Megatron's layout).
    vocab_size: the real vocabulary size when the model's vocabulary is padded (Megatron pads to a
        multiple of 128 * tp); ids >= vocab_size are excluded from the softmax, as vLLM slices its
        logits to the real vocabulary. None: every column is a real token.
    temperature, top_k, top_p: vLLM's sampler to replay (in vLLM's order: divide by temperature,
        top-k, then top-p on the top-k-renormalised distribution; see `SamplingReplay.create` for
        the disabled values and docs/vocab_parallel.md for tie semantics).
    return_entropy: also return the entropy of the (processed) distribution.
    top_p_candidates: local candidates per rank gathered first for top-p without top-k.

    Returns logprobs `[batch, seq]` float32 (and entropy `[batch, seq]` float32), identical on every
    TP rank. A target filtered out by top-k / top-p gets -inf (vLLM could not have sampled it:
    count these with `support_counts`); a target id outside the vocabulary gets NaN. Gradients
    flow to `logits_shard` as through `log_softmax` of the filtered logits (the filter is a
    constant mask); the backward issues no collective. Every rank of `tp_group` must call this
    with the same arguments and shapes.
    """
    if logits_shard.dim() < 1 or tuple(target_ids.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"target_ids {tuple(target_ids.shape)} must have the leading shape of logits_shard "
                         f"{tuple(logits_shard.shape)}")
    if not logits_shard.is_floating_point():
        raise ValueError(f"logits_shard must be a floating-point tensor, got {logits_shard.dtype}")
    group_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    width = logits_shard.shape[-1]
    start = rank * width if vocab_start is None else int(vocab_start)
    total = vocab_size if vocab_size is not None else width * group_size
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    replay = SamplingReplay.create(temperature, top_k, top_p, vocab_size=total, top_p_candidates=top_p_candidates)
    target = target_ids.to(device=logits_shard.device, dtype=torch.int64)
    if group_size == 1:
        return _single_process(logits_shard, target, replay, start, vocab_size, return_entropy)
    assert tp_group is not None
    flat = target.reshape(-1)
    local = flat - start
    owned = (local >= 0) & (local < width)
    if vocab_size is not None:
        owned = owned & (flat < vocab_size)
    call = _Call(replay, start, vocab_size, return_entropy, tp_group, group_size)
    logprob, ent = _VocabParallelLogprob.apply(logits_shard, local, owned, call)  # type: ignore[no-untyped-call]
    return (logprob, ent) if return_entropy else logprob


def _single_process(logits: Tensor, target: Tensor, replay: SamplingReplay, vocab_start: int,
                    vocab_size: int | None, entropy: bool) -> Tensor | tuple[Tensor, Tensor]:
    """TP = 1: plain autograd through `torch.log_softmax` of the processed logits; no collective."""
    width = logits.shape[-1]
    x = scaled_logits(logits, replay.temperature, vocab_start=vocab_start, vocab_size=vocab_size)
    if replay.filters:
        with torch.no_grad():
            flat = x.detach().reshape(-1, width)
            found = _support(flat, replay, lambda payload: payload.unsqueeze(0))
            dropped = (flat < found.threshold[:, None]).view(x.shape)
        x = x.masked_fill(dropped, NEG_INF)
    logp = torch.log_softmax(x, dim=-1)
    local = target - vocab_start
    valid = (local >= 0) & (local < width)
    if vocab_size is not None:
        valid = valid & (target < vocab_size)
    index = local.clamp(0, max(width - 1, 0)).unsqueeze(-1)
    logprob = torch.where(valid, logp.gather(-1, index).squeeze(-1), float("nan"))
    if not entropy:
        return logprob
    # where(), not a product with a mask: p * log p is 0 * -inf off the support.
    ent = -(logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)).sum(dim=-1)
    return logprob, ent

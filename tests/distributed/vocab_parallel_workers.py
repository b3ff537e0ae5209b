"""Data, single-process references and the gloo worker for the vocab-parallel logprob tests.

One launch of 4 spawned ranks runs every case on three layouts side by side: TP4 (ranks 0-3),
TP2 (pairs {0,1} and {2,3}, the same data on both pairs) and TP1 (each rank alone, a real
process group of size 1). Each rank returns its logprobs, entropies, the gradient of its logits
shard and every collective it issued; `test_vocab_parallel` reassembles the shards and compares
them with the references below on the full logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from dist_workers import CollectiveCounter
from torch import Tensor

from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs

V = 40
"""Vocabulary of the small cases: shards of 10 ids (TP4) and 20 ids (TP2)."""
V_WIDE = 256
"""Vocabulary of the wide cases (shards of 64 / 128), where top-p has to escalate."""
BOUNDARY_IDS = (0, 9, 10, 19, 20, 29, 30, 39)
"""The first and last id of every TP4 and TP2 shard."""


# ---- data --------------------------------------------------------------------------------------


def _targets(logits: Tensor, gen: torch.Generator, *, unlikely: bool) -> Tensor:
    """Random targets, with every shard-boundary id present and, with `unlikely`, some of the least
    likely ids (outside any top-k / top-p support)."""
    batch, seq, vocab = logits.shape
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    flat = target.view(-1)
    ids = [i for i in BOUNDARY_IDS if i < vocab]
    flat[: len(ids)] = torch.tensor(ids)
    if unlikely:
        least = logits.reshape(-1, vocab).argmin(dim=-1)
        flat[len(ids)::3] = least[len(ids)::3]
    return target


def make_data() -> dict[str, tuple[Tensor, Tensor]]:
    """Named (full logits `[batch, seq, vocab]`, targets `[batch, seq]`), identical on every process."""
    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(3, 5, V, generator=gen) * 3.0
    data: dict[str, tuple[Tensor, Tensor]] = {"base": (base, _targets(base, gen, unlikely=True))}
    data["bf16"] = (base.to(torch.bfloat16), data["base"][1])
    data["extreme"] = (base * 1e4, data["base"][1])
    ties = (torch.randn(3, 5, V, generator=gen) * 1.5).round() * 0.5  # many exactly equal logits
    data["ties"] = (ties, _targets(ties, gen, unlikely=True))
    # Wide rows: peaked (small nucleus) and nearly flat (top-p nucleus larger than the candidates).
    scale = torch.tensor([0.05, 0.3, 1.0, 4.0])[torch.arange(2 * 6) % 4].view(2, 6, 1)
    wide = torch.randn(2, 6, V_WIDE, generator=gen) * scale
    data["wide"] = (wide, _targets(wide, gen, unlikely=True))
    data["empty"] = (torch.zeros(2, 0, V), torch.zeros(2, 0, dtype=torch.int64))
    return data


@dataclass(frozen=True)
class Case:
    """One call of `vocab_parallel_logprobs`."""

    data: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    entropy: bool = False


CASES: dict[str, Case] = {
    "plain": Case("base"),
    "plain_entropy": Case("base", entropy=True),
    "bf16": Case("bf16", entropy=True),
    "temperature": Case("base", {"temperature": 0.7}, entropy=True),
    "top_k": Case("base", {"top_k": 5}),
    "top_p": Case("base", {"top_p": 0.9}, entropy=True),
    "top_k_top_p": Case("base", {"top_k": 5, "top_p": 0.9, "temperature": 0.7}, entropy=True),
    "top_p_escalates": Case("base", {"top_p": 0.9, "top_p_candidates": 2}),
    "extreme": Case("extreme", entropy=True),
    "extreme_top_k_top_p": Case("extreme", {"top_k": 5, "top_p": 0.9}),
    "ties_top_k": Case("ties", {"top_k": 5}),
    "ties_top_p": Case("ties", {"top_p": 0.8, "top_p_candidates": 3}, entropy=True),
    "ties_top_k_top_p": Case("ties", {"top_k": 4, "top_p": 0.7}),
    "bf16_top_k_top_p": Case("bf16", {"top_k": 5, "top_p": 0.9, "temperature": 1.3}),
    "padded_vocab": Case("base", {"vocab_size": V - 3, "top_p": 0.95}, entropy=True),
    "wide_top_p": Case("wide", {"top_p": 0.9, "top_p_candidates": 4}, entropy=True),
    "wide_top_p_default": Case("wide", {"top_p": 0.95, "temperature": 0.8}),
    "wide_top_k_top_p": Case("wide", {"top_k": 50, "top_p": 0.9}),
    "empty": Case("empty", {"top_p": 0.9}, entropy=True),
    "disabled_filters": Case("base", {"top_k": -1, "top_p": 1.0}),
}


# ---- single-process references -----------------------------------------------------------------


def processed_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None, vocab_size: int | None = None, **_: Any) -> Tensor:
    """Brute-force reference of the replayed sampler on full logits `[..., V]` (differentiable).

    Divide by the temperature, drop padded ids, top-k: keep logits >= the k-th largest; top-p: keep a
    token iff the mass of the strictly larger logits, under the softmax of the top-k-filtered
    logits, is < top_p (pairwise comparison, O(V^2): small V only). Filtered tokens get -inf.
    """
    x = logits.float() / temperature if temperature != 1.0 else logits.float()
    vocab = x.shape[-1]
    if vocab_size is not None:
        x = x.masked_fill(torch.arange(vocab) >= vocab_size, float("-inf"))
    with torch.no_grad():
        keep = torch.ones_like(x, dtype=torch.bool)
        if top_k is not None and 0 < top_k < (vocab_size or vocab):
            keep &= x >= x.topk(top_k, dim=-1).values[..., -1:]
        if top_p is not None and top_p < 1.0:
            probs = torch.softmax(torch.where(keep, x, float("-inf")).double(), dim=-1)
            larger = x.unsqueeze(-2) > x.unsqueeze(-1)  # [..., i, j]: x_j > x_i
            mass_above = (probs.unsqueeze(-2) * larger).sum(dim=-1)
            keep &= mass_above < top_p
    return x.masked_fill(~keep, float("-inf"))


def vllm_sort_support(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """The kept mask of vLLM's sort-based rule (ascending sort, k-th value from the top, mask
    cumulative mass <= 1 - p, always keep the largest), written independently for `[N, V]` fp32."""
    ordered, order = logits.sort(dim=-1)
    vocab = logits.shape[-1]
    if top_k is not None:
        ordered = ordered.masked_fill(ordered < ordered[:, vocab - top_k:vocab - top_k + 1], float("-inf"))
    if top_p is not None:
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    kept_sorted = torch.isfinite(ordered)
    return torch.zeros_like(kept_sorted).scatter(-1, order, kept_sorted)


def reference(logits: Tensor, target: Tensor, case: Case) -> dict[str, Tensor]:
    """Logprobs, entropy and the gradient of the test loss w.r.t. the full logits, in one process."""
    leaf = logits.clone().requires_grad_(True)
    z = processed_logits(leaf, **case.kwargs)
    logp = torch.log_softmax(z, dim=-1)
    vocab_size = case.kwargs.get("vocab_size", logits.shape[-1])
    valid = target < vocab_size
    lp = torch.where(valid, logp.gather(-1, target.clamp(max=logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1),
                     float("nan"))
    ent = -(logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)).sum(dim=-1)
    loss = objective(lp, ent if case.entropy else None)
    (grad,) = torch.autograd.grad(loss, leaf) if loss.requires_grad else (torch.zeros_like(leaf),)
    return {"logprobs": lp.detach(), "entropy": ent.detach(), "grad": grad}


def objective(logprobs: Tensor, entropy: Tensor | None) -> Tensor:
    """The scalar every layout differentiates: fixed weights on finite logprobs and on entropies."""
    n = logprobs.numel()
    weights = torch.linspace(-1.0, 2.0, max(n, 1))[:n].view(logprobs.shape)
    loss = torch.where(torch.isfinite(logprobs), logprobs * weights, 0.0).sum()
    if entropy is not None:
        loss = loss + (entropy * weights.flip(-1) * 0.5).sum()
    return loss


# ---- the worker --------------------------------------------------------------------------------


def _layouts(rank: int) -> dict[str, tuple[Any, int, int]]:
    """This rank's (group, group rank, group size) per layout; every process creates every group."""
    tp4 = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    return {"tp4": (tp4, rank, 4), "tp2": (pairs[rank // 2], rank % 2, 2), "tp1": (singles[rank], 0, 1)}


def _run_case(case: Case, logits: Tensor, target: Tensor, group: Any, tp_rank: int, tp: int,
              counter: CollectiveCounter) -> dict[str, Any]:
    width = logits.shape[-1] // tp
    shard = logits[..., tp_rank * width:(tp_rank + 1) * width].clone().requires_grad_(True)
    before = shard.detach().clone()
    counter.calls = []
    started = time.perf_counter()
    if case.entropy:
        lp, ent = vocab_parallel_logprobs(shard, target, group, return_entropy=True, **case.kwargs)
    else:
        lp, ent = vocab_parallel_logprobs(shard, target, group, **case.kwargs), None
    forward_calls = list(counter.calls)
    loss = objective(lp, ent)
    grad = torch.autograd.grad(loss, shard)[0] if loss.requires_grad else torch.zeros_like(shard)
    seconds = time.perf_counter() - started
    return {
        "logprobs": lp.detach(), "entropy": None if ent is None else ent.detach(), "grad": grad,
        "collectives": forward_calls, "backward_collectives": counter.calls[len(forward_calls):],
        "unchanged": torch.equal(before, shard.detach()), "lp_dtype": lp.dtype, "seconds": seconds,
    }


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """Every case on every layout this rank belongs to; results keyed by (layout, case)."""
    assert world_size == 4
    layouts = _layouts(rank)
    data = make_data()
    counter = CollectiveCounter()
    counter.install()
    results: dict[tuple[str, str], Any] = {}
    try:
        for layout, (group, tp_rank, tp) in layouts.items():
            counter.labels = {id(group): "tp"}
            for name, case in CASES.items():
                logits, target = data[case.data]
                results[(layout, name)] = _run_case(case, logits, target, group, tp_rank, tp, counter)
        # group=None is the one-process path too.
        counter.calls = []
        logits, target = data["base"]
        none_lp = vocab_parallel_logprobs(logits, target, None, top_k=5, top_p=0.9, return_entropy=True)
        results[("none", "top_k_top_p")] = {"logprobs": none_lp[0], "collectives": list(counter.calls)}
    finally:
        counter.uninstall()
    return {"results": results, "tp_rank": {name: info[1] for name, info in layouts.items()}}

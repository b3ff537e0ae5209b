"""What the 8 spawned gloo ranks of tests/distributed/test_eight_ranks.py run: TP2 x CP2 x DP2.

All eight processes form one `build_parallel_groups(tp=2, cp=2, dp=2)` layout in Megatron rank
order (TP fastest, then CP, then DP). On it, two families of scenarios run back to back:

- correction (reusing `dist_workers.run_step` and its data, configs and `CollectiveCounter`):
  the load-balanced CP layout, the contiguous one and the packed (THD) one, each with uneven
  microbatches per DP rank; per rank the shards of IS weights and masks, the step metrics, the
  per-token losses / gradients w.r.t. the logprobs and every collective it issued;
- loss modules on TP-sharded logits (reusing `loss_workers`' data and helpers): per config and
  aggregation mode, `RolloutCorrectedPolicyLoss` with the step pre-pass and the Megatron loss
  function with the per-token-loss schedule emulated, gradients w.r.t. this rank's logits shard.
"""

from __future__ import annotations

from typing import Any

import dist_workers
import loss_workers
import torch
from dist_workers import CollectiveCounter, Layout
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.distributed import ParallelGroups, build_parallel_groups, cp_token_indices
from nemo_rollout_correction.losses import MegatronLossBatch, StepDenominators, make_megatron_loss_func

WORLD = 8
TP, CP, DP = 2, 2, 2
RANKS = tuple(range(WORLD))

# Uneven on purpose: DP rank 0 has two microbatches, DP rank 1 one (rows of dist_workers' data).
_ROWS = (((0, 3), (3, 7)), ((7, 12),))
LAYOUTS: dict[str, Layout] = {
    "tp2_cp2_dp2": Layout(TP, CP, DP, 1, RANKS, rows=_ROWS),
    "tp2_cp2_dp2_contiguous": Layout(TP, CP, DP, 1, RANKS, cp_layout="contiguous", extremes="max", rows=_ROWS),
    "tp2_cp2_dp2_packed": Layout(TP, CP, DP, 1, RANKS, extremes="slots", packed=True, rows=_ROWS),
}

# The correction scenarios: every IS level (none / token / sequence / geometric) and mode
# (truncate / mask), two-sided and batch-normalised IS, every RS granularity (token, seq_sum,
# seq_mean, seq_max; k1/k2/k3), the veto, non-finite handling, metrics-only, bypass and pure IS.
CORRECTION_CONFIGS: tuple[str, ...] = (
    "none", "token_tis", "token_mis_bn", "token_tis_2sided_bn", "seq_tis_2sided", "seq_mis_veto", "seq_tis_bn",
    "geo_mis_bn", "geo_tis", "rs_seq_k1", "rs_token_mixed", "rs_token_k1_is_mask", "rs_token_k3_only",
    "rs_seq_mean_k2", "rs_metrics_only", "bypass_rs", "pure_is_seq", "pure_is_token_bn", "max_fraction_ok",
)
# Packed CP is the same math on another token order: a cheaper subset there.
PACKED_CONFIGS: tuple[str, ...] = ("token_tis_2sided_bn", "seq_mis_veto", "geo_mis_bn", "rs_token_mixed", "bypass_rs")


def configs_of(layout: str) -> tuple[str, ...]:
    return PACKED_CONFIGS if LAYOUTS[layout].packed else CORRECTION_CONFIGS


# The loss-module scenarios (on loss_workers' logits data): its configs plus geometric IS, token
# mask-mode IS and sequence-max / sequence-sum RS.
LOSS_CONFIGS: dict[str, RolloutCorrectionConfig] = {
    **loss_workers.CONFIGS,
    "geo_mis_bn": dist_workers.CONFIGS["geo_mis_bn"],
    "geo_tis": dist_workers.CONFIGS["geo_tis"],
    "token_mis_bn": dist_workers.CONFIGS["token_mis_bn"],
    "rs_token_mixed": dist_workers.CONFIGS["rs_token_mixed"],
}
LOSS_MODES = loss_workers.MODES
LOSS_LAYOUT = loss_workers.Layout(TP, CP, DP, RANKS, rows=(((0, 3),), ((3, 6), (6, 8))))


def run_losses(groups: ParallelGroups, data: dict[str, Tensor]) -> dict[str, Any]:
    """Every (loss config, mode): the module with the step pre-pass and Megatron's loss func."""
    layout = LOSS_LAYOUT
    vocab = loss_workers._vocab_slice(groups)
    out: dict[Any, Any] = {}
    for cfg_name, cfg in LOSS_CONFIGS.items():
        for mode in LOSS_MODES:
            module = loss_workers.loss_module(cfg, mode)
            shards = []
            for start, stop in layout.rows[groups.dp_rank]:
                logits = loss_workers._shard(data["logits"], groups, layout, start, stop)[..., vocab]
                batch = {k: loss_workers._shard(data[k], groups, layout, start, stop)
                         for k in ("targets", "old", "rollout", "mask")}
                batch["advantages"] = data["advantages"][start:stop]
                shards.append((start, stop, logits.clone().requires_grad_(True), batch))
            references = []
            for _, _, logits, batch in shards:
                with torch.no_grad():
                    current = loss_workers.module_logprobs(logits, batch["targets"], groups)
                references.append(current if cfg.bypass_mode else batch["old"])
            # step-level thresholds (M2PO, the adaptive IS bound) come from the whole step first
            step_shards = [(ref, b["rollout"], b["mask"]) for ref, (_, _, _, b) in zip(references, shards, strict=True)]
            module = module.for_step(step_shards, groups)
            corrections = [module.correct(ref, b["rollout"], b["mask"], groups, advantages=b["advantages"])
                           for ref, (_, _, _, b) in zip(references, shards, strict=True)]
            step = module.prepare_step(corrections, groups)
            den = StepDenominators.from_step(step)
            total, grads = 0.0, []
            for (start, stop, logits, batch), corr in zip(shards, corrections, strict=True):
                logprobs = loss_workers.module_logprobs(logits, batch["targets"], groups)
                res = module(logprobs, batch["rollout"], batch["advantages"], batch["mask"], groups, den,
                             old_logprobs=batch["old"], correction=corr)
                (grad,) = torch.autograd.grad(res.loss, logits)
                total += float(res.loss.detach())
                grads.append((start, stop, grad))
            out[(cfg_name, mode, "module")] = {"loss": total, "grads": grads, "metrics": step.metrics}
            sum_loss, sum_tokens, mgrads = 0.0, 0, []
            for (start, stop, logits, batch), corr in zip(shards, corrections, strict=True):
                mb = MegatronLossBatch(rollout_logprobs=batch["rollout"], advantages=batch["advantages"],
                                       loss_mask=batch["mask"], old_logprobs=batch["old"],
                                       target_ids=batch["targets"], correction=corr)
                loss_sum, num_tokens, _ = make_megatron_loss_func(mb, module, groups)(logits)
                (grad,) = torch.autograd.grad(loss_sum, logits)
                sum_loss += float(loss_sum.detach())
                sum_tokens += int(num_tokens)
                mgrads.append((start, stop, grad))
            out[(cfg_name, mode, "megatron")] = {"loss_sum": sum_loss, "num_tokens": sum_tokens, "grads": mgrads}
    cols = cp_token_indices(loss_workers.COLS, groups.cp_size, groups.cp_rank, layout.cp_layout)  # type: ignore[arg-type]
    return {"results": out, "cols": cols, "vocab": (vocab.start, vocab.stop),
            "coords": (groups.tp_rank, groups.cp_rank, groups.dp_rank)}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """Everything one of the 8 ranks does."""
    assert world_size == WORLD
    groups = build_parallel_groups(TP, CP, DP)
    assert groups is not None
    data = dist_workers.make_data()
    counter = CollectiveCounter()
    counter.label_groups(groups)
    counter.install()
    results: dict[Any, Any] = {}
    collectives: dict[Any, Any] = {}
    try:
        for name, layout in LAYOUTS.items():
            for cfg_name in configs_of(name):
                counter.calls = []
                results[(name, cfg_name)] = dist_workers.run_step(layout, groups, dist_workers.CONFIGS[cfg_name],
                                                                  data, counter)
                collectives[(name, cfg_name)] = list(counter.calls)
    finally:
        counter.uninstall()
    losses = run_losses(groups, loss_workers.make_data())
    return {"results": results, "collectives": collectives, "losses": losses,
            "coords": (groups.tp_rank, groups.cp_rank, groups.dp_rank)}

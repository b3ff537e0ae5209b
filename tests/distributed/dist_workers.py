"""What the spawned gloo ranks run: every layout x every config, on shared deterministic data.

One launch of 4 processes runs all scenarios (spawning is the expensive part on 2 cores):
layouts run one after another, or side by side on disjoint ranks. Each rank records its shards
of the outputs, its losses and gradients, the step's reduced metrics and every collective it
issued; the test module compares them with a single-process reference of the same data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_rollout_correction.core.aggregation import aggregate_loss, safe_divide
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.objective import policy_loss_for, rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import (
    PolicyLossConfig,
    add_rollout_log_ratio_penalty,
    compute_policy_loss,
)
from nemo_rollout_correction.core.presets import preset_names
from nemo_rollout_correction.distributed import (
    PackedSequences,
    ParallelGroups,
    build_parallel_groups,
    cp_token_indices,
    distributed_rollout_correction,
    reduce_step,
    shard_sequence,
    thd_token_indices,
)
from nemo_rollout_correction.distributed.correction import resolve_step_config
from nemo_rollout_correction.distributed.reduce import ExtremesMode
from nemo_rollout_correction.losses import RolloutCorrectedPolicyLoss

ROWS, COLS = 12, 16
NAN, INF = float("nan"), float("inf")
LOSS_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


# ---- data ---------------------------------------------------------------------------------------


def make_data(seed: int = 0, *, nonfinite: bool = True) -> dict[str, Tensor]:
    """A [ROWS, COLS] batch with the cases that matter under CP (same on every process).

    Row 0 is a full response, row 1 has no loss token, row 2 a catastrophic token (vetoed at
    1e-4), rows 5 and 7 have all their tokens in one CP chunk (rank 0 / rank 1 in the
    load-balanced layout, the other way round in the contiguous one), row 6 a large positive
    outlier; with `nonfinite`, row 4 has a NaN and row 9 a -inf rollout logprob on loss tokens and
    row 3 a NaN in its padding.
    """
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(ROWS, COLS, generator=gen) * 3 - 0.05
    old = rollout + 0.12 * torch.randn(ROWS, COLS, generator=gen)
    lengths = torch.randint(2, COLS + 1, (ROWS,), generator=gen)
    start = torch.randint(0, 4, (ROWS,), generator=gen)
    lengths[0], start[0] = COLS, 0
    lengths[1] = 0
    start[5], lengths[5] = 13, 2  # tokens 13-14: chunk 3
    start[7], lengths[7] = 5, 3  # tokens 5-7: chunk 1
    pos = torch.arange(COLS)
    mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
    old[2, int(start[2])] -= 12.0
    old[6, int(start[6]) + 1] += 3.0
    if nonfinite:
        rollout[3, COLS - 1] = NAN
        mask[3, COLS - 1] = False
        rollout[4, int(start[4])] = NAN
        rollout[9, int(start[9]) + 1] = -INF
    logprobs = old + 0.05 * torch.randn(ROWS, COLS, generator=gen)
    advantages = torch.randn(ROWS, 1, generator=gen).expand(ROWS, COLS).contiguous()
    return {"old": old, "rollout": rollout, "mask": mask, "logprobs": logprobs, "advantages": advantages}


# ---- configurations ----------------------------------------------------------------------------


def _cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


def _configs() -> dict[str, RolloutCorrectionConfig]:
    configs = {
        "none": _cfg(),
        "token_tis": _cfg(rollout_is="token", rollout_is_threshold=1.2),
        "token_mis_bn": _cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.15,
                             rollout_is_batch_normalize=True),
        "token_tis_2sided_bn": _cfg(rollout_is="token", rollout_is_threshold=1.1, rollout_is_two_sided=True,
                                    rollout_is_batch_normalize=True, nonfinite_policy="mask_token"),
        "seq_tis_2sided": _cfg(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_two_sided=True),
        "seq_mis_veto": _cfg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=3.0,
                             rollout_token_veto_threshold=1e-4),
        "seq_tis_bn": _cfg(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
        "geo_mis_bn": _cfg(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.05,
                           rollout_is_batch_normalize=True),
        "geo_tis": _cfg(rollout_is="geometric", rollout_is_threshold=1.02, rollout_token_veto_threshold=1e-3),
        "rs_seq_k1": _cfg(rollout_rs="seq_sum_k1,seq_mean_k1", rollout_rs_threshold="0.3_3.0,0.97_1.03",
                          rollout_token_veto_threshold=1e-4, nonfinite_policy="mask_token"),
        "rs_token_mixed": _cfg(rollout_is="token", rollout_rs="token_k1,seq_max_k2,seq_mean_k3,seq_sum_k2,token_k3",
                               rollout_rs_threshold="0.8_1.25,0.05,0.01,0.2,0.05",
                               rejected_tokens_in_denominator=True),
        "rs_token_k1_is_mask": _cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.2,
                                    rollout_rs="token_k1,token_k2", rollout_rs_threshold="0.85_1.3,0.02"),
        "rs_token_k3_only": _cfg(rollout_rs="token_k3", rollout_rs_threshold=0.004, nonfinite_policy="mask_token"),
        "rs_seq_mean_k2": _cfg(rollout_is="sequence", rollout_rs="seq_mean_k2,seq_sum_k3",
                               rollout_rs_threshold="0.01,0.08"),
        "rs_metrics_only": _cfg(rollout_is="geometric", rollout_rs="seq_max_k3,seq_sum_k3,token_k1",
                                rollout_rs_threshold="0.05,0.1,0.9_1.1", metrics_only=True,
                                rollout_token_veto_threshold=1e-4),
        "bypass_rs": _cfg(bypass_mode=True, rollout_rs="seq_mean_k1,token_k1", rollout_rs_threshold="0.98_1.02,0.9_1.1",
                          rollout_token_veto_threshold=1e-4),
        "pure_is_seq": _cfg(bypass_mode=True, loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
        "pure_is_token_bn": _cfg(bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                 rollout_is_threshold=1.1, rollout_is_batch_normalize=True),
        "max_fraction_ok": _cfg(rollout_is="token", nonfinite_max_fraction=0.5),
        # The frontier masks: OPSM's sequence KL and advantage sign need the CP-completed per-sequence
        # sums; KPop and DPPO-TV overlap the token IS mask (survivors are counted token by token).
        "frontier_all": _cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.2,
                             opsm_threshold=0.0, kpop_threshold=0.004, dppo_tv_threshold=0.02,
                             dppo_tv_threshold_low=0.03),
        # M2PO: the step's cutoff from an exact search over dp x cp (run_step resolves it before the microbatches).
        "m2po_tis": _cfg(rollout_is="token", rollout_is_threshold=1.2, m2po_threshold=0.004),
        "bypass_m2po_den": _cfg(bypass_mode=True, m2po_threshold=0.02, rejected_tokens_in_denominator=True,
                                nonfinite_policy="mask_token"),
        "auto_is_rs": _cfg(rollout_is="token", rollout_is_threshold=3.0, rollout_is_target_ess=0.95,
                           rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25", m2po_threshold=0.01),
        "frontier_opsm_den": _cfg(rollout_is="sequence", opsm_threshold=0.005, rejected_tokens_in_denominator=True,
                                  rollout_token_veto_threshold=1e-4),
    }
    seen = set(configs.values())
    for name in preset_names():
        cfg = RolloutCorrectionConfig.from_preset(name)
        if cfg not in seen:
            seen.add(cfg)
            configs[f"preset:{name}"] = cfg
    return configs


CONFIGS = _configs()


# ---- layouts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A parallel layout on a subset of the 4 ranks, with its microbatch split per DP rank."""

    tp: int
    cp: int
    dp: int
    pp: int
    ranks: tuple[int, ...]
    cp_layout: str = "load_balanced"
    extremes: ExtremesMode = "auto"
    rows: tuple[tuple[tuple[int, int], ...], ...] = field(default=((0, 5), (5, 12)),)
    """Per DP rank: the [start, stop) row ranges of its microbatches (uneven on purpose)."""
    packed: bool = False
    """Pack each microbatch's sequences into one THD stream (lengths padded to 2*cp)."""


_DP2_ROWS = (((0, 3), (3, 7)), ((7, 12),))
LAYOUTS: dict[str, Layout] = {
    "cp2_dp2": Layout(1, 2, 2, 1, (0, 1, 2, 3), rows=_DP2_ROWS),
    "tp2_cp2": Layout(2, 2, 1, 1, (0, 1, 2, 3), cp_layout="contiguous", extremes="max", rows=(((0, 5), (5, 12)),)),
    "dp2": Layout(1, 1, 2, 1, (0, 1), extremes="max", rows=_DP2_ROWS),
    "cp2": Layout(1, 2, 1, 1, (2, 3), extremes="slots", rows=(((0, 5), (5, 12)),)),
    "cp2_contiguous": Layout(1, 2, 1, 1, (0, 1), cp_layout="contiguous", rows=(((0, 12),),)),
    "tp2": Layout(2, 1, 1, 1, (2, 3), rows=(((0, 4), (4, 8), (8, 12)),)),
    # DP rank 0 has no microbatch at all this step; pipeline stage 0 has no loss and skips.
    "pp2_dp2": Layout(1, 1, 2, 2, (0, 1, 2, 3), rows=((), ((0, 6), (6, 12)))),
    "cp4": Layout(1, 4, 1, 1, (0, 1, 2, 3), rows=(((0, 7), (7, 12)),)),
    "cp2_packed": Layout(1, 2, 1, 1, (0, 1), packed=True, rows=(((0, 5), (5, 12)),)),
    "cp2_packed_contiguous": Layout(1, 2, 1, 1, (2, 3), cp_layout="contiguous", packed=True,
                                        rows=(((0, 12),),)),
}
PHASES: tuple[tuple[str, ...], ...] = (("cp2_dp2",), ("tp2_cp2",), ("dp2", "cp2"), ("cp2_contiguous", "tp2"),
                                       ("pp2_dp2",), ("cp4",), ("cp2_packed", "cp2_packed_contiguous"))


# ---- collective accounting ---------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
                "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                "barrier", "gather", "scatter", "send", "recv", "isend", "irecv")


class CollectiveCounter:
    """Wraps torch.distributed's collectives to record (section, op, group label, bytes)."""

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        self.section = "other"
        self.calls: list[tuple[str, str, str, int]] = []
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            label = "WORLD" if group is None or group is dist.GroupMember.WORLD else self.labels.get(id(group), "?")
            tensors = [a for a in args if isinstance(a, Tensor)]
            # Bytes this rank contributes: the input (for the gathers, the last tensor argument).
            tensor = tensors[-1] if tensors else None
            nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
            self.calls.append((self.section, name, label, nbytes))
            return original(*args, **kwargs)

        return wrapper

    def label_groups(self, groups: ParallelGroups) -> None:
        self.labels = {}
        for label in ("tp", "cp", "dp", "dp_cp"):
            group = getattr(groups, f"{label}_group")
            if group is not None:
                self.labels.setdefault(id(group), label)

    @contextmanager
    def during(self, section: str) -> Iterator[None]:
        previous, self.section = self.section, section
        try:
            yield
        finally:
            self.section = previous


# ---- one step ----------------------------------------------------------------------------------


def seq_mean_token_mean(per_token_loss: Tensor, keep: Tensor, seq_kept_tokens: Tensor, num_seqs: float) -> Tensor:
    """`seq-mean-token-mean` on a CP shard: per-sequence token means over the whole sequence."""
    seq_sum = torch.where(keep, per_token_loss, 0.0).sum(dim=-1)
    per_seq = safe_divide(seq_sum, seq_kept_tokens.to(seq_sum.dtype))
    return safe_divide(per_seq.sum(), torch.tensor(num_seqs, dtype=seq_sum.dtype))


def loss_config(cfg: RolloutCorrectionConfig, mode: str) -> PolicyLossConfig:
    # The policy loss the correction config selects (pure IS -> reinforce, cispo), as core.objective does.
    return policy_loss_for(cfg, PolicyLossConfig(loss_agg_mode=mode))  # type: ignore[arg-type]


def packed_lengths(data: dict[str, Tensor], start: int, stop: int, multiple: int) -> Tensor:
    """Per row of [start, stop): a packed sequence length covering its loss tokens, padded to `multiple`."""
    mask = data["mask"][start:stop]
    pos = torch.arange(1, COLS + 1)
    end = torch.where(mask, pos, 0).amax(dim=-1) if mask.numel() else torch.zeros(0, dtype=torch.int64)
    return (torch.div(end + multiple - 1, multiple, rounding_mode="floor") * multiple).clamp(min=multiple)


def shard_microbatch(layout: Layout, groups: ParallelGroups, data: dict[str, Tensor], start: int, stop: int
                     ) -> tuple[dict[str, Tensor], Tensor, Tensor, PackedSequences | None]:
    """This rank's tokens of rows [start, stop): as `[rows, local_seq]`, or packed THD when the
    layout says so (then the tensors are `[num_tokens]`). Also the global (row, col) of each local
    token, flattened in the order of the flattened local tensors."""
    cp_layout = layout.cp_layout
    if not layout.packed:
        cols = cp_token_indices(COLS, groups.cp_size, groups.cp_rank, cp_layout)  # type: ignore[arg-type]
        tensors = {k: shard_sequence(v[start:stop], groups.cp_size, groups.cp_rank, cp_layout)  # type: ignore[arg-type]
                   for k, v in data.items()}
        rows = torch.arange(start, stop)[:, None].expand(-1, cols.numel()).reshape(-1)
        return tensors, rows, cols[None, :].expand(stop - start, -1).reshape(-1), None
    lengths = packed_lengths(data, start, stop, 2 * groups.cp_size)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    seq_of_token = torch.repeat_interleave(torch.arange(stop - start), lengths)
    col_of_token = torch.arange(int(lengths.sum())) - cu[:-1][seq_of_token]
    index = thd_token_indices(cu, groups.cp_size, groups.cp_rank, cp_layout)  # type: ignore[arg-type]
    tensors = {k: v[start:stop][seq_of_token, col_of_token][index] for k, v in data.items()}
    return tensors, start + seq_of_token[index], col_of_token[index], PackedSequences.from_cu_seqlens(
        torch.div(cu, groups.cp_size, rounding_mode="floor"))


def run_step(layout: Layout, groups: ParallelGroups, cfg: RolloutCorrectionConfig, data: dict[str, Tensor],
             counter: CollectiveCounter) -> dict[str, Any]:
    """One optimizer step's worth of rollout correction, losses and gradients on this rank."""
    microbatches = []
    started = time.perf_counter()
    if cfg.needs_step_thresholds:  # M2PO: the cutoff from the whole step (bypass: judged on the current policy)
        chunks = []
        for start, stop in layout.rows[groups.dp_rank]:
            tensors, _, _, packed = shard_microbatch(layout, groups, data, start, stop)
            view = tensors if packed is None else {k: packed.to_padded(v, False if k == "mask" else 0.0)
                                                   for k, v in tensors.items()}
            chunks.append((view["logprobs"] if cfg.bypass_mode else view["old"], view["rollout"], view["mask"]))
        with counter.during("step_thresholds"):
            cfg = resolve_step_config(cfg, chunks, groups)
    for start, stop in layout.rows[groups.dp_rank]:
        tensors, rows, cols, packed = shard_microbatch(layout, groups, data, start, stop)
        logprobs = tensors["logprobs"].clone().requires_grad_(True)
        if packed is not None:  # correct on the padded [num_seqs, max_len] view of the packed tokens
            view = {k: packed.to_padded(v, False if k == "mask" else 0.0) for k, v in tensors.items()}
            view_logprobs = packed.to_padded(logprobs)
        else:
            view, view_logprobs = tensors, logprobs
        old = view_logprobs.detach() if cfg.bypass_mode else view["old"]
        with counter.during("microbatch"):
            mb = distributed_rollout_correction(old, view["rollout"], view["mask"], cfg, groups,
                                                advantages=view["advantages"])
        microbatches.append((start, stop, rows, cols, packed, view, logprobs, view_logprobs, mb))
    with counter.during("step"):
        step = reduce_step([m[-1] for m in microbatches], cfg, groups, extremes=layout.extremes)
    elapsed = time.perf_counter() - started

    records = []
    for start, stop, rows, cols, packed, view, logprobs, view_logprobs, mb in microbatches:
        def flat(x: Tensor, packed: PackedSequences | None = packed) -> Tensor:
            return (x if packed is None else packed.to_packed(x)).reshape(-1).detach().clone()

        record: dict[str, Any] = {
            "rows": rows, "cols": cols, "seq_rows": (start, stop), "is_weights": flat(mb.is_weights),
            "keep": flat(mb.keep_mask), "den": flat(mb.denominator_mask), "local_keep_any": mb.keep_mask.any(dim=-1),
            "seq_kept_tokens": mb.seq_kept_tokens.clone(), "loss": {}, "grad": {},
        }
        reference = view["rollout"] if cfg.bypass_mode else view["old"]
        is_weights = mb.is_weights if cfg.rollout_is is not None and not cfg.metrics_only else None
        for mode in LOSS_MODES:
            seq_mean = None
            if cfg.loss_type in ("gmpo", "vespo"):  # a statistic over the whole sequence: one CP all-gather
                with counter.during("loss"):
                    seq_mean = RolloutCorrectedPolicyLoss(cfg, loss_config(cfg, mode)).sequence_statistic(
                        view_logprobs, reference, view["advantages"], mb, groups, is_weights is not None)
            policy = compute_policy_loss(view_logprobs, reference.detach(), view["advantages"], mb.keep_mask,
                                         loss_config(cfg, mode), is_weights=is_weights, seq_statistic=seq_mean)
            if cfg.rollout_log_ratio_penalty > 0:
                policy = add_rollout_log_ratio_penalty(policy, view_logprobs, view["rollout"], mb.keep_mask,
                                                       cfg.rollout_log_ratio_penalty)
            if mode == "seq-mean-token-mean":
                loss = seq_mean_token_mean(policy.per_token_loss, mb.keep_mask, mb.seq_kept_tokens,
                                           step.num_global_seqs)
            else:
                loss = aggregate_loss(policy.per_token_loss, mb.keep_mask, mode,  # type: ignore[arg-type]
                                      num_global_tokens=step.num_global_tokens, num_global_seqs=step.num_global_seqs)
            (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=packed is not None)
            record["loss"][mode] = float(loss.detach())
            record["grad"][mode] = grad.reshape(-1)
            if groups.cp_size == 1 and packed is None:
                # Without CP a microbatch holds whole sequences, so core's own objective applies
                # directly, given the step's global denominators and mean.
                core_loss = rollout_corrected_policy_loss(
                    logprobs, view["rollout"], view["advantages"], view["mask"], cfg,
                    loss_config(cfg, mode), old_logprobs=view["old"], num_global_tokens=step.num_global_tokens,
                    num_global_seqs=step.num_global_seqs, is_weight_mean=step.is_weight_mean).loss
                (core_grad,) = torch.autograd.grad(core_loss, logprobs)
                record.setdefault("core_loss", {})[mode] = float(core_loss.detach())
                record.setdefault("core_grad", {})[mode] = core_grad.reshape(-1)
        records.append(record)
    return {
        "microbatches": records, "metrics": step.metrics, "num_global_tokens": step.num_global_tokens,
        "num_global_seqs": step.num_global_seqs, "is_weight_mean": step.is_weight_mean, "seconds": elapsed,
        "coords": (groups.tp_rank, groups.cp_rank, groups.dp_rank),
    }


def _expect_raise(layout: Layout, groups: ParallelGroups, cfg: RolloutCorrectionConfig, data: dict[str, Tensor],
                  counter: CollectiveCounter) -> str:
    try:
        run_step(layout, groups, cfg, data, counter)
    except ValueError as exc:
        return f"raised: {exc}"
    return "no error"


def raise_data() -> dict[str, Tensor]:
    """Finite data except one NaN rollout logprob on a loss token of row 8 (DP rank 1 in cp2_dp2)."""
    data = make_data(seed=1, nonfinite=False)
    data["rollout"][8, 8] = NAN
    data["mask"][8, 8] = True
    return data


RAISE_CASES = {
    "raise": _cfg(nonfinite_policy="raise"),
    "fraction_exceeded": _cfg(rollout_is="token", nonfinite_max_fraction=0.001),
    "fraction_ok": _cfg(rollout_is="token", nonfinite_max_fraction=0.05),
}


# ---- the worker ----------------------------------------------------------------------------------


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """Everything one rank does; returns its records keyed by (layout, config)."""
    assert world_size == 4
    # Every process creates every layout's groups, in the same order (new_group is collective).
    all_groups = {name: build_parallel_groups(lay.tp, lay.cp, lay.dp, lay.pp, ranks=lay.ranks)
                  for name, lay in LAYOUTS.items()}
    data = make_data()
    counter = CollectiveCounter()
    counter.install()
    results: dict[Any, Any] = {}
    collectives: dict[Any, Any] = {}
    try:
        for phase in PHASES:
            for name in phase:
                groups = all_groups[name]
                if groups is None:
                    continue
                if not groups.is_last_pipeline_stage:
                    results[(name, "stage")] = "skipped: no loss on this pipeline stage"
                    continue
                counter.label_groups(groups)
                for cfg_name, cfg in CONFIGS.items():
                    counter.calls = []
                    results[(name, cfg_name)] = run_step(LAYOUTS[name], groups, cfg, data, counter)
                    collectives[(name, cfg_name)] = list(counter.calls)
        groups = all_groups["cp2_dp2"]
        assert groups is not None
        counter.label_groups(groups)
        bad = raise_data()
        for case, cfg in RAISE_CASES.items():
            results[("raise", case)] = _expect_raise(LAYOUTS["cp2_dp2"], groups, cfg, bad, counter)
    finally:
        counter.uninstall()
    return {"results": results, "collectives": collectives}

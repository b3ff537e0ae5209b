"""What the spawned gloo ranks run for the loss-module tests (tests/distributed/test_losses.py).

Data are full-vocabulary logits `[ROWS, COLS, VOCAB]`, so gradients are taken with respect to the
logits (through the vocab-parallel logprob under TP) and compared with a single-process reference
on the whole batch. Each layout runs three entry points on its shards:

- `module`: `RolloutCorrectedPolicyLoss` with the step pre-pass (`correct` + `prepare_step`);
- `megatron`: the `make_megatron_loss_func` loss function, with the gradient of each `loss_sum`
  summed over microbatches (Megatron's per-token-loss schedule; the test divides by the summed
  `num_tokens`, as `finalize_model_grads` does);
- `nemo_rl` (layouts without CP): the NeMo-RL adapter on NeMo-RL-shaped data, with the pre-pass
  denominators installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed import ParallelGroups, build_parallel_groups, cp_token_indices, shard_sequence
from nemo_rollout_correction.losses import (
    MegatronLossBatch,
    NeMoRLRolloutCorrectedLoss,
    RolloutCorrectedPolicyLoss,
    StepDenominators,
    make_megatron_loss_func,
)

ROWS, COLS, VOCAB = 8, 16, 12
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
NEMO_MODES = ("token-mean", "seq-mean-token-mean")


def make_data(seed: int = 0) -> dict[str, Tensor]:
    """Logits, sampled ids, old / rollout logprobs with a NaN and a catastrophic token, masks."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, COLS, VOCAB, generator=gen) * 1.5
    targets = torch.randint(0, VOCAB, (ROWS, COLS), generator=gen)
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = logprobs + 0.03 * torch.randn(ROWS, COLS, generator=gen)
    rollout = old + 0.1 * torch.randn(ROWS, COLS, generator=gen)
    lengths = torch.randint(3, COLS + 1, (ROWS,), generator=gen)
    start = torch.randint(0, 3, (ROWS,), generator=gen)
    lengths[1] = 0
    pos = torch.arange(COLS)
    mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
    rollout[3, int(start[3])] = float("nan")
    old[5, int(start[5]) + 1] -= 12.0
    advantages = torch.randn(ROWS, generator=gen)
    return {"logits": logits, "targets": targets, "old": old, "rollout": rollout, "mask": mask,
            "advantages": advantages}


def _cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


CONFIGS: dict[str, RolloutCorrectionConfig] = {
    "token_tis": _cfg(rollout_is="token", rollout_is_threshold=1.1),
    "seq_mis_veto": _cfg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=3.0,
                         rollout_token_veto_threshold=1e-4),
    "token_tis_rs_bn": _cfg(rollout_is="token", rollout_is_threshold=1.2, rollout_is_batch_normalize=True,
                            rollout_rs="seq_mean_k1,token_k2", rollout_rs_threshold="0.97_1.03,0.02"),
    "bypass_rs": _cfg(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1",
                      rollout_token_veto_threshold=1e-4, nonfinite_policy="mask_token"),
    "pure_is_seq": _cfg(bypass_mode=True, loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
    # The 2026 objectives (docs/math.md): CISPO on pi_old with token TIS on top, and on pi_rollout.
    "cispo_tis": _cfg(loss_type="cispo", cispo_ratio_low=0.9, cispo_ratio_high=1.02, rollout_is="token",
                      rollout_is_threshold=1.1),
    "token_tis_lb": _cfg(rollout_is="token", rollout_is_two_sided=True, rollout_is_threshold=1.05,
                         rollout_is_threshold_lower=0.95),
    "seq_lp_error": _cfg(seq_logprob_error_threshold=1.09),
    "bypass_dppo_kl": _cfg(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1e6,
                           dppo_tv_threshold=0.2, dppo_tv_threshold_low=0.2, rollout_log_ratio_penalty=0.05,
                           nonfinite_policy="mask_token"),
    "bypass_cispo": _cfg(bypass_mode=True, loss_type="cispo", cispo_ratio_low=0.95, cispo_ratio_high=1.05),
    # GMPO: the geometric mean over the whole sequence (a CP all-gather of the clipped log-ratio sums).
    "gmpo_tis": _cfg(loss_type="gmpo", gmpo_ratio_low=0.97, gmpo_ratio_high=1.02, rollout_is="token",
                     rollout_is_threshold=1.1),
    "bypass_gmpo": _cfg(bypass_mode=True, loss_type="gmpo", gmpo_ratio_low=0.95, gmpo_ratio_high=1.03),
    # VESPO: the sequence weight (with the token IS folded in) summed over the whole sequence (a CP all-gather).
    "vespo_tis": _cfg(loss_type="vespo", rollout_is="token", rollout_is_threshold=1.1),
    "bypass_vespo": _cfg(bypass_mode=True, loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5),
    # The adaptive IS bound: the step's U from the same exact search (for_step), then token TIS at U.
    "token_tis_auto": _cfg(rollout_is="token", rollout_is_threshold=3.0, rollout_is_target_ess=0.985),
    "pure_is_auto": _cfg(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=4.0,
                         rollout_is_target_ess=0.995),
    # M2PO: the cutoff from the whole step's squared log-ratios (for_step's all-reduces), then a token mask.
    "m2po": _cfg(m2po_threshold=0.006),
    "bypass_m2po_cispo": _cfg(bypass_mode=True, loss_type="cispo", m2po_threshold=0.01, nonfinite_policy="mask_token"),
}
STEP_THRESHOLD_CONFIGS = tuple(name for name, cfg in CONFIGS.items() if cfg.needs_step_thresholds)
"""Not run through the NeMo-RL adapter, which refuses them (it has no step pre-pass)."""


@dataclass(frozen=True)
class Layout:
    """A layout on a subset of the 4 ranks; `rows[dp_rank]` are its microbatches' row ranges."""

    tp: int
    cp: int
    dp: int
    ranks: tuple[int, ...]
    rows: tuple[tuple[tuple[int, int], ...], ...]
    cp_layout: str = "load_balanced"


LAYOUTS: dict[str, Layout] = {
    "dp2": Layout(1, 1, 2, (0, 1), rows=(((0, 2), (2, 5)), ((5, 8),))),
    "cp2": Layout(1, 2, 1, (2, 3), rows=(((0, 3), (3, 8)),)),
    "tp2": Layout(2, 1, 1, (0, 1), rows=(((0, 4), (4, 8)),)),
    "cp2_contiguous": Layout(1, 2, 1, (2, 3), rows=(((0, 8),),), cp_layout="contiguous"),
    "tp2_cp2": Layout(2, 2, 1, (0, 1, 2, 3), rows=(((0, 5), (5, 8)),)),
    "cp2_dp2": Layout(1, 2, 2, (0, 1, 2, 3), rows=(((0, 3),), ((3, 6), (6, 8)))),
}
PHASES = (("dp2", "cp2"), ("tp2", "cp2_contiguous"), ("tp2_cp2",), ("cp2_dp2",))


def loss_module(cfg: RolloutCorrectionConfig, mode: str) -> RolloutCorrectedPolicyLoss:
    """The module under test (norm_length is irrelevant to the tested modes)."""
    return RolloutCorrectedPolicyLoss(cfg, PolicyLossConfig(loss_agg_mode=mode))  # type: ignore[arg-type]


def _shard(x: Tensor, groups: ParallelGroups, layout: Layout, start: int, stop: int) -> Tensor:
    return shard_sequence(x[start:stop], groups.cp_size, groups.cp_rank, layout.cp_layout, dim=1)  # type: ignore[arg-type]


def _vocab_slice(groups: ParallelGroups) -> slice:
    width = VOCAB // groups.tp_size
    return slice(groups.tp_rank * width, (groups.tp_rank + 1) * width)


def run_layout(layout: Layout, groups: ParallelGroups, data: dict[str, Tensor]) -> dict[Any, Any]:
    """Every (config, mode, entry point) on this rank's shards."""
    out: dict[Any, Any] = {}
    vocab = _vocab_slice(groups)
    cols = cp_token_indices(COLS, groups.cp_size, groups.cp_rank, layout.cp_layout)  # type: ignore[arg-type]
    spans = layout.rows[groups.dp_rank]
    for cfg_name, cfg in CONFIGS.items():
        for mode in MODES:
            module = loss_module(cfg, mode)
            # -- module: pre-pass, step reduction, then the losses --
            shards = []
            for start, stop in spans:
                logits = _shard(data["logits"], groups, layout, start, stop)[..., vocab].clone().requires_grad_(True)
                batch = {k: _shard(data[k], groups, layout, start, stop)
                         for k in ("targets", "old", "rollout", "mask")}
                batch["advantages"] = data["advantages"][start:stop]
                shards.append((start, stop, logits, batch))
            references = []
            for _, _, logits, batch in shards:
                with torch.no_grad():
                    current = module_logprobs(logits, batch["targets"], groups)
                references.append(current if cfg.bypass_mode else batch["old"])
            module = module.for_step([(ref, b["rollout"], b["mask"]) for ref, (_, _, _, b) in zip(references, shards,
                                                                                                  strict=True)], groups)
            corrections = [module.correct(ref, batch["rollout"], batch["mask"], groups, advantages=batch["advantages"])
                           for ref, (_, _, _, batch) in zip(references, shards, strict=True)]
            step = module.prepare_step(corrections, groups)
            den = StepDenominators.from_step(step)
            total, grads = 0.0, []
            for (start, stop, logits, batch), corr in zip(shards, corrections, strict=True):
                logprobs = module_logprobs(logits, batch["targets"], groups)
                res = module(logprobs, batch["rollout"], batch["advantages"], batch["mask"], groups, den,
                             old_logprobs=batch["old"], correction=corr)
                (grad,) = torch.autograd.grad(res.loss, logits)
                total += float(res.loss.detach())
                grads.append((start, stop, grad))
            out[(cfg_name, mode, "module")] = {"loss": total, "grads": grads, "metrics": step.metrics}
            # -- megatron: loss_func per microbatch, Megatron's per-token-loss schedule emulated --
            sum_loss, sum_tokens, mgrads = 0.0, 0, []
            for (start, stop, logits, batch), corr in zip(shards, corrections, strict=True):
                mb = MegatronLossBatch(rollout_logprobs=batch["rollout"], advantages=batch["advantages"],
                                       loss_mask=batch["mask"], old_logprobs=batch["old"], target_ids=batch["targets"],
                                       correction=corr)
                loss_sum, num_tokens, report = make_megatron_loss_func(mb, module, groups)(logits)
                assert num_tokens.dtype == torch.int32 and report
                (grad,) = torch.autograd.grad(loss_sum, logits)
                sum_loss += float(loss_sum.detach())
                sum_tokens += int(num_tokens)
                mgrads.append((start, stop, grad))
            out[(cfg_name, mode, "megatron")] = {"loss_sum": sum_loss, "num_tokens": sum_tokens, "grads": mgrads}
    return {"results": out, "cols": cols, "vocab": (vocab.start, vocab.stop),
            "coords": (groups.tp_rank, groups.cp_rank, groups.dp_rank)}


def module_logprobs(logits: Tensor, targets: Tensor, groups: ParallelGroups) -> Tensor:
    """pi_theta from this rank's vocabulary shard (the path the Megatron adapter takes)."""
    from nemo_rollout_correction.distributed import vocab_parallel_logprobs

    return vocab_parallel_logprobs(logits, targets, groups.tp_group if groups.tp_size > 1 else None)


def nemo_rl_data(data: dict[str, Tensor]) -> dict[str, Tensor]:
    """NeMo-RL-shaped microbatch: `[ROWS, COLS + 1]` keys with a leading prompt position."""
    pad_f = torch.zeros(ROWS, 1)
    first = torch.zeros(ROWS, 1, dtype=torch.int64)
    return {
        "input_ids": torch.cat([first, data["targets"]], dim=1),
        "generation_logprobs": torch.cat([pad_f, data["rollout"]], dim=1),
        "prev_logprobs": torch.cat([pad_f, data["old"]], dim=1),
        "advantages": data["advantages"][:, None].expand(ROWS, COLS + 1).contiguous(),
        "token_mask": torch.cat([torch.zeros(ROWS, 1), data["mask"].float()], dim=1),
        "sample_mask": torch.ones(ROWS),
        # logits at position t predict token t + 1; the last position predicts nothing
        "logits": torch.cat([data["logits"], torch.zeros(ROWS, 1, VOCAB)], dim=1),
    }


def run_nemo_rl(layout: Layout, groups: ParallelGroups, data: dict[str, Tensor]) -> dict[Any, Any]:
    """The NeMo-RL adapter on NeMo-RL-shaped data (no CP), pre-pass denominators installed."""
    full = nemo_rl_data(data)
    vocab = _vocab_slice(groups)
    out: dict[Any, Any] = {}
    for cfg_name, cfg in CONFIGS.items():
        if cfg_name in STEP_THRESHOLD_CONFIGS:
            continue
        for mode in NEMO_MODES:
            adapter = NeMoRLRolloutCorrectedLoss(cfg, PolicyLossConfig(loss_agg_mode=mode),  # type: ignore[arg-type]
                                                 groups=groups)
            mbs = []
            for start, stop in layout.rows[groups.dp_rank]:
                mb = {k: v[start:stop] for k, v in full.items() if k != "logits"}
                logits = full["logits"][start:stop][..., vocab].clone().requires_grad_(True)
                mbs.append((start, stop, mb, logits))
            corrections = []
            for _, _, mb, logits in mbs:
                with torch.no_grad():
                    current = module_logprobs(logits[:, :-1], mb["input_ids"][:, 1:], groups)
                reference = current if cfg.bypass_mode else mb["prev_logprobs"][:, 1:]
                mask = (mb["token_mask"][:, 1:] != 0) & (mb["sample_mask"][:, None] != 0)
                corrections.append(adapter.loss.correct(reference, mb["generation_logprobs"][:, 1:], mask, groups,
                                                        advantages=mb["advantages"][:, 1:]))
            step = adapter.loss.prepare_step(corrections, groups)
            adapter.set_step_denominators(StepDenominators.from_step(step))
            total, grads = 0.0, []
            # NeMo-RL's sync path passes its own mask counts; the override replaces them (placeholder 1s
            # would mean its split path, which the adapter refuses without split_train_path=True).
            nemo_seqs, nemo_toks = torch.tensor(float(ROWS)), torch.tensor(float(ROWS * COLS))
            for start, stop, mb, logits in mbs:
                if groups.tp_size > 1:  # the older NeMo-RL call convention, with the TP group
                    loss, metrics = adapter(logits, mb, nemo_seqs, nemo_toks,
                                            vocab_parallel_rank=groups.tp_rank, vocab_parallel_group=groups.tp_group)
                else:  # the newer keyword convention (LossInputType.LOGIT)
                    loss, metrics = adapter(data=mb, global_valid_seqs=nemo_seqs, global_valid_toks=nemo_toks,
                                            logits=logits)
                assert "loss" in metrics
                (grad,) = torch.autograd.grad(loss, logits)
                total += float(loss.detach())
                grads.append((start, stop, grad[:, :-1]))
            out[(cfg_name, mode, "nemo_rl")] = {"loss": total, "grads": grads}
    return out


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """Every layout's cases on this rank; results keyed by layout name."""
    assert world_size == 4
    all_groups = {name: build_parallel_groups(lay.tp, lay.cp, lay.dp, ranks=lay.ranks) for name, lay in LAYOUTS.items()}
    data = make_data()
    results: dict[str, Any] = {}
    for phase in PHASES:
        for name in phase:
            groups = all_groups[name]
            if groups is None:
                continue
            layout = LAYOUTS[name]
            record = run_layout(layout, groups, data)
            if groups.cp_size == 1:
                record["results"].update(run_nemo_rl(layout, groups, data))
            results[name] = record
    return results

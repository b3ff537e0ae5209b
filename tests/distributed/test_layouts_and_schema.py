"""Single-process checks of the distributed layer's pieces: CP layouts (also packed THD), the
reduction schema, the fused reduction on one rank, and the one-rank path of the correction."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_workers import CONFIGS, make_data

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.distributed import (
    PackedSequences,
    ParallelGroups,
    PartialsSchema,
    all_reduce_partials,
    cp_token_indices,
    distributed_rollout_correction,
    metric_schema,
    reduce_step,
    reduce_step_metrics,
    shard_sequence,
    thd_token_indices,
    unshard_sequence,
)
from nemo_rollout_correction.distributed.context_parallel import gather_sequence_partials
from nemo_rollout_correction.distributed.correction import core_config, resolve_step_config
from nemo_rollout_correction.distributed.reduce import use_slots

pytestmark = pytest.mark.distributed

F64 = torch.float64


# ---- context-parallel layouts --------------------------------------------------------------------


def test_load_balanced_layout_is_megatrons() -> None:
    # 8 tokens, cp = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_token_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_token_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_token_indices(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    assert cp_token_indices(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_round_trip(layout: Any, cp: int) -> None:
    x = torch.arange(3 * 16).reshape(3, 16)
    shards = [shard_sequence(x, cp, r, layout) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, x[:, cp_token_indices(16, cp, r, layout)])
    assert torch.equal(unshard_sequence(shards, layout), x)
    covered = torch.cat([cp_token_indices(16, cp, r, layout) for r in range(cp)]).sort().values
    assert torch.equal(covered, torch.arange(16))


def test_layout_errors_are_actionable() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        cp_token_indices(10, 2, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp_token_indices(8, 2, 0, "zigzag")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cp_rank=2"):
        shard_sequence(torch.zeros(2, 8), 2, 2)


def test_packed_thd_layout_splits_every_sequence_on_its_own() -> None:
    cu = torch.tensor([0, 8, 12, 28])  # three sequences of 8, 4 and 16 tokens, padded to 2 * cp
    per_rank = [thd_token_indices(cu, 2, r) for r in range(2)]
    assert per_rank[0].tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 15, 24, 25, 26, 27]
    assert torch.equal(torch.cat(per_rank).sort().values, torch.arange(28))
    # Each sequence is sharded exactly as a [1, seq] tensor would be.
    for start, stop in [(0, 8), (8, 12), (12, 28)]:
        local = [i - start for i in per_rank[1].tolist() if start <= i < stop]
        assert local == cp_token_indices(stop - start, 2, 1).tolist()
    with pytest.raises(ValueError, match="multiple of 4"):
        thd_token_indices(torch.tensor([0, 6]), 2, 0)


def test_packed_view_round_trip_and_gradient() -> None:
    packed = PackedSequences.from_cu_seqlens(torch.tensor([0, 4, 6, 13]))
    x = torch.arange(13.0, requires_grad=True)
    padded = packed.to_padded(x, fill=-1.0)
    assert padded.shape == (3, 7)
    assert padded[1].tolist() == [4.0, 5.0] + [-1.0] * 5
    assert torch.equal(packed.to_packed(padded), x.detach())
    (padded * torch.arange(21.0).reshape(3, 7)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.arange(21.0).reshape(3, 7)[packed.rows, packed.cols])


# ---- groups --------------------------------------------------------------------------------------


def test_parallel_groups_validation() -> None:
    single = ParallelGroups.single()
    assert (single.cp_size, single.dp_cp_size, single.is_last_pipeline_stage) == (1, 1, True)
    with pytest.raises(ValueError, match="cp_group is None"):
        ParallelGroups(cp_size=2, cp_rank=1, dp_cp_rank=1)
    with pytest.raises(ValueError, match="dp_rank=2"):
        ParallelGroups(dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="pp_group is None"):
        ParallelGroups(pp_size=2, pp_rank=1)
    with pytest.raises(ValueError, match="is_last_pipeline_stage=True contradicts pp_rank=0"):
        ParallelGroups(pp_size=2, pp_rank=0, pp_group=object())  # type: ignore[arg-type]


# ---- reduction schema and the fused reduction --------------------------------------------------


def test_schema_orders_keys_and_rejects_strangers() -> None:
    p = Partials(sums={"b": torch.zeros((), dtype=F64), "a": torch.ones(3, dtype=F64)},
                 maxs={"m": torch.tensor(1.0, dtype=F64)}, mins={"n": torch.tensor(-1.0, dtype=F64)})
    schema = PartialsSchema.of(p)
    assert schema.sums == (("a", (3,)), ("b", ())) and schema.num_sum_elements == 4 and schema.num_extremes == 2
    with pytest.raises(RuntimeError, match="not in the reduction schema"):
        schema.check(Partials(sums={"c": torch.zeros((), dtype=F64)}))
    with pytest.raises(RuntimeError, match="shape"):
        schema.check(Partials(sums={"a": torch.zeros(2, dtype=F64)}))
    with pytest.raises(ValueError, match="shapes"):
        schema.union(PartialsSchema.of(Partials(sums={"a": torch.zeros(2, dtype=F64)})))
    with pytest.raises(ValueError, match="only scalars"):
        PartialsSchema.of(Partials(maxs={"v": torch.zeros(2, dtype=F64)}))


def test_one_rank_reduction_fills_identities() -> None:
    schema = PartialsSchema(sums=(("h", (2,)), ("s", ())), maxs=("m",), mins=("n",))
    out = all_reduce_partials(Partials(sums={"s": torch.tensor(3.0, dtype=F64)}), schema,
                              group=None, group_size=1, group_rank=0)
    assert out.sums["s"].item() == 3.0 and out.sums["h"].tolist() == [0.0, 0.0]
    assert out.maxs["m"].item() == float("-inf") and out.mins["n"].item() == float("inf")


def test_extremes_use_slots_while_they_stay_small() -> None:
    schema = PartialsSchema(sums=(("h", (8000,)),), maxs=tuple(f"m{i}" for i in range(20)), mins=("n",))
    assert use_slots(schema, 8, "auto") and use_slots(schema, 380, "auto")
    assert not use_slots(schema, 1024, "auto")
    assert use_slots(schema, 1024, "slots") and not use_slots(schema, 2, "max")
    with pytest.raises(ValueError, match="extremes must be one of"):
        use_slots(schema, 2, "fused")  # type: ignore[arg-type]


def test_gather_on_one_rank_is_the_identity() -> None:
    seq = Partials(sums={"a": torch.arange(3.0, dtype=F64)}, maxs={"b": torch.ones(3, dtype=F64)})
    gathered = gather_sequence_partials(seq, ParallelGroups.single(), {"x": torch.full((3,), 2.0)})
    assert torch.equal(gathered.reduced.sums["a"], seq.sums["a"])
    assert torch.equal(gathered.reduced.maxs["b"], seq.maxs["b"])
    assert gathered.per_rank["x"].shape == (1, 3)


def _subsets(data: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    old, rollout, mask = data["old"], data["rollout"], data["mask"]
    nan_row = rollout[4:5].clone().fill_(float("nan"))
    return [(old, rollout, mask), (old[:0], rollout[:0], mask[:0]), (old[1:2], rollout[1:2], mask[1:2]),
            (old[4:5], nan_row, mask[4:5] | True), (old[5:8, 8:], rollout[5:8, 8:], mask[5:8, 8:])]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_schema_from_the_config_covers_every_rank_s_partials(name: str) -> None:
    """Ranks flatten partials by a schema derived from the config alone; whatever a rank's data
    (empty, no loss token, all non-finite, a CP piece) its partials must fit that schema."""
    cfg = CONFIGS[name]
    schema = metric_schema(cfg)
    for old, rollout, mask in _subsets(make_data()):
        adv = torch.linspace(-1.0, 1.0, old.shape[0])  # read by OPSM / DPPO-TV configs only
        # step-level thresholds (M2PO, the adaptive IS bound): this subset as the whole step
        resolved = resolve_step_config(cfg, [(old, rollout, mask)], ParallelGroups.single())
        mb = distributed_rollout_correction(old, rollout, mask, resolved, ParallelGroups.single(), advantages=adv)
        schema.check(mb.partials)


# ---- the one-rank path equals core ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_single_rank_equals_core(name: str) -> None:
    cfg = CONFIGS[name]
    data = make_data()
    adv = data["advantages"]
    ref = compute_rollout_correction(data["old"], data["rollout"], data["mask"], cfg, advantages=adv)
    resolved = resolve_step_config(cfg, [(data["old"], data["rollout"], data["mask"])], ParallelGroups.single())
    mb = distributed_rollout_correction(data["old"], data["rollout"], data["mask"], resolved, ParallelGroups.single(),
                                        advantages=adv)
    step = reduce_step([mb], resolved, ParallelGroups.single())
    assert torch.equal(mb.keep_mask, ref.keep_mask)
    torch.testing.assert_close(mb.is_weights, ref.is_weights)
    assert step.metrics == pytest.approx(ref.metrics, rel=1e-9, abs=1e-12, nan_ok=True)
    assert reduce_step_metrics(mb.partials, resolved, ParallelGroups.single()) == pytest.approx(ref.metrics, rel=1e-9,
                                                                                           abs=1e-12, nan_ok=True)
    assert mb.output.metrics == {}  # one shard's values are never offered as the step's
    assert step.num_global_tokens == ref.num_denominator_tokens


def test_batch_norm_mean_known_in_advance() -> None:
    cfg = CONFIGS["geo_mis_bn"]
    data = make_data()
    ref = compute_rollout_correction(data["old"], data["rollout"], data["mask"], cfg)
    mean = ref.metrics["rollout_corr/rollout_is_batch_norm_factor"]
    mb = distributed_rollout_correction(data["old"], data["rollout"], data["mask"], cfg, ParallelGroups.single(),
                                        is_weight_mean=mean)
    assert not mb.batch_norm_pending
    torch.testing.assert_close(mb.is_weights, ref.is_weights)
    step = reduce_step([mb], cfg, ParallelGroups.single())
    assert step.is_weight_mean == mean
    torch.testing.assert_close(mb.is_weights, ref.is_weights)  # not divided a second time


def test_core_runs_without_the_checks_the_step_takes_over() -> None:
    cfg = CONFIGS["token_mis_bn"]
    assert core_config(cfg).rollout_is_batch_normalize is False
    raising = core_config(RolloutCorrectionConfig(nonfinite_policy="raise", nonfinite_max_fraction=0.1))
    assert (raising.nonfinite_policy, raising.nonfinite_max_fraction) == ("mask_token", None)
    plain = CONFIGS["token_tis"]
    assert core_config(plain) is plain


def test_empty_step_reduces_to_honest_zeros() -> None:
    cfg = CONFIGS["seq_tis_bn"]
    step = reduce_step([], cfg, ParallelGroups.single())
    assert step.num_global_tokens == 0 and step.num_global_seqs == 0 and step.is_weight_mean == 1.0
    # no NaN but the metrics undefined without kept tokens (prob_pearson: NaN where r is undefined, docs/metrics.md)
    assert all(value == value for key, value in step.metrics.items() if key != "rollout_corr/prob_pearson")

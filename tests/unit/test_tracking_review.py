"""Review helpers (tracking/plots.py, tables.py, review.py): real PNG and Parquet files, read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
pq = pytest.importorskip("pyarrow.parquet")

from nemo_rollout_correction.tracking.plots import (  # noqa: E402
    plot_is_weight_histogram,
    plot_mismatch_vs_length,
    plot_reward_curve,
)
from nemo_rollout_correction.tracking.review import RewardHistory, write_review_artifacts  # noqa: E402
from nemo_rollout_correction.tracking.tables import COLUMNS, SequenceReview, worst_order, write_worst_sequences  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _review(n: int = 6) -> SequenceReview:
    return SequenceReview.create(
        prompts=[f"What is {i} + 1?" for i in range(n)],
        responses=[f"{i + 1}" * (i + 1) for i in range(n)],
        response_lengths=torch.arange(1, n + 1),
        seq_log_ratio_sum=torch.tensor([0.1, -2.0, 0.3, float("nan"), 0.0, 1.0])[:n],
        max_abs_log_ratio=np.array([0.05, 0.9, 0.2, 3.0, 0.0, 0.5])[:n],
        kl=[0.01, 0.4, 0.02, 0.3, 0.0, 0.1][:n],
        is_weight=[1.0, 0.2, 1.1, 0.0, 1.0, 2.0][:n],
        kept=[True, True, True, False, True, True][:n],
        reward=[1.0, 0.0, 1.0, 0.0, 1.0, 0.5][:n],
    )


def test_is_histogram_writes_a_png_with_zeros_and_non_finite_weights(tmp_path: Path) -> None:
    raw = torch.cat([torch.exp(torch.randn(500, generator=torch.Generator().manual_seed(0))), torch.tensor([0.0])])
    applied = torch.clamp(raw, max=2.0)
    applied[0] = float("inf")
    out = plot_is_weight_histogram(raw, applied, tmp_path / "h" / "is.png")
    assert out == tmp_path / "h" / "is.png"
    assert _png_size(out) == (640, 400)


def test_is_histogram_with_no_positive_weights_still_writes(tmp_path: Path) -> None:
    out = plot_is_weight_histogram(np.zeros(3), np.array([]), tmp_path / "empty.png")
    assert _png_size(out) == (640, 400)


def test_mismatch_vs_length_and_reward_curve(tmp_path: Path) -> None:
    lengths = np.arange(1, 41)
    kl = 0.001 * lengths + np.where(lengths == 7, np.nan, 0.0)
    assert _png_size(plot_mismatch_vs_length(lengths, kl, tmp_path / "m.png", num_bins=5))[0] == 640
    steps = np.arange(10)
    assert _png_size(plot_reward_curve(steps, steps / 10, tmp_path / "r.png", std=np.full(10, 0.05)))[1] == 400


def test_plots_reject_mismatched_or_2d_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one length"):
        plot_mismatch_vs_length([1, 2, 3], [0.1, 0.2], tmp_path / "x.png")
    with pytest.raises(ValueError, match="raw_weights must be 1-D"):
        plot_is_weight_histogram(np.ones((2, 2)), np.ones(4), tmp_path / "x.png")
    with pytest.raises(ValueError, match="one length"):
        plot_reward_curve([0, 1], [0.1, 0.2], tmp_path / "x.png", std=[0.1])


def test_worst_order_ranks_non_finite_first_then_descending() -> None:
    review = _review()
    # abs(seq_log_ratio_sum) = [0.1, 2.0, 0.3, nan, 0.0, 1.0] -> nan, 2.0, 1.0, 0.3, 0.1, 0.0
    assert worst_order(review, "abs_seq_log_ratio_sum").tolist() == [3, 1, 5, 2, 0, 4]
    assert worst_order(review, "kl").tolist() == [1, 3, 5, 2, 0, 4]
    assert worst_order(review, "neg_reward").tolist()[:2] == [1, 3]
    with pytest.raises(ValueError, match="sort_by='bogus': allowed"):
        worst_order(review, "bogus")


def test_worst_sequences_parquet_round_trip(tmp_path: Path) -> None:
    out = write_worst_sequences(_review(), step=12, path=tmp_path / "w.parquet", top_k=3, sort_by="max_abs_log_ratio")
    table = pq.read_table(out)
    assert tuple(table.column_names) == COLUMNS
    rows = table.to_pylist()
    assert [r["sample_index"] for r in rows] == [3, 1, 5]  # max |log ratio| 3.0, 0.9, 0.5
    assert rows[0] == {
        "step": 12,
        "sample_index": 3,
        "prompt": "What is 3 + 1?",
        "response": "4444",
        "response_length": 4,
        "seq_log_ratio_sum": pytest.approx(float("nan"), nan_ok=True),
        "max_abs_log_ratio": 3.0,
        "kl": 0.3,
        "is_weight": 0.0,
        "kept": False,
        "reward": 0.0,
    }
    assert str(table.schema.field("kept").type) == "bool"
    assert str(table.schema.field("response_length").type) == "int64"
    assert table.schema.metadata[b"sort_by"] == b"max_abs_log_ratio"


def test_sequence_review_validates_lengths() -> None:
    with pytest.raises(ValueError, match="one length"):
        SequenceReview.create(
            prompts=["a", "b"], responses=["x"], response_lengths=[1, 2], seq_log_ratio_sum=[0, 0],
            max_abs_log_ratio=[0, 0], kl=[0, 0], is_weight=[1, 1], kept=[True, True], reward=[0, 0],
        )  # fmt: skip


def test_write_review_artifacts_layout(tmp_path: Path) -> None:
    directory = write_review_artifacts(
        tmp_path,
        5,
        raw_is_weights=np.exp(np.linspace(-1, 1, 50)),
        applied_is_weights=np.clip(np.exp(np.linspace(-1, 1, 50)), 0, 2),
        sequences=_review(),
        rewards=RewardHistory(steps=[0, 5], mean=[0.1, 0.4], std=[0.05, 0.1]),
        top_k=2,
        mismatch="mean_abs_log_ratio",
    )
    assert directory == tmp_path / "step_000005"
    assert sorted(p.name for p in directory.iterdir()) == [
        "is_weights.png", "mismatch_vs_length.png", "reward.png", "worst_sequences.parquet",
    ]  # fmt: skip
    assert pq.read_table(directory / "worst_sequences.parquet").num_rows == 2


def test_zero_worst_sequences_writes_no_table(tmp_path: Path) -> None:
    directory = write_review_artifacts(
        tmp_path, 0, raw_is_weights=[1.0, 2.0], applied_is_weights=[1.0, 2.0], sequences=_review(), top_k=0
    )
    assert sorted(p.name for p in directory.iterdir()) == ["is_weights.png", "mismatch_vs_length.png"]

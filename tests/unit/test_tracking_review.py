"""Review helpers (tracking/review.py: plots, worst-sequences table, review step): real PNG and Parquet files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from default_lane import require

require("matplotlib", "mlflow")
pq = require("pyarrow.parquet", "mlflow")

from nemo_rollout_correction.tracking.review import (
    COLUMNS,
    KL_LABEL,
    RewardHistory,
    SequenceReview,
    TokenReview,
    figure_is_weight_histogram,
    figure_mismatch_by_position,
    figure_mismatch_vs_length,
    figure_token_probabilities,
    plot_is_weight_histogram,
    plot_mismatch_by_position,
    plot_mismatch_vs_length,
    plot_reward_curve,
    plot_token_probabilities,
    worst_order,
    write_review_artifacts,
    write_worst_sequences,
)

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
    assert _png_size(out) == (640, 520)


def test_is_histogram_with_no_positive_weights_still_writes(tmp_path: Path) -> None:
    out = plot_is_weight_histogram(np.zeros(3), np.array([]), tmp_path / "empty.png")
    assert _png_size(out) == (640, 520)


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
    ]  # fmt: skip (no TokenReview: no token plots)
    assert pq.read_table(directory / "worst_sequences.parquet").num_rows == 2


def test_zero_worst_sequences_writes_no_table(tmp_path: Path) -> None:
    directory = write_review_artifacts(
        tmp_path, 0, raw_is_weights=[1.0, 2.0], applied_is_weights=[1.0, 2.0], sequences=_review(), top_k=0
    )
    assert sorted(p.name for p in directory.iterdir()) == ["is_weights.png", "mismatch_vs_length.png"]


# ---- the mismatch dashboard: what each figure shows, read from the matplotlib objects -----------------------

def _tokens(n: int = 400, scale: float = 3e-3, seed: int = 0) -> TokenReview:
    rng = np.random.default_rng(seed)
    rollout = np.log(rng.beta(0.5, 0.3, size=n).clip(1e-6, 1.0))
    trainer = rollout + rng.normal(0.0, scale, size=n)
    trainer[3] = np.nan  # a non-finite logprob is dropped and counted, never plotted
    return TokenReview.create(trainer_logprobs=trainer, rollout_logprobs=rollout,
                              positions=np.resize(np.arange(40), n))


def _tick_labels(axis: object) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("scale", [1e-6, 0.3], ids=["fp32-like", "wide"])
def test_is_histogram_axes_are_readable_at_any_scale(scale: float) -> None:
    """Two panels (raw above, applied below) on a shared linear log-weight axis with several labelled ticks."""
    raw = np.exp(np.random.default_rng(0).normal(0.0, scale, 500))
    fig = figure_is_weight_histogram(raw, np.clip(raw, 0.0, 1.0 + scale), bins=30)
    fig.canvas.draw()  # tick labels exist after a draw
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_xscale() == "linear" and top.get_yscale() == "log" and bottom.get_yscale() == "log"
    assert "log IS weight" in bottom.get_xlabel() and top.get_xlabel() == ""
    labels = _tick_labels(bottom.xaxis)
    assert len(labels) >= 4, labels  # not a single "1" tick
    if scale < 1e-3:  # the scale of small values is printed (the offset text, e.g. "1e-6")
        assert bottom.xaxis.get_offset_text().get_text().startswith("1e")
    # one histogram per panel, drawn from the same bin edges (neither hides the other)
    raw_bars, applied_bars = top.patches, bottom.patches
    assert len(raw_bars) == len(applied_bars) == 30
    assert [b.get_x() for b in raw_bars] == [b.get_x() for b in applied_bars]
    assert sum(b.get_height() for b in raw_bars) == 500
    assert "raw" in top.get_legend().get_texts()[0].get_text()
    assert "applied" in bottom.get_legend().get_texts()[0].get_text()


def test_kl_plot_is_labelled_as_the_k3_estimator_and_starts_at_zero() -> None:
    kl = np.array([3e-11, 1e-11, 5e-11, 0.0])
    fig = figure_mismatch_vs_length([10, 20, 30, 40], kl, mismatch_label=KL_LABEL)
    (ax,) = fig.axes
    assert "k3" in ax.get_ylabel() and "KL(rollout || train)" in ax.get_ylabel()
    assert ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] >= 5e-11
    assert ax.get_xlabel() == "response length (tokens)"


def test_token_probability_figure_axes() -> None:
    tokens = _tokens()
    fig = figure_token_probabilities(tokens.trainer_logprobs, tokens.rollout_logprobs, bins=20)
    left, right, left_bar, right_bar = fig.axes  # two 2-D histograms and their colour bars
    assert left.get_xlabel() == "rollout probability (vLLM)" and left.get_ylabel() == "trainer probability (Megatron)"
    assert left.get_xlim() == (0.0, 1.0) and left.get_ylim() == (0.0, 1.0)
    assert right.get_ylabel() == "trainer - rollout probability"
    (mesh,) = left.collections
    counts = np.ma.filled(mesh.get_array(), 0.0)
    assert counts.shape == (20, 20) and counts.sum() == 399  # the NaN pair is dropped
    assert type(mesh.norm).__name__ == "LogNorm"
    assert left_bar.get_ylabel() == "tokens (log)" and right_bar.get_ylabel() == "tokens (log)"
    note = left.texts[0].get_text()
    assert "n=399 tokens, 1 non-finite dropped" in note and "mult. prob error" in note and "Pearson r" in note
    # the error panel is symmetric about 0 and covers the largest difference
    low, high = right.get_ylim()
    diff = np.exp(tokens.trainer_logprobs) - np.exp(tokens.rollout_logprobs)
    assert low == pytest.approx(-high) and high >= np.nanmax(np.abs(diff))


def test_mismatch_by_position_figure_axes() -> None:
    tokens = _tokens()
    fig = figure_mismatch_by_position(tokens.positions, tokens.trainer_logprobs, tokens.rollout_logprobs)
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_ylabel() == "|log p_train - log p_rollout|" and bottom.get_ylabel() == "tokens"
    assert bottom.get_xlabel() == "response position (token index)"
    assert [line.get_label() for line in top.get_lines()] == ["mean", "90th percentile", "max"]
    mean_line = top.get_lines()[0]
    assert list(mean_line.get_xdata()) == list(range(40))  # one point per position
    assert sum(bar.get_height() for bar in bottom.patches) == 399
    # positions beyond max_bins share equal-width bins, and the label says so
    many = figure_mismatch_by_position(np.arange(300), np.zeros(300), np.full(300, -1e-3), max_bins=50)
    assert len(many.axes[1].patches) == 50 and "bins of 6" in many.axes[1].get_xlabel()


def test_token_plots_are_written_with_the_review(tmp_path: Path) -> None:
    tokens = _tokens()
    directory = write_review_artifacts(tmp_path, 3, raw_is_weights=[1.0, 1.001], applied_is_weights=[1.0, 1.0],
                                       sequences=_review(), tokens=tokens, top_k=0)
    assert sorted(p.name for p in directory.iterdir()) == [
        "is_weights.png", "mismatch_by_position.png", "mismatch_vs_length.png", "token_probabilities.png",
    ]  # fmt: skip
    assert _png_size(directory / "token_probabilities.png") == (1100, 460)
    assert _png_size(directory / "mismatch_by_position.png") == (640, 520)
    with pytest.raises(ValueError, match="one length"):
        TokenReview.create(trainer_logprobs=[0.0], rollout_logprobs=[0.0, 1.0], positions=[0])
    assert plot_token_probabilities([], [], tmp_path / "empty.png").exists()
    assert plot_mismatch_by_position([], [], [], tmp_path / "empty2.png").exists()

"""The review artifacts of a step: plots (matplotlib, Agg), the worst-sequences table (pyarrow) and the
one call that writes both into `review/step_<n>/` and logs them through the tracker.

Sections: array conversion; plots; the worst-sequences table; the review step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rollout_correction.tracking.tracker import MlflowTracker

# ====================================================================================================
# Array conversion shared by the review helpers (tensors, numpy arrays and sequences alike).
# ====================================================================================================

def as_1d(name: str, values: Any, dtype: type = np.float64) -> np.ndarray:
    """`values` (torch tensor on any device, numpy array, sequence) as a 1-D numpy array of `dtype`.

    Raises ValueError naming `name` when the input is not 1-D.
    """
    if hasattr(values, "detach"):  # torch.Tensor, without importing torch here
        values = values.detach().to("cpu").numpy()
    array: np.ndarray = np.asarray(values, dtype=dtype)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    return array


def same_length(**arrays: np.ndarray) -> int:
    """Common length of the given 1-D arrays; ValueError naming each length when they differ."""
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"per-sequence inputs must have one length, got {lengths}")
    return next(iter(lengths.values()), 0)


# ====================================================================================================
# Review plots as PNG files (matplotlib, Agg canvas; no pyplot global state, safe in any thread).
#
# Every function takes plain 1-D data (torch tensors, numpy arrays or sequences), writes one PNG and
# returns its path. Non-finite values are dropped and counted in the figure's note, never plotted.
# ====================================================================================================

_DPI = 100


def _figure(width: float = 6.4, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path | str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, format="png")
    return out


def _log_weights(weights: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(log of the positive finite weights, count of zeros, count of non-finite) of a weight array."""
    finite = np.isfinite(weights)
    zeros = int(np.sum(weights == 0))
    positive = weights[finite & (weights > 0)]
    return np.log(positive), zeros, int(np.sum(~finite))


def figure_is_weight_histogram(raw_weights: Any, applied_weights: Any, *, bins: int = 60,
                               title: str | None = None) -> Any:
    """The figure of `plot_is_weight_histogram` (two panels sharing the x axis: raw on top, applied below)."""
    raw = as_1d("raw_weights", raw_weights)
    applied = as_1d("applied_weights", applied_weights)
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    fig = _figure(6.4, 5.2)
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    logs = [_log_weights(a) for a in (raw, applied)]
    both = np.concatenate([values for values, _, _ in logs])
    # The x axis is log(weight) on a LINEAR scale: a log-scaled weight axis over a narrow range (fp32 engines
    # put every weight within 1e-6 of 1) shows a single "1" tick; a linear axis of log-ratios always gets
    # readable ticks, and matplotlib prints the scale (e.g. "1e-6") when the values are small.
    if both.size:
        lo, hi = float(both.min()), float(both.max())
        half = max(abs(lo), abs(hi), 1e-12)  # symmetric about log(w) = 0 (no mismatch)
        edges = np.linspace(-half * 1.05, half * 1.05, bins + 1)
    else:
        edges = np.linspace(-1.0, 1.0, bins + 1)
    for ax, (values, zeros, bad), data, label, color in (
        (top, logs[0], raw, "raw (before bounds)", "tab:blue"),
        (bottom, logs[1], applied, "applied (after truncation / masking)", "tab:orange"),
    ):
        extra = "".join([f", {zeros} zero" if zeros else "", f", {bad} non-finite" if bad else ""])
        if values.size:
            ax.hist(values, bins=edges, color=color, label=f"{label}: n={data.size}{extra}")
            ax.set_yscale("log")  # the tails (the tokens a bound acts on) are a handful among thousands
            ax.legend(fontsize=8, loc="upper right")
        else:
            ax.text(0.5, 0.5, f"{label}: no positive finite weights (n={data.size}{extra})", ha="center",
                    va="center", fontsize=8, transform=ax.transAxes)
        ax.axvline(0.0, color="black", lw=0.8, ls=":")
        ax.set_ylabel("tokens (log)")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 3), useOffset=False)
    top.tick_params(labelbottom=False)
    bottom.set_xlabel("log IS weight = log(pi_train / pi_rollout)   (0: no mismatch)")
    top.set_title(title or "IS weights: raw vs applied")
    return fig


def plot_is_weight_histogram(
    raw_weights: Any, applied_weights: Any, path: Path | str, *, bins: int = 60, title: str | None = None
) -> Path:
    """Histograms of the log IS weights before bounding (raw, top) and as applied (bottom); writes a PNG.

    Args:
        raw_weights: `[num_kept_tokens]` (or sequences) ratio pi_train / pi_rollout before truncation/masking.
        applied_weights: `[num_kept_tokens]` the weights that multiplied the loss.
        path: PNG to write.
        bins: number of equal-width bins of log(weight), symmetric about 0, shared by both panels.

    The panels share the x axis (log weight on a linear scale) so neither histogram hides the other. Zero
    weights (masked by MIS) and non-finite ones have no log: they are counted in the legend instead.
    """
    return _save(figure_is_weight_histogram(raw_weights, applied_weights, bins=bins, title=title), path)


def figure_mismatch_vs_length(
    response_lengths: Any,
    mismatch: Any,
    *,
    mismatch_label: str = "mean |log ratio|",
    num_bins: int = 10,
    title: str | None = None,
) -> Any:
    """The figure of `plot_mismatch_vs_length`."""
    lengths = as_1d("response_lengths", response_lengths)
    values = as_1d("mismatch", mismatch)
    same_length(response_lengths=lengths, mismatch=values)
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    ok = np.isfinite(lengths) & np.isfinite(values)
    lengths, values, dropped = lengths[ok], values[ok], int((~ok).sum())
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter(lengths, values, s=10, alpha=0.5, label=f"sequences (n={lengths.size})")
    if lengths.size:
        edges = np.linspace(lengths.min(), lengths.max() + 1e-9, num_bins + 1)
        which = np.clip(np.digitize(lengths, edges) - 1, 0, num_bins - 1)
        centers, means = [], []
        for b in range(num_bins):
            sel = which == b
            if sel.any():
                centers.append(0.5 * (edges[b] + edges[b + 1]))
                means.append(float(values[sel].mean()))
        ax.plot(centers, means, color="tab:red", marker="o", lw=1.5, label="binned mean")
        ax.legend(fontsize=8)
        if values.min() >= 0:  # a non-negative measure starts at 0 (small values must not float mid-axis)
            ax.set_ylim(bottom=0.0, top=max(float(values.max()) * 1.1, 1e-300))
    if dropped:
        ax.text(0.99, 0.01, f"{dropped} non-finite dropped", ha="right", va="bottom", fontsize=8,
                transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator

    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3), useOffset=False)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # lengths are whole tokens
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel(mismatch_label)
    ax.set_title(title or f"{mismatch_label} vs response length")
    return fig


def plot_mismatch_vs_length(
    response_lengths: Any,
    mismatch: Any,
    path: Path | str,
    *,
    mismatch_label: str = "mean |log ratio|",
    num_bins: int = 10,
    title: str | None = None,
) -> Path:
    """Per-sequence mismatch against response length: scatter plus the mean in equal-width length bins.

    Args:
        response_lengths: `[num_sequences]` response tokens per sequence.
        mismatch: `[num_sequences]` per-sequence mismatch, e.g. the k3 KL estimate or mean |log ratio|.
        path: PNG to write.
        mismatch_label: y-axis label naming the measure (and its estimator).
        num_bins: length bins of the binned-mean line.
    """
    fig = figure_mismatch_vs_length(response_lengths, mismatch, mismatch_label=mismatch_label, num_bins=num_bins,
                                    title=title)
    return _save(fig, path)


def _token_pairs(trainer_logprobs: Any, rollout_logprobs: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """(trainer, rollout) logprobs where both are finite, and how many pairs were dropped."""
    trainer = as_1d("trainer_logprobs", trainer_logprobs)
    rollout = as_1d("rollout_logprobs", rollout_logprobs)
    same_length(trainer_logprobs=trainer, rollout_logprobs=rollout)
    ok = np.isfinite(trainer) & np.isfinite(rollout)
    return trainer[ok], rollout[ok], int((~ok).sum())


def figure_token_probabilities(trainer_logprobs: Any, rollout_logprobs: Any, *, bins: int = 50,
                               title: str | None = None) -> Any:
    """The figure of `plot_token_probabilities` (two panels with colour bars)."""
    from matplotlib.colors import LogNorm

    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    trainer, rollout, dropped = _token_pairs(trainer_logprobs, rollout_logprobs)
    # a logprob a rounding above 0 would fall outside the [0, 1] bins and vanish from the count
    p_train, p_roll = np.clip(np.exp(trainer), 0.0, 1.0), np.clip(np.exp(rollout), 0.0, 1.0)
    fig = _figure(11.0, 4.6)
    left = fig.add_subplot(1, 2, 1)
    right = fig.add_subplot(1, 2, 2)
    note = f"n={p_train.size} tokens" + (f", {dropped} non-finite dropped" if dropped else "")
    if p_train.size:
        edges = np.linspace(0.0, 1.0, bins + 1)
        counts, _, _ = np.histogram2d(p_roll, p_train, bins=(edges, edges))
        image = left.pcolormesh(edges, edges, np.where(counts > 0, counts, np.nan).T, cmap="viridis",
                                norm=LogNorm(vmin=1, vmax=max(float(counts.max()), 1.0)))
        fig.colorbar(image, ax=left, label="tokens (log)")
        diff = p_train - p_roll
        half = max(float(np.abs(diff).max()), 1e-12) * 1.05
        diff_edges = np.linspace(-half, half, bins + 1)
        counts2, _, _ = np.histogram2d(p_roll, diff, bins=(edges, diff_edges))
        image2 = right.pcolormesh(edges, diff_edges, np.where(counts2 > 0, counts2, np.nan).T, cmap="viridis",
                                  norm=LogNorm(vmin=1, vmax=max(float(counts2.max()), 1.0)))
        fig.colorbar(image2, ax=right, label="tokens (log)")
        # NeMo-RL's token_mult_prob_error: mean exp(|log p_train - log p_rollout|) (1: identical)
        mult = float(np.mean(np.exp(np.abs(trainer - rollout))))
        pearson = float(np.corrcoef(p_roll, p_train)[0, 1]) if p_train.size > 1 and np.std(p_roll) > 0 \
            and np.std(p_train) > 0 else float("nan")
        note += f"\nmult. prob error {mult:.6g}, Pearson r {pearson:.6f}"
    else:
        for ax in (left, right):
            ax.text(0.5, 0.5, "no finite token pairs", ha="center", va="center", transform=ax.transAxes)
    left.plot([0, 1], [0, 1], color="gray", lw=0.6, ls="--", zorder=0)
    left.set_xlim(0, 1)
    left.set_ylim(0, 1)
    left.set_aspect("equal")
    left.set_xlabel("rollout probability (vLLM)")
    left.set_ylabel("trainer probability (Megatron)")
    left.set_title("trainer vs rollout probability per token")
    left.text(0.02, 0.98, note, ha="left", va="top", fontsize=7, transform=left.transAxes,
              bbox={"facecolor": "white", "edgecolor": "lightgray", "alpha": 0.9})
    right.axhline(0.0, color="gray", lw=0.6, ls="--", zorder=0)
    right.set_xlim(0, 1)
    right.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3), useOffset=False)
    right.set_xlabel("rollout probability (vLLM)")
    right.set_ylabel("trainer - rollout probability")
    right.set_title("probability error per token")
    if title:
        fig.suptitle(title)
    return fig


def plot_token_probabilities(trainer_logprobs: Any, rollout_logprobs: Any, path: Path | str, *, bins: int = 50,
                             title: str | None = None) -> Path:
    """NeMo-RL's token-probability view: 2-D histograms of the sampled tokens' probabilities; writes a PNG.

    Left: trainer probability against rollout probability (a perfect engine puts every token on the
    diagonal). Right: their difference against the rollout probability (the scale the left panel cannot
    show when the engines nearly agree). Colour is the token count on a log scale; the note gives NeMo-RL's
    multiplicative probability error mean(exp|log p_train - log p_rollout|) and the Pearson correlation.

    Args:
        trainer_logprobs / rollout_logprobs: `[num_tokens]` logprob of each sampled response token under the
            trainer and as the rollout engine reported it. Pairs with a non-finite value are dropped and counted.
        path: PNG to write.
        bins: bins per axis.
    """
    return _save(figure_token_probabilities(trainer_logprobs, rollout_logprobs, bins=bins, title=title), path)


def figure_mismatch_by_position(positions: Any, trainer_logprobs: Any, rollout_logprobs: Any, *,
                                max_bins: int = 64, title: str | None = None) -> Any:
    """The figure of `plot_mismatch_by_position` (mismatch on top, token count below, shared x axis)."""
    pos = as_1d("positions", positions)
    trainer = as_1d("trainer_logprobs", trainer_logprobs)
    rollout = as_1d("rollout_logprobs", rollout_logprobs)
    same_length(positions=pos, trainer_logprobs=trainer, rollout_logprobs=rollout)
    if max_bins < 1:
        raise ValueError(f"max_bins must be >= 1, got {max_bins}")
    ok = np.isfinite(pos) & np.isfinite(trainer) & np.isfinite(rollout)
    pos, abs_lr, dropped = pos[ok], np.abs(trainer[ok] - rollout[ok]), int((~ok).sum())
    fig = _figure(6.4, 5.2)
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    if pos.size:
        # One bin per position up to max_bins positions; longer responses share equal-width bins.
        last = int(pos.max())
        width = max(1, int(np.ceil((last + 1) / max_bins)))
        which = (pos // width).astype(np.int64)
        num = int(which.max()) + 1
        centers = (np.arange(num) + 0.5) * width - 0.5
        count = np.bincount(which, minlength=num)
        mean = np.bincount(which, weights=abs_lr, minlength=num) / np.maximum(count, 1)
        p90 = np.array([np.quantile(abs_lr[which == b], 0.9) if count[b] else np.nan for b in range(num)])
        peak = np.array([abs_lr[which == b].max() if count[b] else np.nan for b in range(num)])
        has = count > 0
        top.plot(centers[has], mean[has], color="tab:red", marker="o", ms=3, lw=1.5, label="mean")
        top.plot(centers[has], p90[has], color="tab:purple", lw=1.0, ls="--", label="90th percentile")
        top.plot(centers[has], peak[has], color="tab:gray", lw=0.8, ls=":", label="max")
        # headroom above the max line for a one-row legend, so it never covers a spike
        top.set_ylim(bottom=0.0, top=max(float(np.nanmax(peak)) * 1.35, 1e-300))
        top.legend(fontsize=8, loc="upper left", ncol=3)
        bottom.bar(centers, count, width=width * 0.9, color="tab:blue")
        label = "response position (token index)" + (f", bins of {width}" if width > 1 else "")
    else:
        top.text(0.5, 0.5, "no finite tokens", ha="center", va="center", transform=top.transAxes)
        label = "response position (token index)"
    if dropped:
        top.text(0.99, 0.98, f"{dropped} non-finite dropped", ha="right", va="top", fontsize=8,
                 transform=top.transAxes)
    top.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3), useOffset=False)
    top.set_ylabel("|log p_train - log p_rollout|")
    top.tick_params(labelbottom=False)
    bottom.set_ylabel("tokens")
    bottom.set_xlabel(label)
    top.set_title(title or "mismatch by token position")
    return fig


def plot_mismatch_by_position(positions: Any, trainer_logprobs: Any, rollout_logprobs: Any, path: Path | str, *,
                              max_bins: int = 64, title: str | None = None) -> Path:
    """Token mismatch |log p_train - log p_rollout| by position in the response (mean, p90, max); writes a PNG.

    Args:
        positions: `[num_tokens]` 0-based index of each token in its response.
        trainer_logprobs / rollout_logprobs: `[num_tokens]` the token's logprob under the trainer and the engine.
        path: PNG to write.
        max_bins: at most this many position bins (one per position when responses are shorter).

    The lower panel counts the tokens per position: late positions exist only in long responses, so their
    statistics rest on fewer tokens.
    """
    fig = figure_mismatch_by_position(positions, trainer_logprobs, rollout_logprobs, max_bins=max_bins, title=title)
    return _save(fig, path)


def plot_reward_curve(
    steps: Sequence[int] | Any,
    mean_reward: Any,
    path: Path | str,
    *,
    std: Any | None = None,
    title: str | None = None,
) -> Path:
    """Mean reward per step, with an optional mean +- std band.

    Args:
        steps: `[num_points]` training steps.
        mean_reward: `[num_points]` mean reward at each step.
        std: `[num_points]` reward standard deviation at each step, or None for no band.
        path: PNG to write.
    """
    x = as_1d("steps", steps)
    y = as_1d("mean_reward", mean_reward)
    arrays = {"steps": x, "mean_reward": y}
    if std is not None:
        arrays["std"] = as_1d("std", std)
    same_length(**arrays)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(x, y, color="tab:green", marker="o" if x.size < 50 else None, lw=1.5, label="mean reward")
    if std is not None:
        s = arrays["std"]
        ax.fill_between(x, y - s, y + s, color="tab:green", alpha=0.2, label="+- std")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers: no 1.2, 1.4 ticks
    if x.size == 1:  # one point: give the locator whole steps on both sides to tick
        ax.set_xlim(float(x[0]) - 1.0, float(x[0]) + 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title or "reward")
    ax.legend(fontsize=8)
    return _save(fig, path)


# ====================================================================================================
# Worst-sequences table: the top-k sequences of a step by a chosen mismatch key, as Parquet (pyarrow).
#
# Columns (one row per sequence, sorted worst first):
#   step (int64), sample_index (int64), prompt (string), response (string), response_length (int64),
#   seq_log_ratio_sum (float64: sum over the response of log pi_train - log pi_rollout),
#   max_abs_log_ratio (float64: max over tokens of |log ratio|), kl (float64: per-sequence KL estimate),
#   is_weight (float64: the sequence's applied IS weight, or its mean token weight), kept (bool: survived
#   rejection), reward (float64).
# ====================================================================================================

# sort_by name -> how "worse" is measured (descending)
SORT_KEYS = {
    "max_abs_log_ratio": lambda t: np.abs(t.max_abs_log_ratio),
    "abs_seq_log_ratio_sum": lambda t: np.abs(t.seq_log_ratio_sum),
    "seq_log_ratio_sum": lambda t: t.seq_log_ratio_sum,
    "kl": lambda t: t.kl,
    "is_weight": lambda t: t.is_weight,
    "neg_reward": lambda t: -t.reward,
}

COLUMNS = (
    "step",
    "sample_index",
    "prompt",
    "response",
    "response_length",
    "seq_log_ratio_sum",
    "max_abs_log_ratio",
    "kl",
    "is_weight",
    "kept",
    "reward",
)


@dataclass
class SequenceReview:
    """Per-sequence review data of one step; every array field is `[num_sequences]`.

    Build it with `SequenceReview.create(...)`, which converts tensors/arrays and checks lengths.
    """

    prompts: list[str]
    responses: list[str]
    response_lengths: np.ndarray
    seq_log_ratio_sum: np.ndarray
    max_abs_log_ratio: np.ndarray
    kl: np.ndarray
    is_weight: np.ndarray
    kept: np.ndarray
    reward: np.ndarray
    sample_index: np.ndarray

    @classmethod
    def create(
        cls,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        response_lengths: Any,
        seq_log_ratio_sum: Any,
        max_abs_log_ratio: Any,
        kl: Any,
        is_weight: Any,
        kept: Any,
        reward: Any,
        sample_index: Any | None = None,
    ) -> SequenceReview:
        """Convert and validate; `sample_index` defaults to 0..n-1 (the position in the step's batch)."""
        arrays = {
            "response_lengths": as_1d("response_lengths", response_lengths, np.int64),
            "seq_log_ratio_sum": as_1d("seq_log_ratio_sum", seq_log_ratio_sum),
            "max_abs_log_ratio": as_1d("max_abs_log_ratio", max_abs_log_ratio),
            "kl": as_1d("kl", kl),
            "is_weight": as_1d("is_weight", is_weight),
            "kept": as_1d("kept", kept, bool),
            "reward": as_1d("reward", reward),
        }
        n = same_length(**arrays, prompts=np.empty(len(prompts)), responses=np.empty(len(responses)))
        index = np.arange(n, dtype=np.int64) if sample_index is None else as_1d("sample_index", sample_index, np.int64)
        same_length(sample_index=index, response_lengths=arrays["response_lengths"])
        return cls(prompts=[str(p) for p in prompts], responses=[str(r) for r in responses], sample_index=index,
                   **arrays)

    def __len__(self) -> int:
        return len(self.prompts)


def worst_order(review: SequenceReview, sort_by: str) -> np.ndarray:
    """Indices of `review` worst first by `sort_by` (a SORT_KEYS name); NaN/inf count as worst of all."""
    if sort_by not in SORT_KEYS:
        raise ValueError(f"sort_by={sort_by!r}: allowed {', '.join(SORT_KEYS)}")
    key = np.asarray(SORT_KEYS[sort_by](review), dtype=np.float64)
    # A non-finite mismatch is the most interesting row: rank it above every finite one.
    key = np.where(np.isfinite(key), key, np.inf)
    return np.argsort(-key, kind="stable")


def write_worst_sequences(
    review: SequenceReview, step: int, path: Path | str, *, top_k: int = 16, sort_by: str = "max_abs_log_ratio"
) -> Path:
    """Write the `top_k` worst sequences of `review` by `sort_by` to a Parquet file; return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    order = worst_order(review, sort_by)[:top_k]
    table = pa.table(
        {
            "step": pa.array(np.full(order.size, step, dtype=np.int64)),
            "sample_index": pa.array(review.sample_index[order]),
            "prompt": pa.array([review.prompts[i] for i in order], pa.string()),
            "response": pa.array([review.responses[i] for i in order], pa.string()),
            "response_length": pa.array(review.response_lengths[order]),
            "seq_log_ratio_sum": pa.array(review.seq_log_ratio_sum[order]),
            "max_abs_log_ratio": pa.array(review.max_abs_log_ratio[order]),
            "kl": pa.array(review.kl[order]),
            "is_weight": pa.array(review.is_weight[order]),
            "kept": pa.array(review.kept[order]),
            "reward": pa.array(review.reward[order]),
        }
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata({"sort_by": sort_by}), out)
    return out


# ====================================================================================================
# One call per review step: plots + worst-sequences table into `review/step_<n>/`, logged as artifacts.
# ====================================================================================================

logger = logging.getLogger("nemo_rollout_correction.tracking")

IS_HISTOGRAM = "is_weights.png"
MISMATCH_VS_LENGTH = "mismatch_vs_length.png"
REWARD_CURVE = "reward.png"
TOKEN_PROBABILITIES = "token_probabilities.png"
MISMATCH_BY_POSITION = "mismatch_by_position.png"
KL_LABEL = "KL(rollout || train) per token, k3 estimator"
WORST_SEQUENCES = "worst_sequences.parquet"


@dataclass(frozen=True)
class RewardHistory:
    """Reward curve so far: `[num_points]` steps, mean reward, optional std."""

    steps: Any
    mean: Any
    std: Any | None = None


@dataclass(frozen=True)
class TokenReview:
    """Per-token data of one step's response tokens, each `[num_tokens]` (one entry per response token).

    trainer_logprobs: the trainer's logprob of the sampled token (old_logprobs, or the loss pass's in bypass
    mode); rollout_logprobs: the engine's; positions: 0-based index of the token in its response.
    """

    trainer_logprobs: Any
    rollout_logprobs: Any
    positions: Any

    @classmethod
    def create(cls, *, trainer_logprobs: Any, rollout_logprobs: Any, positions: Any) -> TokenReview:
        """Convert to 1-D float64 arrays and check the lengths agree."""
        arrays = {name: as_1d(name, value) for name, value in
                  (("trainer_logprobs", trainer_logprobs), ("rollout_logprobs", rollout_logprobs),
                   ("positions", positions))}
        same_length(**arrays)
        return cls(**arrays)


def review_dir_name(step: int) -> str:
    """`step_000012`: zero-padded so the MLflow artifact browser lists steps in order."""
    return f"step_{step:06d}"


def write_review_artifacts(
    out_dir: Path | str,
    step: int,
    *,
    raw_is_weights: Any,
    applied_is_weights: Any,
    sequences: SequenceReview,
    rewards: RewardHistory | None = None,
    tokens: TokenReview | None = None,
    top_k: int = 16,
    sort_by: str = "max_abs_log_ratio",
    mismatch: str = "kl",
) -> Path:
    """Write the review files of one step into `<out_dir>/step_<n>/` and return that directory.

    Args:
        raw_is_weights / applied_is_weights: `[num_kept_tokens]` IS weights before bounding and as applied.
        sequences: per-sequence data of the step (`[num_sequences]` each).
        rewards: reward history for the curve (skipped when None).
        tokens: per-token logprobs for the token-probability and by-position plots (skipped when None).
        top_k / sort_by: worst-sequences table size (0: no table) and ranking key (see tables.SORT_KEYS).
        mismatch: y of the length plot: "kl" (`sequences.kl`, the per-token k3 estimate of KL(rollout || train),
            non-negative) or "mean_abs_log_ratio" (|seq log-ratio sum| / length).
    """
    import numpy as np

    directory = Path(out_dir) / review_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    plot_is_weight_histogram(raw_is_weights, applied_is_weights, directory / IS_HISTOGRAM,
                             title=f"IS weights, step {step}")
    if mismatch == "kl":
        y, label = sequences.kl, KL_LABEL
    elif mismatch == "mean_abs_log_ratio":
        lengths = np.maximum(sequences.response_lengths, 1)
        y, label = np.abs(sequences.seq_log_ratio_sum) / lengths, "|seq log ratio| / length"
    else:
        raise ValueError(f"mismatch={mismatch!r}: allowed 'kl', 'mean_abs_log_ratio'")
    plot_mismatch_vs_length(sequences.response_lengths, y, directory / MISMATCH_VS_LENGTH, mismatch_label=label,
                            title=f"{label} vs length, step {step}")
    if rewards is not None:
        plot_reward_curve(rewards.steps, rewards.mean, directory / REWARD_CURVE, std=rewards.std)
    if tokens is not None:
        plot_token_probabilities(tokens.trainer_logprobs, tokens.rollout_logprobs, directory / TOKEN_PROBABILITIES,
                                 title=f"token probabilities, step {step}")
        plot_mismatch_by_position(tokens.positions, tokens.trainer_logprobs, tokens.rollout_logprobs,
                                  directory / MISMATCH_BY_POSITION, title=f"mismatch by token position, step {step}")
    if top_k > 0:  # tracking.worst_sequences=0 turns the table off
        write_worst_sequences(sequences, step, directory / WORST_SEQUENCES, top_k=top_k, sort_by=sort_by)
    return directory


def log_review_artifacts(
    tracker: MlflowTracker,
    step: int,
    *,
    raw_is_weights: Any,
    applied_is_weights: Any,
    sequences: SequenceReview,
    rewards: RewardHistory | None = None,
    tokens: TokenReview | None = None,
    top_k: int = 16,
    sort_by: str = "max_abs_log_ratio",
    mismatch: str = "kl",
    out_dir: Path | str | None = None,
) -> Path | None:
    """Write the review files (see write_review_artifacts) and log them as artifacts `review/step_<n>/`.

    Files go to `out_dir` (default `<run_dir>/review/`). Only the active rank writes; others return None.
    A failure while writing (a plotting corner case, a full disk) is logged with its traceback and returns
    None: review files are diagnostics and must not end a training run.
    """
    if not tracker.active:
        return None
    try:
        directory = write_review_artifacts(
            out_dir if out_dir is not None else tracker.run_dir / "review",
            step,
            raw_is_weights=raw_is_weights,
            applied_is_weights=applied_is_weights,
            sequences=sequences,
            rewards=rewards,
            tokens=tokens,
            top_k=top_k,
            sort_by=sort_by,
            mismatch=mismatch,
        )
    except Exception:
        logger.exception("writing review artifacts for step %d failed; training continues without them", step)
        return None
    tracker.log_artifact(directory, f"review/{review_dir_name(step)}")
    return directory

"""Review plots as PNG files (matplotlib, Agg canvas; no pyplot global state, safe in any thread).

Every function takes plain 1-D data (torch tensors, numpy arrays or sequences), writes one PNG and
returns its path. Non-finite values are dropped and counted in the figure's note, never plotted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .arrays import as_1d, same_length

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


def plot_is_weight_histogram(
    raw_weights: Any, applied_weights: Any, path: Path | str, *, bins: int = 60, title: str | None = None
) -> Path:
    """Histogram of IS weights before bounding (raw) and as applied, on a log-scale x axis.

    Args:
        raw_weights: `[num_kept_tokens]` (or sequences) ratio pi_train / pi_rollout before truncation/masking.
        applied_weights: `[num_kept_tokens]` the weights that multiplied the loss.
        path: PNG to write.
        bins: number of log-spaced bins spanning both inputs' positive finite range.

    Zero weights (masked by MIS) cannot sit on a log axis: they are counted in the legend instead.
    """
    raw = as_1d("raw_weights", raw_weights)
    applied = as_1d("applied_weights", applied_weights)
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    positives = [a[np.isfinite(a) & (a > 0)] for a in (raw, applied)]
    both = np.concatenate(positives)
    if both.size:
        lo, hi = float(both.min()), float(both.max())
        if lo == hi:
            lo, hi = lo / 1.5, hi * 1.5
        edges = np.geomspace(lo, hi, bins + 1)
        for data, values, label, color in (
            (raw, positives[0], "raw", "tab:blue"),
            (applied, positives[1], "applied", "tab:orange"),
        ):
            zeros = int(np.sum(data == 0))
            bad = int(np.sum(~np.isfinite(data)))
            extra = "".join(
                [f", {zeros} zero" if zeros else "", f", {bad} non-finite" if bad else ""]
            )
            ax.hist(values, bins=edges, alpha=0.55, color=color, label=f"{label} (n={data.size}{extra})")
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_xscale("log")
        # Readable ticks at 1-2-5 per decade (matplotlib's minor log labels overlap on narrow ranges).
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axvline(1.0, color="black", lw=0.8, ls=":")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no positive finite weights", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("IS weight (pi_train / pi_rollout), log scale")
    ax.set_ylabel("tokens")
    ax.set_title(title or "IS weights: raw vs applied")
    return _save(fig, path)


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
        mismatch: `[num_sequences]` per-sequence mismatch, e.g. KL(rollout || train) or mean |log ratio|.
        path: PNG to write.
        mismatch_label: y-axis label naming the measure.
        num_bins: length bins of the binned-mean line.
    """
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
    if dropped:
        ax.text(0.99, 0.01, f"{dropped} non-finite dropped", ha="right", va="bottom", fontsize=8,
                transform=ax.transAxes)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel(mismatch_label)
    ax.set_title(title or f"{mismatch_label} vs response length")
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
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title or "reward")
    ax.legend(fontsize=8)
    return _save(fig, path)

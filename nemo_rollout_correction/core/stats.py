"""Mergeable partial statistics and the log-space histogram used for quantiles.

The reduction contract (DESIGN.md): core never divides by a count it did not receive. It
returns `Partials` (sums, maxima, minima) that any caller can combine across chunks,
microbatches or ranks with SUM / MAX / MIN, and only `finalize` turns them into ratios.
Quantiles use a fixed histogram grid so they merge exactly by summing counts and work at any
tensor size (torch.quantile refuses inputs above ~16M elements).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Partials:
    """Named partial statistics, each tagged by how it combines: SUM, MAX or MIN.

    Values are float64 tensors: scalars for batch statistics, `[batch]` vectors for
    per-sequence statistics, `[num_bins]` vectors for histograms (which are sums).
    """

    sums: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)

    def add_sum(self, name: str, value: Tensor) -> None:
        """Accumulate `value` into the SUM statistic `name`."""
        value = value.to(torch.float64)
        current = self.sums.get(name)
        self.sums[name] = value if current is None else current + value

    def add_max(self, name: str, value: Tensor) -> None:
        """Accumulate `value` into the MAX statistic `name`."""
        value = value.to(torch.float64)
        current = self.maxs.get(name)
        self.maxs[name] = value if current is None else torch.maximum(current, value)

    def add_min(self, name: str, value: Tensor) -> None:
        """Accumulate `value` into the MIN statistic `name`."""
        value = value.to(torch.float64)
        current = self.mins.get(name)
        self.mins[name] = value if current is None else torch.minimum(current, value)

    def merge(self, other: Partials) -> None:
        """Combine `other` into self (chunks, microbatches or ranks of the same step)."""
        for name, value in other.sums.items():
            self.add_sum(name, value)
        for name, value in other.maxs.items():
            self.add_max(name, value)
        for name, value in other.mins.items():
            self.add_min(name, value)

    @staticmethod
    def concat(parts: Iterable[Partials]) -> Partials:
        """Concatenate per-sequence partials of consecutive row chunks along the batch dim."""
        parts = list(parts)
        out = Partials()
        if not parts:
            return out
        for kind in ("sums", "maxs", "mins"):
            target: dict[str, Tensor] = getattr(out, kind)
            for name in getattr(parts[0], kind):
                target[name] = torch.cat([getattr(p, kind)[name] for p in parts])
        return out

    def slice_rows(self, start: int, stop: int) -> Partials:
        """The per-sequence partials of rows `[start, stop)`."""
        return Partials(
            sums={k: v[start:stop] for k, v in self.sums.items()},
            maxs={k: v[start:stop] for k, v in self.maxs.items()},
            mins={k: v[start:stop] for k, v in self.mins.items()},
        )

    def get_sum(self, name: str) -> float:
        """A scalar SUM statistic as a Python float (0.0 when absent)."""
        value = self.sums.get(name)
        return 0.0 if value is None else float(value)


class LogHistogram:
    """A fixed, mergeable histogram of log-values u = log(x), with about 1% relative resolution.

    Bin centres sit at u = U0 * sinh(j * ln(G)) for integer j in [-K, K]: linear within U0 of 0
    and geometric (ratio G) beyond, so a log-ratio of 0.004 and one of 15 are both resolved to
    about 0.5% of their size. Counts merge by addition, so quantiles of a sum of histograms are
    exactly the quantiles of the concatenated data at this resolution.
    """

    U0 = 1e-6
    LOG_G = math.log(1.01)
    U_MAX = 20.0  # log-ratios are clamped to +-20 before exp (DESIGN.md decision 3)
    K = math.ceil(math.asinh(U_MAX / U0) / LOG_G) + 1
    NUM_BINS = 2 * K + 1

    @classmethod
    def bin_coordinate(cls, u: Tensor) -> Tensor:
        """The continuous bin coordinate t in [-K, K] of log-values `u` (same shape)."""
        return torch.asinh(u * (1.0 / cls.U0)).mul_(1.0 / cls.LOG_G)

    @classmethod
    def count(cls, u: Tensor, valid: Tensor) -> Tensor:
        """Counts `[NUM_BINS]` (float64) of the log-values `u` where `valid` is True."""
        t = cls.bin_coordinate(u)
        # Out-of-range values are ignored by histc, so invalid positions are moved outside.
        t = torch.where(valid, t, torch.full_like(t, 4.0 * cls.K))
        counts = torch.histc(t, bins=cls.NUM_BINS, min=-cls.K - 0.5, max=cls.K + 0.5)
        return counts.to(torch.float64)

    @classmethod
    def count_weighted(cls, u: Tensor, weights: Tensor) -> Tensor:
        """Counts `[NUM_BINS]` (float64) of `u` with per-value weights (e.g. a sequence's token count)."""
        index = torch.round(cls.bin_coordinate(u.to(torch.float64))).long().clamp_(-cls.K, cls.K) + cls.K
        return torch.bincount(index, weights=weights.to(torch.float64), minlength=cls.NUM_BINS)

    @classmethod
    def centers(cls) -> Tensor:
        """The log-value represented by each bin, `[NUM_BINS]` float64."""
        j = torch.arange(-cls.K, cls.K + 1, dtype=torch.float64)
        return torch.sinh(j * cls.LOG_G) * cls.U0

    @classmethod
    def quantiles(cls, counts: Tensor, qs: Iterable[float], *, zero_count: float = 0.0) -> list[float]:
        """Quantiles of exp(u) for the histogram `counts`, plus `zero_count` values equal to 0.

        Returns 0.0 for every quantile when the histogram is empty.
        """
        qs = list(qs)
        total = float(counts.sum()) + zero_count
        if total <= 0:
            return [0.0] * len(qs)
        cdf = torch.cumsum(counts, 0) + zero_count
        values = torch.exp(cls.centers())
        out: list[float] = []
        for q in qs:
            target = q * total
            if zero_count >= target and zero_count > 0:
                out.append(0.0)
                continue
            index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64)).item())
            out.append(float(values[min(index, cls.NUM_BINS - 1)]))
        return out

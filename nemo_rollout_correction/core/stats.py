"""Mergeable partial statistics and the log-space histogram used for quantiles.

The reduction contract (docs/design.md): core never divides by a count it did not receive. It
returns `Partials` (sums, maxima, minima) that any caller can combine across chunks,
microbatches or ranks with SUM / MAX / MIN, and only `finalize` turns them into ratios.
Quantiles use a fixed histogram grid so they merge exactly by summing counts and work at any
tensor size (torch.quantile refuses inputs above ~16M elements).
"""

from __future__ import annotations

import functools
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
        if value.dtype != torch.float64:  # most callers already pass float64; skip the dispatch
            value = value.to(torch.float64)
        current = self.sums.get(name)
        self.sums[name] = value if current is None else current + value

    def add_max(self, name: str, value: Tensor) -> None:
        """Accumulate `value` into the MAX statistic `name`."""
        if value.dtype != torch.float64:  # most callers already pass float64; skip the dispatch
            value = value.to(torch.float64)
        current = self.maxs.get(name)
        self.maxs[name] = value if current is None else torch.maximum(current, value)

    def add_min(self, name: str, value: Tensor) -> None:
        """Accumulate `value` into the MIN statistic `name`."""
        if value.dtype != torch.float64:  # most callers already pass float64; skip the dispatch
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
        if len(parts) == 1:
            return parts[0]
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
        """A scalar SUM statistic as a Python float; KeyError naming the present ones when absent.

        Absent is an error, not 0.0: a misspelt denominator key must not silently zero a loss.
        Use `name in partials.sums` for a statistic that a configuration may not produce.
        """
        value = self.sums.get(name)
        if value is None:
            raise KeyError(f"no SUM partial {name!r}; present: {sorted(self.sums)}")
        return float(value)


class LogHistogram:
    """A fixed, mergeable histogram of log-values u = log(x), resolving |u| to within 0.8%.

    The bin of a float32 log-value is read straight from its bit pattern: the sign, the 8
    exponent bits and the top 7 mantissa bits, i.e. 128 bins per octave of |u|. That is exact,
    branch-free and far cheaper than a transcendental transform. Magnitudes below 2^-24 share
    one central bin (u ~ 0, a ratio within 6e-8 of 1); log-values are clamped to +-20 upstream
    so nothing reaches 2^5. Counts merge by addition, so the quantiles of a sum of histograms
    are exactly the quantiles of the concatenated data at this resolution.
    """

    SHIFT = 16  # keep sign + exponent + 7 mantissa bits of the float32 pattern
    MAG_LO = (127 - 24) << 7  # magnitude key of 2^-24
    MAG_HI = ((127 + 5) << 7) - 1  # last magnitude key below 2^5 = 32 > 20
    SIDE = MAG_HI - MAG_LO + 1
    NUM_BINS = 2 * SIDE + 1
    CENTER = SIDE  # index of the |u| < 2^-24 bin

    @classmethod
    def _compress(cls, raw: Tensor) -> Tensor:
        """Map `[65536]` counts indexed by (key + 32768) to `[NUM_BINS]` ordered by value."""
        positive = raw[32768 + cls.MAG_LO : 32768 + cls.MAG_HI + 1]
        negative = raw[cls.MAG_LO : cls.MAG_HI + 1].flip(0)  # larger magnitude = smaller value
        tiny = raw[32768 : 32768 + cls.MAG_LO].sum() + raw[: cls.MAG_LO].sum()
        return torch.cat([negative, tiny.reshape(1), positive]).to(torch.float64)

    @classmethod
    def _raw_index(cls, u: Tensor) -> Tensor:
        # Arithmetic shift of the int32 view (negative floats map to negative keys), kept in int32:
        # bincount accepts it, and torch.bitwise_right_shift is several times cheaper than `>>`.
        keys = torch.bitwise_right_shift(u.contiguous().view(torch.int32), cls.SHIFT)
        return keys.add_(32768).flatten()

    @classmethod
    def count(cls, u: Tensor, num_ignored_zeros: int = 0) -> Tensor:
        """Counts `[NUM_BINS]` (float64) of float32 log-values `u`.

        Masked-out positions must hold 0 (or -0); pass their number as `num_ignored_zeros`
        and they are removed from the central bin.
        """
        raw = torch.bincount(cls._raw_index(u), minlength=65536)
        counts = cls._compress(raw)
        counts[cls.CENTER] -= num_ignored_zeros
        return counts

    @classmethod
    def count_weighted(cls, u: Tensor, weights: Tensor) -> Tensor:
        """Counts `[NUM_BINS]` (float64) of log-values `u` with per-value weights (e.g. token counts)."""
        index = cls._raw_index(u.float())
        raw = torch.bincount(index, weights=weights.to(torch.float64).flatten(), minlength=65536)
        return cls._compress(raw)

    @classmethod
    def centers(cls) -> Tensor:
        """The log-value represented by each bin (the middle of its float range), `[NUM_BINS]` float64."""
        return _bin_centers(cls.MAG_LO, cls.MAG_HI, cls.SHIFT)

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
        values = _bin_values(cls.MAG_LO, cls.MAG_HI, cls.SHIFT)
        targets = torch.tensor([q * total for q in qs], dtype=torch.float64)
        indices = torch.searchsorted(cdf, targets).clamp_(max=cls.NUM_BINS - 1)
        picked = values[indices].tolist()
        # Quantiles inside the mass of exact zeros are 0.
        return [0.0 if zero_count > 0 and zero_count >= q * total else v for q, v in zip(qs, picked, strict=True)]


@functools.lru_cache(maxsize=4)
def _bin_centers(mag_lo: int, mag_hi: int, shift: int) -> Tensor:
    keys = torch.arange(mag_lo, mag_hi + 1, dtype=torch.int32)
    magnitude = ((keys << shift) | (1 << (shift - 1))).view(torch.float32).double()
    return torch.cat([-magnitude.flip(0), torch.zeros(1, dtype=torch.float64), magnitude])


@functools.lru_cache(maxsize=4)
def _bin_values(mag_lo: int, mag_hi: int, shift: int) -> Tensor:
    return torch.exp(_bin_centers(mag_lo, mag_hi, shift))

"""Array conversion shared by the review helpers (tensors, numpy arrays and sequences alike)."""

from __future__ import annotations

from typing import Any

import numpy as np


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

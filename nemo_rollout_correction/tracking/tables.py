"""Worst-sequences table: the top-k sequences of a step by a chosen mismatch key, as Parquet (pyarrow).

Columns (one row per sequence, sorted worst first):
  step (int64), sample_index (int64), prompt (string), response (string), response_length (int64),
  seq_log_ratio_sum (float64: sum over the response of log pi_train - log pi_rollout),
  max_abs_log_ratio (float64: max over tokens of |log ratio|), kl (float64: per-sequence KL estimate),
  is_weight (float64: the sequence's applied IS weight, or its mean token weight), kept (bool: survived
  rejection), reward (float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .arrays import as_1d, same_length

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

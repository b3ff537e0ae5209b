"""Prompt datasets for the GRPO trainer: records, JSONL/Parquet loading, and a resumable sampler.

A dataset is a list of :class:`PromptRecord`. Files are JSON Lines (one object per line) or
Parquet (one row per record); the prompt column is required, the answer column optional, and
every other field is kept in ``metadata`` so a reward function can use it (for example a
per-record ``target_length``). See docs/tasks.md for the format.

Pure Python + numpy: ``pyarrow`` is imported only when a Parquet file is read.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "DatasetError",
    "PromptRecord",
    "PromptSampler",
    "load_prompt_dataset",
    "records_from_dicts",
]

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A prompt dataset cannot be read; the message names the file and the line or row."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset.

    Attributes:
        prompt: the user message (the chat template, if any, is applied by the trainer).
        answer: reference answer as a string (numbers are stored as their JSON text), or ``None``.
        metadata: every other field of the source record, untouched (e.g. ``target_length``).
    """

    prompt: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def load_prompt_dataset(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[PromptRecord]:
    """Read a prompt dataset from a ``.jsonl`` or ``.parquet`` file.

    Args:
        path: the file. JSONL: one JSON object per line, blank lines ignored. Parquet: one row per record.
        prompt_key: field holding the prompt; required, a non-empty string in every record.
        answer_key: field holding the reference answer; optional per record (``None`` when absent).
            Strings are kept, numbers are converted with ``str`` (``5`` -> ``"5"``, ``2.5`` -> ``"2.5"``).

    Returns:
        ``[num_records]`` records in file order.

    Raises:
        DatasetError: missing file, unsupported extension, invalid JSON, a record that is not an
            object, a missing/empty/non-string prompt, an answer that is not a string or number, or
            no records at all. The message names the file and the 1-based line (JSONL) or 0-based
            row (Parquet).
        ImportError: a Parquet file is read and ``pyarrow`` is not installed.
    """
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        allowed = ", ".join(SUPPORTED_EXTENSIONS)
        raise DatasetError(f"{file}: unsupported dataset extension {file.suffix or '(none)'!r}; allowed: {allowed}")
    if not file.is_file():
        raise DatasetError(f"{file}: dataset file not found" if not file.exists() else f"{file}: not a regular file")
    rows = _read_jsonl(file) if suffix == ".jsonl" else _read_parquet(file)
    records = [_to_record(row, where, file, prompt_key, answer_key) for where, row in rows]
    if not records:
        raise DatasetError(f"{file}: dataset is empty (no records)")
    return records


def records_from_dicts(
    rows: Sequence[dict[str, Any]], prompt_key: str = "prompt", answer_key: str = "answer", source: str = "<memory>"
) -> list[PromptRecord]:
    """Build records from in-memory dicts with the same checks as :func:`load_prompt_dataset`."""
    records = [
        _to_record(row, f"item {index}", Path(source), prompt_key, answer_key) for index, row in enumerate(rows)
    ]
    if not records:
        raise DatasetError(f"{source}: dataset is empty (no records)")
    return records


def _read_jsonl(file: Path) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    with file.open("rb") as handle:  # bytes, so a bad encoding is reported with its line number
        for line_number, raw in enumerate(handle, start=1):
            try:
                # utf-8-sig on the first line drops a byte-order mark that some editors write
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(f"{file}: line {line_number}: not valid UTF-8 ({error.reason})") from error
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) carry no record
            try:
                rows.append((f"line {line_number}", json.loads(line)))
            except json.JSONDecodeError as error:
                reason = f"{error.msg} at column {error.colno}"
                raise DatasetError(f"{file}: line {line_number}: invalid JSON ({reason})") from error
    return rows


def _read_parquet(file: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq  # lazy: only Parquet needs it
    except ImportError as error:
        raise ImportError(
            f"{file}: reading Parquet datasets needs pyarrow (`pip install pyarrow`, or the `mlflow` extra "
            "which brings it); JSON Lines (.jsonl) needs nothing extra"
        ) from error
    try:
        table = pq.read_table(file)
    except Exception as error:  # pyarrow raises several types for a corrupt file
        raise DatasetError(f"{file}: not a readable Parquet file ({error})") from error
    return [(f"row {index}", row) for index, row in enumerate(table.to_pylist())]


def _to_record(row: Any, where: str, file: Path, prompt_key: str, answer_key: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise DatasetError(f"{file}: {where}: expected a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        keys = sorted(str(key) for key in row)
        close = difflib.get_close_matches(prompt_key, keys, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(k) for k in close)}? (set task.prompt_key)" if close else ""
        raise DatasetError(f"{file}: {where}: missing prompt key {prompt_key!r}; keys present: {keys}{hint}")
    prompt = row[prompt_key]
    if not isinstance(prompt, str) or not prompt.strip():
        shown = repr(prompt) if not isinstance(prompt, str) else "an empty string"
        raise DatasetError(f"{file}: {where}: prompt {prompt_key!r} must be a non-empty string, got {shown}")
    answer = _answer_text(row.get(answer_key), where, file, answer_key)
    metadata = {key: value for key, value in row.items() if key not in (prompt_key, answer_key)}
    return PromptRecord(prompt=prompt, answer=answer, metadata=metadata)


def _answer_text(value: Any, where: str, file: Path, answer_key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    # bool is an int subclass; True as an answer is almost surely a data bug, so refuse it.
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise DatasetError(
        f"{file}: {where}: answer {answer_key!r} must be a string, a finite number or absent, got {value!r}"
    )


class PromptSampler:
    """Deterministic, epoch-shuffled batches of prompts; resumable from :meth:`state_dict`.

    Epoch ``e`` visits the records in the order ``permutation(seed, e)``, a pure function of the
    seed and the epoch number, so the state is just ``(seed, epoch, position)``: a sampler restored
    from a state dict yields exactly the batches the original would have yielded next. A batch that
    reaches the end of an epoch continues into the next epoch's order (every batch has exactly
    ``prompts_per_step`` records; if ``prompts_per_step > len(records)`` a batch holds repeats).

    Args:
        records: the dataset, ``[num_records]``; must be non-empty.
        prompts_per_step: records per :meth:`next_batch`; must be >= 1.
        seed: a non-negative integer.
        shuffle: ``False`` visits records in file order every epoch (for evaluation).
    """

    def __init__(
        self, records: Sequence[PromptRecord], prompts_per_step: int, seed: int = 0, *, shuffle: bool = True
    ) -> None:
        if len(records) == 0:
            raise ValueError("PromptSampler needs at least one record, got an empty dataset")
        if isinstance(prompts_per_step, bool) or not isinstance(prompts_per_step, int) or prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be an integer >= 1, got {prompts_per_step!r}")
        _check_seed(seed)
        self._records = list(records)
        self.prompts_per_step = prompts_per_step
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next record to yield
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._records)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """``[num_records]`` visiting order of ``epoch``; depends only on (seed, epoch)."""
        if not self.shuffle:
            return np.arange(len(self._records))
        # SeedSequence mixes (seed, epoch) into independent streams, so epoch orders do not correlate.
        return np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(len(self._records))

    def next_batch(self) -> list[PromptRecord]:
        """The next ``[prompts_per_step]`` records, advancing the state."""
        batch: list[PromptRecord] = []
        while len(batch) < self.prompts_per_step:
            if self.position == len(self._records):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_step - len(batch), len(self._records) - self.position)
            batch.extend(self._records[int(i)] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/torch.save friendly): seed, epoch, position, and two sanity fields."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_records": len(self._records),
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the dataset must have the same size and shuffle setting.

        Raises:
            ValueError: a missing key, or a state from a different dataset size / shuffle setting
                (resuming on a changed dataset would silently visit different prompts).
        """
        missing = [key for key in ("seed", "epoch", "position", "num_records") if key not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}; got keys {sorted(state)}")
        if state["num_records"] != len(self._records):
            raise ValueError(
                f"sampler state was saved for {state['num_records']} records but the dataset has "
                f"{len(self._records)}; resume with the same dataset"
            )
        if state.get("shuffle", self.shuffle) != self.shuffle:
            raise ValueError(
                f"sampler state has shuffle={state['shuffle']} but this sampler has shuffle={self.shuffle}"
            )
        _check_seed(state["seed"])
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._records):
            raise ValueError(
                f"sampler state out of range: epoch={epoch}, position={position}, records={len(self._records)}"
            )
        self.seed, self.epoch, self.position = state["seed"], epoch, position
        self._order = self._epoch_order(epoch)


def _check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

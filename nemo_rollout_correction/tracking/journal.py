"""On-disk, append-only journal of tracking records (stdlib only).

Every record (a step's metrics, params, tags, an artifact, the final run status) is appended to
`<dir>/journal.jsonl` *before* any delivery is attempted, so a record survives a server outage and a
crash of the training process alike. Delivery happens strictly in `seq` order; after each delivered
prefix the highest delivered `seq` is appended to `<dir>/acked.jsonl`. Pending = journal records with
`seq` above the last ack. Redelivery after a crash between "delivered" and "acked" is harmless:
metrics carry their original timestamp and MLflow ignores an identical (key, step, timestamp, value)
row; params are re-sent with the same value; artifacts are overwritten with the same bytes.

Layout under `<dir>` (by default `<run_dir>/tracking/`):
  journal.jsonl   one JSON object per line: {"v": 1, "seq": int, "kind": str, "run_id": str, ...}
  acked.jsonl     {"acked": seq} lines, the last one wins
  rejected.jsonl  records the server refused (HTTP 4xx: e.g. a changed param), with the reason
  spool/<seq>/    private copies of artifacts waiting for upload (deleted after delivery)

Record kinds: "metrics" (step, timestamp [ms], metrics {name: float}), "params" (params {k: str}),
"tags" (tags {k: str}), "artifact" (local_path, artifact_path), "status" (status, end_time [ms]).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
JOURNAL_FILE = "journal.jsonl"
ACK_FILE = "acked.jsonl"
REJECTED_FILE = "rejected.jsonl"
SPOOL_DIR = "spool"

Record = dict[str, Any]

logger = logging.getLogger(__name__)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Parse a JSONL file; a torn last line (crash mid-write) is skipped with a warning."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8") as f:
        lines = f.readlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            where = "last line (torn write)" if i == len(lines) - 1 else f"line {i + 1}"
            logger.warning("skipping unreadable %s of %s", where, path)
    return rows


class Journal:
    """Append-only write-ahead log of tracking records in one directory.

    Thread-safe: one lock guards appends, acks and compaction (they are all short file writes).
    Callers that need to combine a journal write with their own state change can hold `journal.lock`
    (a re-entrant lock) around both.
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.journal_path = self.directory / JOURNAL_FILE
        self.ack_path = self.directory / ACK_FILE
        self.rejected_path = self.directory / REJECTED_FILE
        self.spool_path = self.directory / SPOOL_DIR
        records = _read_jsonl(self.journal_path)
        self._acked = self._read_acked()
        last_seq = max((int(r["seq"]) for r in records if "seq" in r), default=0)
        self._next_seq = max(last_seq, self._acked) + 1
        self._journal_file = self.journal_path.open("a", encoding="utf-8")
        self._ack_file = self.ack_path.open("a", encoding="utf-8")
        self.closed = False

    def _read_acked(self) -> int:
        rows = _read_jsonl(self.ack_path)
        return max((int(r["acked"]) for r in rows if "acked" in r), default=0)

    @property
    def acked(self) -> int:
        """Highest delivered sequence number (0 when nothing was delivered)."""
        return self._acked

    def append(self, record: Record) -> Record:
        """Stamp `record` with the next `seq` and format version, write it durably (flushed to the OS), return it."""
        with self.lock:
            if self.closed:
                raise RuntimeError(f"journal {self.journal_path} is closed; record not written: {record.get('kind')}")
            stamped = {"v": FORMAT_VERSION, "seq": self._next_seq, **record}
            # allow_nan: a NaN/inf metric is a legitimate observation (MLflow stores it); Python reads it back.
            self._journal_file.write(json.dumps(stamped, allow_nan=True) + "\n")
            self._journal_file.flush()
            self._next_seq += 1
            return stamped

    def pending(self) -> list[Record]:
        """Records not yet delivered, in `seq` order (read from disk: also those of an earlier process)."""
        with self.lock:
            acked = self._read_acked()
            records = [r for r in _read_jsonl(self.journal_path) if int(r.get("seq", 0)) > acked]
            return sorted(records, key=lambda r: int(r["seq"]))

    def ack(self, seq: int) -> None:
        """Record that every record up to and including `seq` was delivered.

        After close() this is a no-op: a delivery that finished after its tracker gave up is simply
        re-sent by the next replay, which MLflow deduplicates.
        """
        with self.lock:
            if self.closed or seq <= self._acked:
                return
            self._ack_file.write(json.dumps({"acked": seq}) + "\n")
            self._ack_file.flush()
            self._acked = seq

    def reject(self, record: Record, reason: str) -> None:
        """Move a record the server refused for good into rejected.jsonl (kept for inspection) and ack it."""
        with self.lock:
            if self.closed:
                return
            with self.rejected_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({**record, "rejected_reason": reason}, allow_nan=True) + "\n")
            self.release_spool(record)
            self.ack(int(record["seq"]))

    def spool_dir_for(self, seq: int) -> Path:
        """Directory holding the private artifact copy of record `seq`."""
        return self.spool_path / str(seq)

    def next_seq(self) -> int:
        """The sequence number the next appended record will get."""
        with self.lock:
            return self._next_seq

    def release_spool(self, record: Record) -> None:
        """Delete the spool copy of a delivered (or rejected) artifact record.

        Not after close(): the record then stays pending (its late ack was ignored) and a replay needs the copy.
        """
        if record.get("kind") == "artifact" and not self.closed:
            shutil.rmtree(self.spool_dir_for(int(record["seq"])), ignore_errors=True)

    def compact(self) -> bool:
        """If everything is delivered, empty the journal and reset the ack file; True if it did.

        Sequence numbers keep growing across compactions (the ack file keeps the last one).
        A crash half-way leaves either a journal with everything acked or an empty journal: both safe.
        """
        with self.lock:
            if self.closed or self._next_seq - 1 > self._acked:
                return False
            self._journal_file.close()
            self._journal_file = self.journal_path.open("w", encoding="utf-8")
            self._ack_file.close()
            tmp = self.ack_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"acked": self._acked}) + "\n", encoding="utf-8")
            os.replace(tmp, self.ack_path)
            self._ack_file = self.ack_path.open("a", encoding="utf-8")
            shutil.rmtree(self.spool_path, ignore_errors=True)
            return True

    def size_bytes(self) -> int:
        """Current journal file size (compaction trigger)."""
        return self.journal_path.stat().st_size if self.journal_path.exists() else 0

    def sync(self) -> None:
        """fsync the journal and ack files (called at close: survive a machine crash, not only a process crash)."""
        with self.lock:
            if self.closed:
                return
            for f in (self._journal_file, self._ack_file):
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        """Close the file handles (the files stay on disk); later acks are ignored, appends raise."""
        with self.lock:
            self.closed = True
            self._journal_file.close()
            self._ack_file.close()

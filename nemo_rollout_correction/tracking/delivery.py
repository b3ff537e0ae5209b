"""Durable delivery of tracking records: the on-disk journal, delivery to an MLflow store, the background
sender, and the later replay of a run's leftover journal (stdlib + mlflow, loaded lazily).

Sections, in dependency order: errors; journal; delivery (outage vs refusal, bounded HTTP); sender
(background thread); replay (`python -m nemo_rollout_correction.tracking.replay` is its CLI).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rollout_correction.tracking.store_lock import store_lock

# ====================================================================================================
# Errors raised by the tracking layer.
# ====================================================================================================

class TrackingUnavailableError(RuntimeError):
    """The MLflow tracking store could not be reached when it had to be (at start, or during a replay).

    Raised only where waiting is the wrong answer: `MlflowTracker.start()` (a run must not train for hours
    believing it is tracked when the URI is wrong) and `replay_buffer()`. During training an outage is
    never an error: records are buffered on disk and delivered later.
    """


# ====================================================================================================
# On-disk, append-only journal of tracking records (stdlib only).
#
# Every record (a step's metrics, params, tags, an artifact, the final run status) is appended to
# `<dir>/journal.jsonl` *before* any delivery is attempted, so a record survives a server outage and a
# crash of the training process alike. Delivery happens strictly in `seq` order; after each delivered
# prefix the highest delivered `seq` is appended to `<dir>/acked.jsonl`. Pending = journal records with
# `seq` above the last ack. Redelivery after a crash between "delivered" and "acked" is harmless:
# metrics carry their original timestamp and MLflow ignores an identical (key, step, timestamp, value)
# row; params are re-sent with the same value; artifacts are overwritten with the same bytes.
#
# Layout under `<dir>` (by default `<run_dir>/tracking/`):
#   journal.jsonl   one JSON object per line: {"v": 1, "seq": int, "kind": str, "run_id": str, ...}
#   acked.jsonl     {"acked": seq} lines, the last one wins
#   rejected.jsonl  records the server refused (HTTP 4xx: e.g. a changed param), with the reason
#   spool/<seq>/    private copies of artifacts waiting for upload (deleted after delivery)
#
# Record kinds: "metrics" (step, timestamp [ms], metrics {name: float}), "params" (params {k: str}),
# "tags" (tags {k: str}), "artifact" (local_path, artifact_path), "status" (status, end_time [ms]).
# ====================================================================================================

FORMAT_VERSION = 1
JOURNAL_FILE = "journal.jsonl"
ACK_FILE = "acked.jsonl"
REJECTED_FILE = "rejected.jsonl"
SPOOL_DIR = "spool"

Record = dict[str, Any]

logger = logging.getLogger("nemo_rollout_correction.tracking")

# MLflow 3.17.2 limits of one `log_batch` call (mlflow/utils/validation.py); delivery splits larger records.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100


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


# ====================================================================================================
# Deliver journal records to an MLflow tracking store, and tell outages from refusals.
#
# Bounded HTTP: MLflow 3.17.2 reads its HTTP knobs from the environment on every request
# (`mlflow.utils.rest_utils.http_request`): `MLFLOW_HTTP_REQUEST_MAX_RETRIES` (default 7, with
# exponential backoff `MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`=2: a dead server costs minutes per call) and
# `MLFLOW_HTTP_REQUEST_TIMEOUT` (default 120 s, an integer, per connect/read). `bound_http_requests()`
# sets 0 retries (this layer retries on its own schedule) and a short timeout, so a refused connection
# fails in milliseconds and a hung server in `timeout_s`. Values the user already exported are kept.
# ====================================================================================================


HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
}


def is_http_uri(uri: str) -> bool:
    """True for a tracking server URI (http/https), where outages are possible."""
    return uri.startswith(("http://", "https://"))


_SET_BY_US: dict[str, str] = {}


def bound_http_requests(timeout_s: int = 5) -> dict[str, str]:
    """Make every MLflow HTTP request in this process fail fast; return the values now in effect.

    Process-wide on purpose: MLflow offers no per-client setting, and every request of the run (ours,
    artifact uploads) should be bounded. A value the user exported wins; a value an earlier call set
    is replaced (the latest tracker's `request_timeout_s` applies).
    """
    wanted = {**HTTP_ENV_DEFAULTS, "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(timeout_s)))}
    effective: dict[str, str] = {}
    for key, value in wanted.items():
        current = os.environ.get(key)
        if current is None or current == _SET_BY_US.get(key):
            os.environ[key] = value
            _SET_BY_US[key] = value
        elif current != value:
            logger.info("keeping user setting %s=%s (tracking would use %s)", key, current, value)
        effective[key] = os.environ[key]
    return effective


class DeliveryError(Exception):
    """A delivery attempt failed. `transient` tells an outage (retry later) from a refusal (never retry)."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


def classify(exc: BaseException) -> DeliveryError:
    """Map an exception from the MLflow client to a DeliveryError.

    The server answered with a 4xx (other than 429 Too Many Requests) -> the record itself is bad
    (changed param value, unknown run, invalid name): a refusal. Everything else -> transient: connection
    refused or reset, timeouts, 5xx/503 while the server starts, a locked sqlite file.
    """
    status: int | None = None
    getter = getattr(exc, "get_http_status_code", None)
    if callable(getter):
        try:
            status = int(getter())
        except (TypeError, ValueError):
            status = None
    # A connection failure surfaces as MlflowException("API request to ... failed") with INTERNAL_ERROR (500);
    # a local sqlite store raises MlflowException INVALID_PARAMETER_VALUE (400) for bad records, like a server.
    refused = status is not None and 400 <= status < 500 and status != 429
    return DeliveryError(f"{type(exc).__name__}: {exc}", transient=not refused)


class Deliverer:
    """Sends journal records with one `MlflowClient`; each call delivers a prefix of the pending records.

    Consecutive metric records of one run merge into `log_batch` calls of at most 1000 metrics (the
    server's limit); order is kept because batches follow `seq` order.
    """

    def __init__(self, tracking_uri: str) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        with store_lock(tracking_uri):  # a replay may be the first to open a new sqlite store (store_lock.py)
            self.client = MlflowClient(tracking_uri=tracking_uri)

    def deliver_prefix(self, records: Sequence[Record], max_records: int = 10_000) -> int:
        """Deliver `records[:n]` for some 1 <= n <= max_records and return n.

        Raises DeliveryError; nothing is acknowledged then (a partially delivered metric batch is
        re-sent later and deduplicated by MLflow, since metrics keep their original timestamps).
        """
        if not records:
            return 0
        try:
            first = records[0]
            if first["kind"] == "metrics":
                n = 1
                total = len(first["metrics"])
                while (
                    n < min(len(records), max_records)
                    and records[n]["kind"] == "metrics"
                    and records[n]["run_id"] == first["run_id"]
                    and total + len(records[n]["metrics"]) <= MAX_METRICS_PER_BATCH
                ):
                    total += len(records[n]["metrics"])
                    n += 1
                self._send_metrics(first["run_id"], records[:n])
                return n
            self._send_one(first)
            return 1
        except DeliveryError:
            raise
        except Exception as exc:  # every client failure is classified, none escapes
            raise classify(exc) from exc

    def _send_metrics(self, run_id: str, records: Sequence[Record]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key=k, value=float(v), timestamp=int(r["timestamp"]), step=int(r["step"]))
            for r in records
            for k, v in r["metrics"].items()
        ]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH], synchronous=True)

    def _send_one(self, record: Record) -> None:
        from mlflow.entities import Param, RunTag

        kind, run_id = record["kind"], record["run_id"]
        if kind == "params":
            items = [Param(k, str(v)) for k, v in record["params"].items()]
            for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=items[start : start + MAX_PARAMS_PER_BATCH], synchronous=True)
        elif kind == "tags":
            tags = [RunTag(k, str(v)) for k, v in record["tags"].items()]
            for start in range(0, len(tags), MAX_TAGS_PER_BATCH):
                self.client.log_batch(run_id, tags=tags[start : start + MAX_TAGS_PER_BATCH], synchronous=True)
        elif kind == "artifact":
            self._send_artifact(record)
        elif kind == "status":
            self.client.set_terminated(run_id, status=record["status"], end_time=int(record["end_time"]))
        else:
            raise DeliveryError(f"unknown record kind {kind!r} (seq {record.get('seq')})", transient=False)

    def _send_artifact(self, record: Record) -> None:
        local = Path(record["local_path"])
        if not local.exists():
            raise DeliveryError(f"artifact source {local} no longer exists", transient=False)
        artifact_path: Any = record.get("artifact_path") or None
        if local.is_dir():
            self.client.log_artifacts(record["run_id"], str(local), artifact_path)
        else:
            self.client.log_artifact(record["run_id"], str(local), artifact_path)


# ====================================================================================================
# Background delivery of journal records: the training thread never waits on the network.
#
# `submit()` appends a record to the on-disk journal and hands it to one daemon thread that delivers
# records in order. If the store fails transiently the thread keeps everything (memory and journal),
# warns once, and retries with capped exponential backoff (immediately while someone waits in
# `flush()`); the first successful delivery after an outage drains the backlog in order and warns once
# more. A record the server refuses (HTTP 4xx) is moved to rejected.jsonl so it cannot block the queue.
# ====================================================================================================


COMPACT_THRESHOLD_BYTES = 4 << 20
SNAPSHOT_RECORDS = 1000


class BufferedSender:
    """Ordered, outage-tolerant delivery of journal records by one daemon thread.

    Args:
        journal: the on-disk journal (records are appended there before delivery).
        make_deliverer: builds the Deliverer lazily in the thread (so a slow import never blocks training).
        describe: the tracking URI, for log messages.
        retry_initial_s / retry_max_s: backoff between attempts during an outage.
    """

    def __init__(
        self,
        journal: Journal,
        make_deliverer: Callable[[], Deliverer],
        describe: str,
        *,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
    ) -> None:
        self.journal = journal
        self._make_deliverer = make_deliverer
        self._describe = describe
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._cond = threading.Condition(journal.lock)
        self._queue: collections.deque[Record] = collections.deque(journal.pending())
        self._stop = False
        self._flush_waiters = 0
        self._outage_since: float | None = None
        self._delivered_in_outage = 0
        self.last_error: str | None = None
        self.delivered = 0
        self.rejected = 0
        if self._queue:
            logger.warning(
                "%d undelivered tracking records from an earlier process found in %s; delivering them first",
                len(self._queue),
                journal.journal_path,
            )
        self._thread = threading.Thread(target=self._run, name="nrc-mlflow-sender", daemon=True)
        self._thread.start()

    # ---- producer side (training thread) -------------------------------------------------------------
    def submit(self, record: Record) -> Record:
        """Journal `record` (durable before this returns) and queue it for delivery; never touches the network."""
        with self._cond:
            stamped = self.journal.append(record)
            self._queue.append(stamped)
            self._cond.notify_all()
        return stamped

    @property
    def pending(self) -> int:
        """Records journaled but not yet delivered."""
        with self._cond:
            return len(self._queue)

    @property
    def in_outage(self) -> bool:
        """True while the last delivery attempt failed transiently."""
        return self._outage_since is not None

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every queued record to be delivered; True if the queue is empty."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._flush_waiters += 1
            self._cond.notify_all()  # cut a running backoff short
            try:
                while self._queue and self._thread.is_alive():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(timeout=min(remaining, 0.25))
                return not self._queue
            finally:
                self._flush_waiters -= 1

    def close(self, timeout_s: float) -> bool:
        """Flush (bounded), stop the thread, fsync the journal; True if everything was delivered."""
        delivered = self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # The thread may sit in one bounded HTTP call; do not wait for it beyond a moment.
        self._thread.join(timeout=2.0)
        with self._cond:
            delivered = not self._queue
            if delivered:
                self.journal.compact()
            self.journal.sync()
            self.journal.close()
        return delivered

    # ---- consumer side (sender thread) ---------------------------------------------------------------
    def _run(self) -> None:
        deliverer: Deliverer | None = None
        backoff = self._retry_initial_s
        max_records = 10_000
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                # One attempt sends at most 1000 metrics, so a bounded snapshot suffices even after a long outage.
                batch = list(itertools.islice(self._queue, 0, SNAPSHOT_RECORDS))
            try:
                if deliverer is None:
                    deliverer = self._make_deliverer()
                n = deliverer.deliver_prefix(batch, max_records=max_records)
            except DeliveryError as err:
                if not err.transient:
                    if max_records > 1 and len(batch) > 1:
                        max_records = 1  # isolate the refused record before rejecting anything
                        continue
                    self._reject(batch[0], str(err))
                    max_records = 10_000
                    continue
                self._on_outage(str(err), self.pending)
                self._sleep_backoff(backoff)
                backoff = min(backoff * 2, self._retry_max_s)
                continue
            except Exception as err:  # e.g. mlflow import failure: keep buffering, never crash
                self._on_outage(f"{type(err).__name__}: {err}", self.pending)
                self._sleep_backoff(backoff)
                backoff = min(backoff * 2, self._retry_max_s)
                continue
            max_records = 10_000
            backoff = self._retry_initial_s
            self._on_delivered(batch[:n])

    def _sleep_backoff(self, backoff: float) -> None:
        with self._cond:
            if self._stop:
                return
            # While close()/flush() waits, retry often; otherwise back off (the thread, not training, sleeps).
            self._cond.wait(timeout=min(backoff, 0.5) if self._flush_waiters else backoff)

    def _on_delivered(self, done: list[Record]) -> None:
        with self._cond:
            for _ in done:
                self._queue.popleft()
            self.journal.ack(int(done[-1]["seq"]))
            for record in done:
                self.journal.release_spool(record)
            self.delivered += len(done)
            if self._outage_since is not None:
                self._delivered_in_outage += len(done)
                if not self._queue:
                    logger.warning(
                        "MLflow tracking at %s is reachable again after %.1f s; delivered %d buffered records in order",
                        self._describe,
                        time.monotonic() - self._outage_since,
                        self._delivered_in_outage,
                    )
                    self._outage_since = None
                    self._delivered_in_outage = 0
                    self.last_error = None
            if not self._queue and self.journal.size_bytes() > COMPACT_THRESHOLD_BYTES:
                self.journal.compact()
            self._cond.notify_all()

    def _on_outage(self, error: str, queued: int) -> None:
        with self._cond:
            self.last_error = error
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                logger.warning(
                    "MLflow tracking at %s is unreachable (%s); training continues, %d records are buffered in %s "
                    "and will be delivered in order when it answers again",
                    self._describe,
                    error.splitlines()[0][:300],
                    queued,
                    self.journal.journal_path,
                )

    def _reject(self, record: Record, reason: str) -> None:
        with self._cond:
            logger.error(
                "MLflow refused tracking record seq=%s kind=%s (%s); kept in %s",
                record.get("seq"),
                record.get("kind"),
                reason.splitlines()[0][:500],
                self.journal.rejected_path,
            )
            self._queue.popleft()
            self.journal.reject(record, reason)
            self.rejected += 1
            self._cond.notify_all()


# ====================================================================================================
# Deliver a run's leftover tracking journal later, without the trainer or the `nrc` CLI.
#
# When a run ends while the tracking server is down, `MlflowTracker.close()` leaves
# `<run_dir>/tracking/journal.jsonl`. Once a server is reachable again:
#
#     python -m nemo_rollout_correction.tracking.replay <run_dir> --tracking-uri http://host:5000
#
# or `replay_buffer(run_dir, tracking_uri)` from Python. Records go out in their original order with
# their original timestamps (so a replay after a partial delivery duplicates nothing); the run ends with
# the status the trainer gave it. Needs only `mlflow` and this module's siblings (stdlib otherwise).
# ====================================================================================================


BUFFER_SUBDIR = "tracking"


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of a replay: records delivered, records refused by the server (see rejected.jsonl)."""

    delivered: int
    rejected: int


def buffer_dir(run_dir: Path | str) -> Path:
    """Where a run keeps its tracking journal: `<run_dir>/tracking/`."""
    return Path(run_dir) / BUFFER_SUBDIR


def pending_records(run_dir: Path | str) -> int:
    """Number of undelivered records in a run's journal (0 if there is none)."""
    directory = buffer_dir(run_dir)
    if not (directory / "journal.jsonl").exists():
        return 0
    journal = Journal(directory)
    try:
        return len(journal.pending())
    finally:
        journal.close()


def replay_buffer(
    run_dir: Path | str, tracking_uri: str, *, timeout_s: float = 60.0, request_timeout_s: int = 5
) -> ReplayResult:
    """Deliver every undelivered record of `<run_dir>/tracking/journal.jsonl` to `tracking_uri`, in order.

    Retries transient failures until `timeout_s` has passed, then raises TrackingUnavailableError (what
    was delivered so far stays acknowledged; run it again later). Records the server refuses (HTTP 4xx)
    go to rejected.jsonl. Empties the journal when everything is delivered.
    """
    directory = buffer_dir(run_dir)
    if not (directory / "journal.jsonl").exists():
        raise FileNotFoundError(f"no tracking journal at {directory / 'journal.jsonl'} (run_dir={run_dir})")
    if is_http_uri(tracking_uri):
        bound_http_requests(request_timeout_s)
    journal = Journal(directory)
    delivered = rejected = 0
    try:
        queue = journal.pending()
        deliverer = Deliverer(tracking_uri)
        deadline = time.monotonic() + timeout_s
        backoff = 0.5
        max_records = 10_000
        while queue:
            try:
                n = deliverer.deliver_prefix(queue, max_records=max_records)
            except DeliveryError as err:
                if err.transient:
                    if time.monotonic() + backoff > deadline:
                        raise TrackingUnavailableError(
                            f"MLflow tracking at {tracking_uri} is still unreachable ({err}); {len(queue)} records "
                            f"remain in {journal.journal_path}. Start the server or fix the URI, then replay again."
                        ) from err
                    time.sleep(backoff)
                    backoff = min(2 * backoff, 5.0)
                    continue
                if max_records > 1 and len(queue) > 1:
                    max_records = 1
                    continue
                logger.error(
                    "MLflow refused record seq=%s (%s); kept in %s", queue[0]["seq"], err, journal.rejected_path
                )
                journal.reject(queue.pop(0), str(err))
                rejected += 1
                max_records = 10_000
                continue
            done, queue = queue[:n], queue[n:]
            journal.ack(int(done[-1]["seq"]))
            for record in done:
                journal.release_spool(record)
            delivered += n
            max_records = 10_000
        journal.compact()
    finally:
        journal.close()
    logger.info("replayed %d tracking records to %s (%d refused)", delivered, tracking_uri, rejected)
    return ReplayResult(delivered=delivered, rejected=rejected)

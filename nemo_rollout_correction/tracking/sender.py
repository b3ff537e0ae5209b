"""Background delivery of journal records: the training thread never waits on the network.

`submit()` appends a record to the on-disk journal and hands it to one daemon thread that delivers
records in order. If the store fails transiently the thread keeps everything (memory and journal),
warns once, and retries with capped exponential backoff (immediately while someone waits in
`flush()`); the first successful delivery after an outage drains the backlog in order and warns once
more. A record the server refuses (HTTP 4xx) is moved to rejected.jsonl so it cannot block the queue.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable

from .delivery import Deliverer, DeliveryError
from .journal import Journal, Record

logger = logging.getLogger("nemo_rollout_correction.tracking")

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

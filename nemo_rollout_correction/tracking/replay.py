"""Deliver a run's leftover tracking journal later, without the trainer or the `nrc` CLI.

When a run ends while the tracking server is down, `MlflowTracker.close()` leaves
`<run_dir>/tracking/journal.jsonl`. Once a server is reachable again:

    python -m nemo_rollout_correction.tracking.replay <run_dir> --tracking-uri http://host:5000

or `replay_buffer(run_dir, tracking_uri)` from Python. Records go out in their original order with
their original timestamps (so a replay after a partial delivery duplicates nothing); the run ends with
the status the trainer gave it. Needs only `mlflow` and this module's siblings (stdlib otherwise).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .delivery import Deliverer, DeliveryError, bound_http_requests, is_http_uri
from .errors import TrackingUnavailableError
from .journal import Journal

logger = logging.getLogger("nemo_rollout_correction.tracking")

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


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m nemo_rollout_correction.tracking.replay RUN_DIR --tracking-uri URI`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's output directory (holds tracking/journal.jsonl)")
    parser.add_argument("--tracking-uri", required=True, help="MLflow tracking URI to deliver to")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to keep retrying an unreachable server")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        result = replay_buffer(args.run_dir, args.tracking_uri, timeout_s=args.timeout)
    except (TrackingUnavailableError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"delivered {result.delivered} records, {result.rejected} refused")
    return 0 if result.rejected == 0 else 2


if __name__ == "__main__":
    sys.exit(main())

"""Deliver journal records to an MLflow tracking store, and tell outages from refusals.

Bounded HTTP: MLflow 3.17.2 reads its HTTP knobs from the environment on every request
(`mlflow.utils.rest_utils.http_request`): `MLFLOW_HTTP_REQUEST_MAX_RETRIES` (default 7, with
exponential backoff `MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`=2: a dead server costs minutes per call) and
`MLFLOW_HTTP_REQUEST_TIMEOUT` (default 120 s, an integer, per connect/read). `bound_http_requests()`
sets 0 retries (this layer retries on its own schedule) and a short timeout, so a refused connection
fails in milliseconds and a hung server in `timeout_s`. Values the user already exported are kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .journal import Record
from .params import MAX_METRICS_PER_BATCH, MAX_PARAMS_PER_BATCH, MAX_TAGS_PER_BATCH

logger = logging.getLogger(__name__)

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

"""Delivery policy (tracking/delivery.py: delivery and sender): fail-fast HTTP settings, outage vs refusal, and a sender
that keeps everything while the store is unreachable (a real MlflowClient against a closed local port)."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
from default_lane import require

mlflow_exceptions = require("mlflow.exceptions", "mlflow")

from nemo_rollout_correction.tracking.delivery import (
    BufferedSender,
    Deliverer,
    DeliveryError,
    Journal,
    bound_http_requests,
    classify,
)


def _closed_port_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens once the socket is closed


def test_bound_http_requests_sets_fail_fast_defaults_but_keeps_user_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    effective = bound_http_requests(timeout_s=3)
    assert effective["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert effective["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"  # the user's choice wins

    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 0 and MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 30

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT")
    assert bound_http_requests(timeout_s=3)["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "3"
    assert bound_http_requests(timeout_s=1)["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "1"  # ours: a later tracker's wins


def test_classify_tells_refusals_from_outages() -> None:
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    MlflowException = mlflow_exceptions.MlflowException
    RestException = mlflow_exceptions.RestException
    assert not classify(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "x"})).transient
    assert not classify(MlflowException("bad name", INVALID_PARAMETER_VALUE)).transient
    assert not classify(MlflowException("no run", RESOURCE_DOES_NOT_EXIST)).transient
    assert classify(MlflowException("API request to http://h failed with exception Connection refused")).transient
    assert classify(MlflowException("starting", TEMPORARILY_UNAVAILABLE)).transient
    assert classify(OSError("database is locked")).transient


def test_dead_server_costs_milliseconds_per_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    deliverer = Deliverer(_closed_port_uri())
    record = {"seq": 1, "kind": "metrics", "run_id": "r", "step": 0, "timestamp": 1, "metrics": {"a": 1.0}}
    t0 = time.monotonic()
    with pytest.raises(DeliveryError) as info:
        deliverer.deliver_prefix([record])
    assert info.value.transient
    assert time.monotonic() - t0 < 10.0  # one refused connection, no retry loop


def test_sender_keeps_everything_during_an_outage_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    caplog.set_level(logging.WARNING, logger="nemo_rollout_correction.tracking")
    uri = _closed_port_uri()
    sender = BufferedSender(Journal(tmp_path), lambda: Deliverer(uri), uri, retry_initial_s=0.05, retry_max_s=0.1)
    worst = 0.0
    for step in range(50):
        t0 = time.perf_counter()
        sender.submit({"kind": "metrics", "run_id": "r", "step": step, "timestamp": step, "metrics": {"a": 1.0}})
        worst = max(worst, time.perf_counter() - t0)
    t0 = time.monotonic()
    assert sender.flush(timeout_s=0.5) is False
    assert time.monotonic() - t0 < 10.0  # flush gives up at its 0.5 s bound
    assert sender.in_outage and sender.pending == 50
    assert worst < 1.0  # submit appends to the journal; delivery happens in the sender's thread
    assert sender.close(timeout_s=0.3) is False
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and uri in warnings[0]
    # Every record is still on disk for a later replay, in order.
    assert [r["step"] for r in Journal(tmp_path).pending()] == list(range(50))

"""MlflowTracker and replay_buffer on the default local store (`sqlite:///<run_dir>/mlflow.db`, real MLflow).

One sqlite store per module (creating its tables takes seconds). Covers the default URI and artifact
location, leftovers of a crashed process delivered first on resume, refused records set aside without
blocking the rest, idempotent redelivery, and replay's errors.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from default_lane import require

require("mlflow", "mlflow")

from mlflow import MlflowClient

from nemo_rollout_correction.tracking import (
    MlflowTracker,
    TrackingUnavailableError,
    default_tracking_uri,
    pending_records,
    replay_buffer,
)
from nemo_rollout_correction.tracking.delivery import BufferedSender, Deliverer, Journal
from nemo_rollout_correction.tracking.replay import main as replay_main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(run_dir, tracking uri, run id) of a finished run in the default store of `run_dir`."""
    run_dir = tmp_path_factory.mktemp("sqlite_run")
    with MlflowTracker(None, "nrc-sqlite", "base", run_dir) as tracker:
        tracker.log_config({"policy": {"lr": 0.001}})
        for step in range(3):
            tracker.log_metrics({"loss/total": float(step)}, step=step)
    return run_dir, tracker.tracking_uri, str(tracker.run_id)


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def _new_run(uri: str, name: str) -> str:
    client = MlflowClient(uri)
    return client.create_run(client.get_experiment_by_name("nrc-sqlite").experiment_id, run_name=name).info.run_id


def test_default_uri_is_sqlite_in_run_dir_with_artifacts_next_to_it(store: tuple[Path, str, str]) -> None:
    run_dir, uri, run_id = store
    assert uri == default_tracking_uri(run_dir) == f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((run_dir.resolve() / "mlruns").as_uri())
    assert (run_dir / "mlruns" / run_id / "artifacts" / "config" / "resolved.yaml").exists()
    assert _steps(uri, run_id, "loss/total") == [0, 1, 2]
    assert pending_records(run_dir) == 0 and (run_dir / "tracking" / "journal.jsonl").stat().st_size == 0


def test_leftovers_of_a_crashed_process_are_delivered_first_on_resume(store: tuple[Path, str, str]) -> None:
    run_dir, uri, run_id = store
    # What a process killed during an outage leaves behind: journaled, never acknowledged.
    journal = Journal(run_dir / "tracking")
    for step in (3, 4):
        journal.append({"kind": "metrics", "run_id": run_id, "step": step, "timestamp": 1_000 + step,
                        "metrics": {"loss/total": float(step)}})  # fmt: skip
    journal.close()
    assert pending_records(run_dir) == 2
    with MlflowTracker(None, "nrc-sqlite", None, run_dir, resume_run_id=run_id) as tracker:
        tracker.log_metrics({"loss/total": 5.0}, step=5)
    assert _steps(uri, run_id, "loss/total") == [0, 1, 2, 3, 4, 5]
    assert pending_records(run_dir) == 0


def test_refused_records_are_set_aside_and_the_rest_is_delivered_in_order(tmp_path: Path, store) -> None:
    _, uri, _ = store
    run_id = _new_run(uri, "refusals")
    MlflowClient(uri).log_param(run_id, "policy.lr", "0.001")
    run_dir = tmp_path / "run"
    journal = Journal(run_dir / "tracking")
    metric = {"kind": "metrics", "run_id": run_id}
    journal.append({**metric, "step": 0, "timestamp": 10, "metrics": {"loss/total": 0.0}})
    journal.append({**metric, "step": 1, "timestamp": 11, "metrics": {"bad//name": 1.0}})  # invalid name
    journal.append({**metric, "step": 2, "timestamp": 12, "metrics": {"loss/total": 2.0}})
    journal.append({"kind": "params", "run_id": run_id, "params": {"policy.lr": "0.5"}})  # params are immutable
    journal.append({**metric, "step": 3, "timestamp": 13, "metrics": {"loss/total": 3.0}})
    journal.close()

    result = replay_buffer(run_dir, uri)
    assert (result.delivered, result.rejected) == (3, 2)
    assert _steps(uri, run_id, "loss/total") == [0, 2, 3]
    rejected = [json.loads(line) for line in (run_dir / "tracking" / "rejected.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in rejected] == [2, 4]
    assert "bad//name" in rejected[0]["rejected_reason"] and "param" in rejected[1]["rejected_reason"].lower()


def test_redelivery_after_a_lost_ack_duplicates_nothing(tmp_path: Path, store) -> None:
    _, uri, _ = store
    run_id = _new_run(uri, "redelivery")
    run_dir = tmp_path / "run"
    journal = Journal(run_dir / "tracking")
    for step in range(4):
        journal.append({"kind": "metrics", "run_id": run_id, "step": step, "timestamp": 100 + step,
                        "metrics": {"loss/total": float(step), "reward/mean": 0.5}})  # fmt: skip
    journal.close()
    journal_copy = tmp_path / "journal.copy"
    shutil.copy(run_dir / "tracking" / "journal.jsonl", journal_copy)
    assert replay_buffer(run_dir, uri).delivered == 4
    # Crash between "server stored it" and "ack written": the same records go out again.
    shutil.copy(journal_copy, run_dir / "tracking" / "journal.jsonl")
    (run_dir / "tracking" / "acked.jsonl").write_text("")
    assert replay_buffer(run_dir, uri).delivered == 4
    history = MlflowClient(uri).get_metric_history(run_id, "loss/total")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]


def test_a_write_that_finds_the_store_locked_is_retried_until_it_goes_through(tmp_path: Path, store) -> None:
    """Another process writing (here: an open exclusive transaction) makes MLflow's write fail with sqlite's
    "database is locked" once its busy timeout ends; the sender keeps the records and delivers them after."""
    run_dir, uri, _ = store
    run_id = _new_run(uri, "locked")
    db = run_dir.resolve() / "mlflow.db"
    short_wait = f"sqlite:///{db}?timeout=0.2"  # sqlite's busy timeout (default 5 s) cut to keep the test short
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    sender = BufferedSender(Journal(tmp_path / "tracking"), lambda: Deliverer(short_wait), short_wait,
                            retry_initial_s=0.1, retry_max_s=0.2)
    try:
        for step in (1, 2):
            sender.submit({"kind": "metrics", "run_id": run_id, "step": step, "timestamp": 50 + step,
                           "metrics": {"loss/total": float(step)}})  # fmt: skip
        sender.submit({"kind": "status", "run_id": run_id, "status": "FINISHED", "end_time": 60})
        deadline = time.monotonic() + 60
        while "database is locked" not in (sender.last_error or "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "database is locked" in (sender.last_error or ""), sender.last_error
        assert sender.pending == 3 and sender.rejected == 0  # an outage, not a refusal
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert sender.close(60.0)
    assert sender.rejected == 0
    assert _steps(uri, run_id, "loss/total") == [1, 2]
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"


def test_replay_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tracking journal"):
        replay_buffer(tmp_path / "nothing", "sqlite:///x.db")
    journal = Journal(tmp_path / "run" / "tracking")
    journal.append({"kind": "metrics", "run_id": "r", "step": 0, "timestamp": 1, "metrics": {"a": 1.0}})
    journal.close()
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailableError, match=r"still unreachable.*1 records remain"):
        replay_buffer(tmp_path / "run", "http://127.0.0.1:9", timeout_s=1.0)
    assert time.monotonic() - t0 < 20.0  # within its 1 s bound, not MLflow's retries with back-off (minutes)
    assert pending_records(tmp_path / "run") == 1
    assert replay_main([str(tmp_path / "run"), "--tracking-uri", "http://127.0.0.1:9", "--timeout", "0.5"]) == 1


def test_a_failing_review_write_is_logged_and_training_goes_on(
    tmp_path: Path, store, caplog: pytest.LogCaptureFixture
) -> None:
    require("matplotlib", "mlflow")
    from nemo_rollout_correction.tracking.review import SequenceReview, log_review_artifacts

    _, uri, _ = store
    sequences = SequenceReview.create(
        prompts=["p"], responses=["r"], response_lengths=[1], seq_log_ratio_sum=[0.0], max_abs_log_ratio=[0.0],
        kl=[0.0], is_weight=[1.0], kept=[True], reward=[1.0],
    )  # fmt: skip
    with MlflowTracker(uri, "nrc-sqlite", "review", tmp_path / "run") as tracker:
        out = log_review_artifacts(tracker, 1, raw_is_weights=[1.0], applied_is_weights=[1.0], sequences=sequences,
                                   mismatch="bogus")  # fmt: skip
        assert out is None
        tracker.log_metrics({"loss/total": 1.0}, step=1)
    assert any("review artifacts for step 1 failed" in r.getMessage() for r in caplog.records)
    assert _steps(uri, str(tracker.run_id), "loss/total") == [1]

"""MlflowTracker against a REAL `mlflow server` on 127.0.0.1 (sqlite backend, local artifact store).

One server per module (module fixture); the outage tests kill its process group and restart it on the
same port and sqlite file. Everything is read back with a fresh MlflowClient.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
from default_lane import require

mlflow = require("mlflow", "mlflow")
pq = require("pyarrow.parquet", "mlflow")
yaml = require("yaml", "config")

from mlflow import MlflowClient
from mlflow_server import MlflowServer, free_port

from nemo_rollout_correction.tracking import (
    MlflowTracker,
    TrackingUnavailableError,
    pending_records,
    replay_buffer,
)
from nemo_rollout_correction.tracking.review import (
    RewardHistory,
    SequenceReview,
    log_review_artifacts,
)

pytestmark = pytest.mark.integration

LOGGER = "nemo_rollout_correction.tracking"
CONFIG = {
    "run": {"name": "it", "seed": 7, "num_steps": 3},
    "policy": {"lr": 1e-5, "micro_batch_size": 8},
    "tracking": {"tracking_uri": None, "plot_every": 5},
    "launcher": {"container_mounts": ["/data:/data"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    srv.start()
    yield srv
    srv.stop(abrupt=True)


@pytest.fixture
def up(server: MlflowServer) -> MlflowServer:
    """The module's server, restarted if an earlier test left it down."""
    server.start()
    return server


def _tracker(run_dir: Path, uri: str, **kwargs) -> MlflowTracker:
    return MlflowTracker(tracking_uri=uri, experiment="nrc-it", run_name=run_dir.name, run_dir=run_dir, **kwargs)


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return [m.step for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


def _review(n: int = 8) -> SequenceReview:
    rng = np.random.default_rng(0)
    return SequenceReview.create(
        prompts=[f"What is {i} + 2?" for i in range(n)],
        responses=[str(i + 2) for i in range(n)],
        response_lengths=rng.integers(1, 32, n),
        seq_log_ratio_sum=rng.normal(0, 1, n),
        max_abs_log_ratio=np.abs(rng.normal(0, 1, n)),
        kl=np.abs(rng.normal(0, 0.1, n)),
        is_weight=np.exp(rng.normal(0, 0.3, n)),
        kept=rng.random(n) > 0.2,
        reward=rng.random(n),
    )


def test_unreachable_server_at_start_fails_fast_with_a_clear_error(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    tracker = _tracker(tmp_path / "run", uri)
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailableError, match="not reachable") as info:
        tracker.start()
    assert time.monotonic() - t0 < 20.0  # not MLflow's default retries with back-off (minutes)
    message = str(info.value)
    assert uri in message and "mlflow server" in message and "tracking.enabled=false" in message
    assert tracker.run_id is None


def test_params_metrics_tags_config_and_review_artifacts_round_trip(up: MlflowServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _tracker(run_dir, up.uri, tags={"team": "rl"}) as tracker:
        run_id = tracker.run_id
        assert run_id is not None
        tracker.log_config(CONFIG)
        for step in range(4):
            tracker.log_metrics(
                {"reward/mean": 0.1 * step, "loss/total": 1.0 - 0.1 * step, "rollout_corr/kl": 1e-3, "timing/s": 2},
                step=step,
            )
        weights = np.exp(np.random.default_rng(1).normal(0, 0.5, 256))
        log_review_artifacts(
            tracker, 3, raw_is_weights=weights, applied_is_weights=np.minimum(weights, 2.0), sequences=_review(),
            rewards=RewardHistory(steps=[0, 1, 2, 3], mean=[0.0, 0.1, 0.2, 0.3]), top_k=4,
        )  # fmt: skip
    assert tracker.pending_records == 0

    client = MlflowClient(up.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["policy.lr"] == "1e-05"
    assert run.data.params["launcher.container_mounts"] == '["/data:/data"]'
    assert run.data.params["tracking.tracking_uri"] == "null"
    tags = run.data.tags
    assert tags["team"] == "rl" and tags["mlflow.runName"] == "run"
    assert tags["version.mlflow"] == mlflow.__version__
    assert {"version.python", "version.torch", "host.name"} <= set(tags)
    assert _steps(client, run_id, "reward/mean") == [0, 1, 2, 3]
    assert run.data.metrics["loss/total"] == pytest.approx(0.7)

    local = Path(client.download_artifacts(run_id, "config/resolved.yaml", str(tmp_path / "dl")))
    assert yaml.safe_load(local.read_text()) == CONFIG
    listed = {f.path for f in client.list_artifacts(run_id, "review/step_000003")}
    assert listed == {
        f"review/step_000003/{n}"
        for n in ("is_weights.png", "mismatch_vs_length.png", "reward.png", "worst_sequences.parquet")
    }
    table = pq.read_table(
        client.download_artifacts(run_id, "review/step_000003/worst_sequences.parquet", str(tmp_path / "dl"))
    )
    assert table.num_rows == 4 and table.column("step").to_pylist() == [3] * 4
    png = client.download_artifacts(run_id, "review/step_000003/is_weights.png", str(tmp_path / "dl"))
    assert Path(png).read_bytes()[:4] == b"\x89PNG"


def test_resume_continues_the_same_run_and_steps(up: MlflowServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _tracker(run_dir, up.uri)
    run_id = first.start()
    first.log_config(CONFIG)
    for step in range(3):
        first.log_metrics({"loss/total": float(step)}, step=step)
    assert first.close("KILLED")  # e.g. preempted; the trainer keeps run_id in its checkpoint
    assert MlflowClient(up.uri).get_run(run_id).info.status == "KILLED"

    second = _tracker(run_dir, up.uri, resume_run_id=run_id)
    assert second.start() == run_id
    assert MlflowClient(up.uri).get_run(run_id).info.status == "RUNNING"
    changed = {**CONFIG, "run": {**CONFIG["run"], "num_steps": 6}}
    second.log_config(changed)  # a changed param cannot be re-logged: skipped, new YAML kept as artifact
    for step in range(3, 6):
        second.log_metrics({"loss/total": float(step)}, step=step)
    assert second.close()

    client = MlflowClient(up.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _steps(client, run_id, "loss/total") == [0, 1, 2, 3, 4, 5]
    assert run.data.params["run.num_steps"] == "3"
    assert "nrc.resumed_at" in run.data.tags
    names = [f.path for f in client.list_artifacts(run_id, "config")]
    assert "config/resolved.yaml" in names and any(n.startswith("config/resolved.resume-") for n in names)

    with pytest.raises(ValueError, match="cannot resume MLflow run 'deadbeef'"):
        _tracker(tmp_path / "other", up.uri, resume_run_id="deadbeef").start()


def test_exception_in_context_marks_the_run_failed_and_still_delivers(up: MlflowServer, tmp_path: Path) -> None:
    tracker = _tracker(tmp_path / "run", up.uri)
    with pytest.raises(RuntimeError, match="boom"), tracker:
        tracker.log_metrics({"loss/total": 1.0}, step=0)
        raise RuntimeError("boom")
    client = MlflowClient(up.uri)
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    assert _steps(client, tracker.run_id, "loss/total") == [0]


def test_system_metrics_on_cpu(up: MlflowServer, tmp_path: Path) -> None:
    with _tracker(tmp_path / "run", up.uri, system_metrics=True, system_metrics_interval_s=0.2) as tracker:
        time.sleep(1.0)
    metrics = MlflowClient(up.uri).get_run(tracker.run_id).data.metrics
    expected = {
        "system/cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
        "system/system_memory_usage_percentage",
        "system/disk_usage_percentage",
        "system/network_receive_megabytes",
    }
    assert expected <= set(metrics)
    assert 0.0 <= metrics["system/system_memory_usage_percentage"] <= 100.0
    assert len(_steps(MlflowClient(up.uri), tracker.run_id, "system/cpu_utilization_percentage")) >= 2


def test_ranks_other_than_zero_and_disabled_tracking_are_no_ops(tmp_path: Path) -> None:
    for tracker in (
        _tracker(tmp_path / "r1", "http://127.0.0.1:9", rank=1),
        _tracker(tmp_path / "r2", "http://127.0.0.1:9", enabled=False),
    ):
        assert tracker.start() is None  # never contacts the (dead) URI
        tracker.log_metrics({"loss/total": 1.0}, step=0)
        tracker.log_config(CONFIG)
        assert tracker.close() is True
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_hung_server_costs_training_nothing_and_late_answers_are_not_duplicated(
    up: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that accepts connections but does not answer (SIGSTOP): each delivery attempt times out after
    request_timeout_s in the background thread; when it answers again (SIGCONT) it also processes the requests
    that timed out, and our retries of the same records are deduplicated by their original timestamps."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tracker = _tracker(tmp_path / "run", up.uri, request_timeout_s=1)
    run_id = tracker.start()
    tracker.log_metrics({"loss/total": 0.0}, step=0)
    assert tracker.flush(timeout_s=10)
    up.pause()
    try:
        worst = 0.0
        for step in range(1, 11):
            t0 = time.perf_counter()
            tracker.log_metrics({"loss/total": float(step)}, step=step)
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.15)
        # blocking would cost at least request_timeout_s = 1 s per call; the budget leaves a loaded machine room
        assert worst < 0.75, f"log_metrics blocked on a hung server: {worst:.3f} s"
        assert tracker.pending_records > 0
    finally:
        up.resume()
    assert tracker.close(timeout_s=30)
    outage = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage) == 1 and "ReadTimeout" in outage[0]  # the 1 s request timeout, not a refused connection
    history = MlflowClient(up.uri).get_metric_history(run_id, "loss/total")
    assert sorted(m.step for m in history) == list(range(11))


def test_outage_mid_run_buffers_without_blocking_and_a_run_that_ends_during_it_replays_later(
    up: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One outage, two runs (one server restart keeps the default lane short):

    run A trains through the outage: log_metrics never blocks, everything is delivered once, in order,
    when the server is back; run B ends while the server is down: close() reports within its bound,
    the journal keeps every record, and replay_buffer() delivers them after the restart.
    """
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    a = _tracker(run_a, up.uri)
    b = _tracker(run_b, up.uri, close_timeout_s=1.5)
    id_a, id_b = a.start(), b.start()
    for step in range(5):
        a.log_metrics({"loss/total": float(step), "reward/mean": step / 10}, step=step)
    b.log_metrics({"loss/total": 0.0}, step=0)
    assert a.flush(timeout_s=10) and b.flush(timeout_s=10)

    up.stop(abrupt=True)  # the server dies (SIGKILL to its process group)

    durations = []
    for step in range(5, 25):
        t0 = time.perf_counter()
        a.log_metrics({"loss/total": float(step), "reward/mean": step / 10}, step=step)
        durations.append(time.perf_counter() - t0)
        time.sleep(0.02)
    note = tmp_path / "outage.txt"
    note.write_text("written during the outage")
    a.log_artifact(note, "notes")
    note.unlink()  # the tracker spooled its own copy
    assert a.pending_records > 0
    assert not a.flush(timeout_s=1.0)
    # blocking would cost MLflow's retries with back-off (seconds per call); a journal append costs milliseconds
    assert max(durations) < 1.0, f"log_metrics blocked during the outage: {max(durations):.3f} s"

    for step in range(1, 6):
        b.log_metrics({"loss/total": float(step)}, step=step)
    final = tmp_path / "final.txt"
    final.write_text("end of run")
    b.log_artifact(final)
    t0 = time.monotonic()
    assert b.close("FINISHED") is False
    assert time.monotonic() - t0 < 15.0, "close() must give up within its bound (1.5 s), not wait for the server"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "still unreachable" in errors[0]
    assert "nemo_rollout_correction.tracking.replay" in errors[0] and str(run_b) in errors[0]
    assert pending_records(run_b) == 7  # 5 metric steps, the artifact, the final status

    up.start()  # same port, same sqlite file
    for step in range(25, 30):
        a.log_metrics({"loss/total": float(step), "reward/mean": step / 10}, step=step)
    assert a.close(timeout_s=30)

    client = MlflowClient(up.uri)
    assert _steps(client, id_a, "loss/total") == list(range(30))
    assert _steps(client, id_a, "reward/mean") == list(range(30))
    values = [m.value for m in sorted(client.get_metric_history(id_a, "loss/total"), key=lambda m: m.step)]
    assert values == [float(s) for s in range(30)]
    assert [f.path for f in client.list_artifacts(id_a, "notes")] == ["notes/outage.txt"]
    assert client.get_run(id_a).info.status == "FINISHED"
    assert pending_records(run_a) == 0
    warnings_a = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(run_a) in r.getMessage()
    ]
    assert len(warnings_a) == 1 and "unreachable" in warnings_a[0]  # one warning when the outage starts
    recovered = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(recovered) == 1  # ... and one when the backlog is delivered

    assert client.get_run(id_b).info.status == "RUNNING"  # B's end never arrived
    result = replay_buffer(run_b, up.uri)
    assert (result.delivered, result.rejected) == (7, 0)
    assert _steps(client, id_b, "loss/total") == list(range(6))
    assert client.get_run(id_b).info.status == "FINISHED"
    assert [f.path for f in client.list_artifacts(id_b)] == ["final.txt"]
    assert pending_records(run_b) == 0
    assert replay_buffer(run_b, up.uri).delivered == 0  # nothing twice

"""MlflowTracker: the trainer's one handle on MLflow (rank 0 only; outage-tolerant).

Usage (the trainer):

    tracker = MlflowTracker(tracking_uri=None, experiment="nemo_rollout_correction", run_name="grpo",
                            run_dir=Path("runs/grpo"), rank=rank, resume_run_id=ckpt.get("mlflow_run_id"))
    with tracker:                       # start(); on exit close("FINISHED"), or "FAILED" on an exception
        tracker.log_config(resolved_config_dict)
        for step in ...:
            tracker.log_metrics({"reward/mean": r, "loss/total": l}, step=step)
        ckpt["mlflow_run_id"] = tracker.run_id

Only `start()` talks to MLflow synchronously (so a wrong URI fails before training starts). Every
later call journals the record on disk and returns; a daemon thread delivers in order (see sender.py),
so a dead or slow server never blocks a training step.
"""

from __future__ import annotations

import datetime as _dt
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from nemo_rollout_correction.config.redaction import redact_tree

from .delivery import Deliverer, bound_http_requests, classify, is_http_uri
from .errors import TrackingUnavailableError
from .journal import Journal
from .params import (
    MAX_TAG_VALUE_LENGTH,
    check_metric_name,
    flatten_config,
    sanitize_key,
    to_float,
    to_plain,
    truncate_value,
)
from .replay import buffer_dir
from .run_tags import default_tags
from .sender import BufferedSender
from .system_metrics import SYSTEM_PREFIX, SystemMetricsSampler

logger = logging.getLogger("nemo_rollout_correction.tracking")

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
_STATUSES = ("FINISHED", "FAILED", "KILLED")


def default_tracking_uri(run_dir: Path) -> str:
    """`sqlite:///<abs run_dir>/mlflow.db`: a self-contained store inside the run directory."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _now_ms() -> int:
    return int(time.time() * 1000)


class MlflowTracker:
    """Experiment tracking for one training run: params, metrics, artifacts, tags, system metrics.

    Args:
        tracking_uri: MLflow tracking URI (`http://host:port`, `sqlite:///path.db`, ...); None ->
            `sqlite:///<run_dir>/mlflow.db` with artifacts under `<run_dir>/mlruns`.
        experiment: experiment name (created if missing).
        run_name: MLflow run name of a new run (ignored on resume).
        run_dir: the run's output directory; the delivery journal lives in `<run_dir>/tracking/`.
        rank: global rank; every rank but 0 is a no-op (run_id None there).
        enabled: False -> every method is a no-op.
        resume_run_id: continue this MLflow run (same run id; the caller keeps step numbers going).
        tags: extra run tags (on top of git sha and package versions).
        system_metrics: sample `system/...` metrics (CPU, memory, disk, network, NVIDIA GPU) in a thread.
        request_timeout_s: per-request HTTP timeout (integer seconds; MLflow's env var is an int).
        close_timeout_s: how long `close()` keeps retrying delivery before leaving the journal for replay.
        system_metrics_interval_s: seconds between system metric samples.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str | None,
        run_dir: Path | str,
        rank: int = 0,
        enabled: bool = True,
        resume_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        system_metrics: bool = False,
        *,
        request_timeout_s: int = 5,
        close_timeout_s: float = 30.0,
        system_metrics_interval_s: float = 10.0,
    ) -> None:
        if not experiment:
            raise ValueError("tracking.experiment must be a non-empty experiment name")
        if close_timeout_s < 0:
            raise ValueError(f"close_timeout_s must be >= 0, got {close_timeout_s}")
        self.run_dir = Path(run_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.run_dir)
        self.experiment = experiment
        self.run_name = run_name
        self.rank = rank
        self.enabled = enabled
        self.resume_run_id = resume_run_id
        self.extra_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.system_metrics = system_metrics
        self.request_timeout_s = request_timeout_s
        self.close_timeout_s = close_timeout_s
        self.system_metrics_interval_s = system_metrics_interval_s
        self._run_id: str | None = None
        self._sender: BufferedSender | None = None
        self._sampler: SystemMetricsSampler | None = None
        self._existing_params: dict[str, str] = {}
        self._closed = False

    # ---- properties ------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True on the rank that talks to MLflow (rank 0 with tracking enabled)."""
        return self.enabled and self.rank == 0

    @property
    def run_id(self) -> str | None:
        """The MLflow run id after `start()` on the active rank; None elsewhere. Store it in checkpoints."""
        return self._run_id

    @property
    def buffer_dir(self) -> Path:
        """Directory of the delivery journal (`<run_dir>/tracking/`)."""
        return buffer_dir(self.run_dir)

    @property
    def pending_records(self) -> int:
        """Records journaled but not yet delivered (0 when inactive)."""
        return self._sender.pending if self._sender is not None else 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> str | None:
        """Connect, create (or resume) the run, start delivery; return the run id (None when inactive).

        Raises TrackingUnavailableError if the store does not answer (an http URI with no server fails
        in milliseconds when the port is closed, in `request_timeout_s` when the host does not answer),
        ValueError if `resume_run_id` does not exist there.
        """
        if not self.active or self._run_id is not None:
            return self._run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if is_http_uri(self.tracking_uri):
            bound_http_requests(self.request_timeout_s)
        try:
            from mlflow import MlflowClient
        except ImportError as err:
            raise TrackingUnavailableError(
                "tracking is enabled but mlflow is not installed: `pip install 'nemo_rollout_correction[mlflow]'` "
                "or set tracking.enabled=false"
            ) from err
        client = MlflowClient(tracking_uri=self.tracking_uri)
        try:
            experiment_id = self._experiment_id(client)
            if self.resume_run_id:
                run = self._resume(client, self.resume_run_id)
            else:
                tags = redact_tree({**default_tags(), **self.extra_tags})
                tags = {sanitize_key(k): truncate_value(v, MAX_TAG_VALUE_LENGTH) for k, v in tags.items()}
                run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        except (TrackingUnavailableError, ValueError):
            raise
        except Exception as err:  # turned into one actionable error
            raise self._unavailable(err) from err
        self._run_id = run.info.run_id
        self._existing_params = dict(run.data.params)
        journal = Journal(self.buffer_dir)
        uri = self.tracking_uri
        self._sender = BufferedSender(journal, lambda: Deliverer(uri), uri)
        if self.resume_run_id:
            self._submit({"kind": "tags", "tags": {**default_tags(), **self.extra_tags, "nrc.resumed_at": _iso_now()}})
        if self.system_metrics:
            first = self._last_system_step(run) + 1
            self._sampler = SystemMetricsSampler(
                self.log_metrics, interval_s=self.system_metrics_interval_s, first_step=first
            )
            self._sampler.start()
        logger.info("MLflow run %s (%s) at %s", self._run_id, "resumed" if self.resume_run_id else "new", uri)
        return self._run_id

    def _experiment_id(self, client: Any) -> str:
        existing = client.get_experiment_by_name(self.experiment)
        if existing is not None:
            if existing.lifecycle_stage != "active":
                raise ValueError(
                    f"MLflow experiment {self.experiment!r} at {self.tracking_uri} is deleted; restore it "
                    "(`mlflow experiments restore`) or choose another tracking.experiment"
                )
            return str(existing.experiment_id)
        artifact_location = None
        if self.tracking_uri.startswith("sqlite:///"):
            # Keep artifacts next to the database (MLflow's default is ./mlruns of whatever the cwd is).
            db_path = Path(self.tracking_uri[len("sqlite:///") :])
            artifact_location = (db_path.parent / "mlruns").resolve().as_uri()
        return str(client.create_experiment(self.experiment, artifact_location=artifact_location))

    def _resume(self, client: Any, run_id: str) -> Any:
        try:
            run = client.get_run(run_id)
        except Exception as err:
            if not classify(err).transient:
                raise ValueError(
                    f"cannot resume MLflow run {run_id!r}: not found at {self.tracking_uri} ({err}). "
                    "Point tracking.tracking_uri at the store the run was created in, or start a new run"
                ) from err
            raise
        client.update_run(run_id, status="RUNNING")
        return run

    @staticmethod
    def _last_system_step(run: Any) -> int:
        # Run.data keeps the latest Metric objects (with steps) only in a private field; mlflow's own
        # SystemMetricsMonitor reads it the same way. Without it, system steps restart at 0.
        metric_objs = getattr(run.data, "_metric_objs", [])
        steps = [m.step for m in metric_objs if m.key.startswith(SYSTEM_PREFIX)]
        return max(steps, default=-1)

    def _unavailable(self, err: BaseException) -> TrackingUnavailableError:
        uri = self.tracking_uri
        if is_http_uri(uri):
            fix = (
                "start the server (e.g. `mlflow server --host 127.0.0.1 --port <port>`) or fix "
                "tracking.tracking_uri; tracking.tracking_uri=null logs to a local sqlite file instead, "
                "tracking.enabled=false disables tracking"
            )
        else:
            fix = "check that the path is writable and the file is an MLflow database, or set tracking.enabled=false"
        first_line = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        return TrackingUnavailableError(f"MLflow tracking store {uri} is not reachable: {first_line}. To fix: {fix}.")

    def __enter__(self) -> MlflowTracker:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            status: RunStatus = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        self.close(status)

    # ---- logging (journal + background delivery; never blocks on the network) ----------------------
    def _submit(self, record: dict[str, Any]) -> None:
        if self._sender is None or self._closed:
            return
        self._sender.submit({**record, "run_id": self._run_id})

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log `{name: number}` at `step`. Names follow MLflow's rules (ValueError names a bad one).

        Values may be Python/numpy numbers or one-element tensors; NaN/inf are logged as MLflow stores them.
        Returns after an append to the on-disk journal (microseconds), whatever the server's state.
        """
        if not self.active or not metrics:
            return
        values = {check_metric_name(k): to_float(k, v) for k, v in metrics.items()}
        self._submit({"kind": "metrics", "step": int(step), "timestamp": _now_ms(), "metrics": values})

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log flat params (values stringified and truncated). On a resumed run a changed value is skipped
        with a warning (MLflow params are immutable); the new resolved config is still saved as an artifact."""
        if not self.active or not params:
            return
        flat = flatten_config(redact_tree(params))  # credentials never reach MLflow (config/redaction.py)
        changed = {k: (self._existing_params[k], v) for k, v in flat.items() if self._existing_params.get(k, v) != v}
        if changed:
            logger.warning(
                "MLflow params are immutable; not re-logging %d changed on resume: %s",
                len(changed),
                ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items())[:20]),
            )
        flat = {k: v for k, v in flat.items() if k not in changed}
        self._existing_params.update(flat)
        self._submit({"kind": "params", "params": flat})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values stringified and truncated to MLflow's 8000 characters)."""
        if not self.active or not tags:
            return
        clean = {sanitize_key(str(k)): truncate_value(str(v), MAX_TAG_VALUE_LENGTH)
                 for k, v in redact_tree(dict(tags)).items()}
        self._submit({"kind": "tags", "tags": clean})

    def log_config(self, resolved: Mapping[str, Any]) -> None:
        """Log the resolved config: flattened dotted params plus the YAML as artifact `config/resolved.yaml`.

        On a resumed run the YAML goes to `config/resolved.resume-<UTC time>.yaml` (the first one stays).
        """
        if not self.active:
            return
        import yaml

        resolved = redact_tree(resolved)
        self.log_params(resolved)
        name = "resolved.yaml" if not self.resume_run_id else f"resolved.resume-{_iso_now(compact=True)}.yaml"
        path = self.buffer_dir / "config" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(to_plain(resolved), sort_keys=False), encoding="utf-8")
        self.log_artifact(path, "config")

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, under `artifact_path` (None: the run's artifact root).

        Same convention as MLflow: `log_artifact("a/b.png", "plots")` -> `plots/b.png`;
        `log_artifact("review/step_000005", "review/step_000005")` -> `review/step_000005/<files>`.

        The file is copied into the journal's spool first, so the caller may overwrite or delete it
        right away; the copy is removed after upload. Raises FileNotFoundError for a missing path.
        """
        if not self.active or self._sender is None or self._closed:
            return
        source = Path(path)
        if not source.exists():
            raise FileNotFoundError(f"log_artifact: {source} does not exist")
        sender = self._sender
        with sender.journal.lock:  # the spool dir is named after the record's seq: reserve both together
            seq = sender.journal.next_seq()
            spool = sender.journal.spool_dir_for(seq)
            spool.mkdir(parents=True, exist_ok=True)
            target = spool / source.name
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copy2(source, target)
            record = {"kind": "artifact", "local_path": str(target.resolve()), "artifact_path": artifact_path}
            stamped = sender.submit({**record, "run_id": self._run_id})
        assert int(stamped["seq"]) == seq, "spool directory and journal seq must agree"

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded, default close_timeout_s) until everything logged so far is delivered; True if it is."""
        if self._sender is None or self._closed:
            return True
        return self._sender.flush(self.close_timeout_s if timeout_s is None else timeout_s)

    def close(self, status: RunStatus = "FINISHED", timeout_s: float | None = None) -> bool:
        """End the run with `status` and deliver everything, retrying up to `timeout_s` (default close_timeout_s).

        Returns True if everything reached MLflow. Otherwise logs an error naming the journal and the
        replay command; the journal keeps every record (including the final status) for
        `replay_buffer(run_dir, tracking_uri)`. Safe to call twice; never raises for an outage.
        """
        if status not in _STATUSES:
            raise ValueError(f"close(status={status!r}): allowed {', '.join(_STATUSES)}")
        if self._sender is None or self._closed:
            self._closed = True
            return True
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        self._submit({"kind": "status", "status": status, "end_time": _now_ms()})
        self._closed = True
        sender = self._sender
        timeout = self.close_timeout_s if timeout_s is None else timeout_s
        delivered = sender.close(timeout)
        if delivered:
            logger.info("MLflow run %s closed (%s); all records delivered", self._run_id, status)
        else:
            logger.error(
                "MLflow tracking at %s still unreachable after %.0f s (%s): %d records (run %s, status %s) "
                "remain in %s. "
                "Deliver them later with `python -m nemo_rollout_correction.tracking.replay %s --tracking-uri %s` "
                "or replay_buffer(run_dir, tracking_uri).",
                self.tracking_uri,
                timeout,
                sender.last_error or "no answer",
                sender.pending,
                self._run_id,
                status,
                sender.journal.journal_path,
                self.run_dir,
                self.tracking_uri,
            )
        return delivered


def _iso_now(compact: bool = False) -> str:
    now = _dt.datetime.now(_dt.UTC)
    return now.strftime("%Y%m%dT%H%M%SZ") if compact else now.isoformat(timespec="seconds")


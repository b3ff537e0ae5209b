"""System metrics (`system/...`) sampled with MLflow's own psutil/NVML collectors, delivered through our buffer.

Why not `mlflow.system_metrics.SystemMetricsMonitor` as is: in mlflow 3.17.2 its thread polls the run
status over the network every interval and *stops for good* on the first failed request, so an outage
would end system metrics for the rest of the run. Here the same collectors (CPUMonitor, DiskMonitor,
NetworkMonitor, GPUMonitor when NVML sees a GPU) feed `MlflowTracker.log_metrics`, which buffers.

Logged keys (CPU machine): system/cpu_utilization_percentage, system/system_memory_usage_megabytes,
system/system_memory_usage_percentage, system/disk_usage_percentage, system/disk_usage_megabytes,
system/disk_available_megabytes, system/network_receive_megabytes, system/network_transmit_megabytes;
with a GPU also system/gpu_<i>_utilization_percentage, system/gpu_<i>_memory_usage_megabytes/percentage,
system/gpu_<i>_power_usage_watts/percentage. Step = sample index (continues on resume).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

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

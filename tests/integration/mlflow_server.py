"""A real `mlflow server` on 127.0.0.1 for integration tests: start, stop (kill its process group), restart.

    server = MlflowServer(tmp_path)        # sqlite file + artifact dir under tmp_path, a free port
    server.start()                         # waits for GET /health == OK (about 7-15 s on 2 cores)
    server.uri                             # "http://127.0.0.1:<port>"
    server.stop()                          # SIGTERM to the whole group, SIGKILL after a grace period
    server.pause(); server.resume()        # SIGSTOP / SIGCONT the group: a hung server
    server.start()                         # same port, same sqlite file, same artifacts: an outage ends

The server runs in its own session (`start_new_session=True`), so its uvicorn worker dies with it.
`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false` skips the job runner (faster start); telemetry is disabled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mlflow_executable() -> list[str]:
    exe = Path(sys.executable).with_name("mlflow")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]


class MlflowServer:
    """One `mlflow server` process group with a sqlite backend and a local artifact store under `root`."""

    def __init__(self, root: Path, port: int | None = None, start_timeout_s: float = 90.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.db_path = self.root / "mlflow.db"
        self.artifacts = self.root / "artifacts"
        self.start_timeout_s = start_timeout_s
        self.log_path = self.root / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        """GET /health answers OK within one second."""
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def start(self) -> float:
        """Start and wait until healthy; return the seconds it took. RuntimeError with the log tail on failure."""
        if self.running:
            return 0.0
        env = {
            **os.environ,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
        }
        cmd = [
            *_mlflow_executable(),
            "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.db_path}",
            "--artifacts-destination", str(self.artifacts),
            "--workers", "1",
        ]  # fmt: skip
        t0 = time.monotonic()
        log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root, start_new_session=True
        )
        log.close()
        while time.monotonic() - t0 < self.start_timeout_s:
            if self._proc.poll() is not None:
                break
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.25)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"mlflow server on port {self.port} did not become healthy; log tail:\n{tail}")

    def stop(self, grace_s: float = 5.0, *, abrupt: bool = False) -> None:
        """Kill the server's process group and wait until the port is closed.

        Graceful: SIGTERM, then SIGKILL after `grace_s`. `abrupt=True`: SIGKILL at once (a crash, an outage).
        """
        if self._proc is None:
            return
        pgid = self._proc.pid  # leader of its own session/group
        if not abrupt:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # workers too, even if the leader already exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=grace_s)
        self._proc = None
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._port_open():
            time.sleep(0.1)

    def pause(self) -> None:
        """SIGSTOP the whole group: connections are still accepted by the kernel but never answered (a hung server)."""
        assert self._proc is not None, "server not started"
        os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the group: the server answers again, including requests queued while it was stopped."""
        assert self._proc is not None, "server not started"
        os.killpg(self._proc.pid, signal.SIGCONT)

    def _port_open(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

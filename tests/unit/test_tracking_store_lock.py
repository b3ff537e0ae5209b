"""The lock beside a sqlite tracking store (tracking/store_lock.py): which URIs it covers, that it admits one
holder at a time, and that two processes opening one new store through it with real MLflow both succeed (without
it the second one's schema migration fails)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from default_lane import require

from nemo_rollout_correction.tracking.store_lock import (
    StoreLockTimeout,
    lock_path,
    sqlite_db_path,
    store_lock,
)


def test_only_sqlite_file_uris_are_locked(tmp_path: Path) -> None:
    assert sqlite_db_path(f"sqlite:///{tmp_path}/m.db") == tmp_path / "m.db"
    assert sqlite_db_path("sqlite:///rel/m.db?timeout=3") == Path("rel/m.db")
    assert sqlite_db_path("sqlite://") is None
    assert sqlite_db_path("http://127.0.0.1:5000") is None
    assert lock_path(tmp_path / "m.db") == tmp_path / "m.db.nrc-init.lock"
    with store_lock("http://127.0.0.1:5000") as held:
        assert held is None


def test_one_holder_at_a_time_and_a_bounded_wait(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/new/m.db"  # the store's directory does not exist yet
    inside = 0
    most = 0
    guard = threading.Lock()
    errors: list[BaseException] = []

    def hold() -> None:
        nonlocal inside, most
        try:
            with store_lock(uri, poll_s=0.01) as held:
                assert held == tmp_path / "new" / "m.db.nrc-init.lock"
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.05)
                with guard:
                    inside -= 1
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=hold) for _ in range(4)]  # separate open()s conflict within a process too
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and most == 1

    with store_lock(uri), pytest.raises(StoreLockTimeout, match=r"m\.db\.nrc-init\.lock for over 0 s"), \
            store_lock(uri, timeout_s=0.2, poll_s=0.05):
        pass
    with store_lock(uri) as held:  # released on exit, also after the timeout
        assert held is not None


_OPEN = """
import sys, time
from pathlib import Path
from mlflow import MlflowClient
from nemo_rollout_correction.tracking.store_lock import store_lock
uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.005)
with store_lock(uri):
    MlflowClient(uri).search_experiments()
"""


def test_two_processes_open_one_new_store_at_once(tmp_path: Path) -> None:
    require("mlflow", "mlflow")
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN, uri, str(r), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    go.touch()  # both have imported mlflow: they open the new store in the same instant
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-3000:]
    from mlflow import MlflowClient

    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]

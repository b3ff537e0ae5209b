"""One process at a time opens a local MLflow store (`sqlite:///`) and creates its run there.

Why by hand: MLflow 3.17.2's SqlAlchemyStore creates and migrates a new database's tables (alembic) in its
constructor with nothing that serialises processes, so two `nrc train` started at once against one new store
both migrate and the second dies (`duplicate column name: step`, or alembic's "expected to match one row"); two
starts that find no experiment would both create it the same way. An exclusive `fcntl.flock` on a file beside
the database (`<db>.nrc-init.lock`), held while a process opens the store and creates (or resumes) its run,
makes the others wait a few seconds and then open the ready store. The store itself stays MLflow's.

Later writes need no lock: sqlite serialises them, and a write that still finds the database locked after
sqlite's busy timeout is a transient delivery error that the sender retries in order (`delivery.classify`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("nemo_rollout_correction.tracking")

LOCK_SUFFIX = ".nrc-init.lock"
SQLITE_PREFIX = "sqlite:///"


class StoreLockTimeout(TimeoutError):
    """Another process held a store's lock too long; the message names the lock file."""


def sqlite_db_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (`sqlite:////abs` or relative to the cwd); None for any
    other URI (an http server, `sqlite://` in memory), which needs no lock."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return None
    path = tracking_uri[len(SQLITE_PREFIX):].split("?", 1)[0]
    return Path(path) if path else None


def lock_path(db_path: Path) -> Path:
    """The lock file beside a database: `<db>.nrc-init.lock`."""
    return db_path.with_name(db_path.name + LOCK_SUFFIX)


@contextmanager
def store_lock(tracking_uri: str, timeout_s: float = 300.0, poll_s: float = 0.1) -> Iterator[Path | None]:
    """Hold the exclusive lock of a `sqlite:///` store while the body opens (creates, migrates) it; yield the
    lock file, or None when the URI needs no lock, the lock file cannot be created (MLflow then reports the
    problem with the path itself) or its file system cannot lock (a warning says so).

    Raises StoreLockTimeout naming the lock file when another process holds it longer than `timeout_s`
    (opening a store and creating a run take seconds).
    """
    db = sqlite_db_path(tracking_uri)
    if db is None:
        yield None
        return
    path = lock_path(db)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # MLflow creates a sqlite store's directory too
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:  # unwritable directory: leave the error to MLflow, which names the store
        logger.debug("cannot create the store lock %s (%s); opening the store without it", path, err)
        yield None
        return
    try:
        yield path if _acquire(fd, path, timeout_s, poll_s) else None
    finally:
        os.close(fd)  # closing the descriptor releases the lock; the file stays for the next process


def _acquire(fd: int, path: Path, timeout_s: float, poll_s: float) -> bool:
    """Take the lock (True), or find that the file system cannot lock (False: go on without, as before)."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as err:  # e.g. ENOLCK on a network mount without a lock service
            logger.warning("cannot lock %s (%s): runs started at once against this store may collide; an "
                           "`mlflow server` in front of it serialises them", path, err)
            return False
        if not waited:
            logger.info("waiting for another process to open the MLflow store (lock %s)", path)
            waited = True
        if time.monotonic() >= deadline:
            raise StoreLockTimeout(
                f"another process held the MLflow store lock {path} for over {timeout_s:.0f} s; if no other "
                "nrc process is opening this store, look for one that hangs on it (a stuck network mount)"
            )
        time.sleep(poll_s)

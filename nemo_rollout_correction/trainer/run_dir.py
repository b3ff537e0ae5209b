"""A run directory belongs to one run: the lock a running `nrc train` holds in `run.output_dir`, and what a new
run does with a previous run's files there (docs/training.md, "The run directory").

- `lock_run_dir(output_dir)`: take `<output_dir>/.nrc.lock` with `fcntl.flock` (the OS releases it on any exit,
  a crash or SIGKILL included) and write this process's PID, host and start time into it. A lock another process
  holds raises `RunDirBusy` naming that PID and host. A clean release empties the file, so a file that still names
  a holder once its lock is free was left by a process that died: it is reported as stale and taken.
- `find_previous_run(output_dir, checkpoint_dir)`: the steps in `metrics.jsonl` and the `step_*` checkpoints.
- `move_aside(...)`: a previous run's files into `<output_dir>/previous-<UTC time>/` (nothing is deleted).
- `claim_run_dir(...)`: the three together, as `nrc train` runs them on global rank 0 before any process group,
  MLflow run or engine exists; other ranks write nothing there before the start barrier that follows.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LOCK_NAME = ".nrc.lock"
PREVIOUS_PREFIX = "previous-"
# Left in place by a move aside: the lock, earlier moves, and the local MLflow store (a store of many runs: the
# previous run stays in it, and its artifacts stay where the store's records point).
KEPT = (LOCK_NAME, "mlflow.db", "mlflow.db-journal", "mlflow.db-wal", "mlflow.db-shm", "mlflow.db.nrc-init.lock",
        "mlruns")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class RunDirBusy(RuntimeError):
    """Another process holds the run directory's lock; the message names its PID and host."""


class PreviousRunFound(RuntimeError):
    """The run directory holds a previous run and neither run.resume nor run.overwrite says what to do with it."""


@dataclass
class RunDirLock:
    """The held lock of a run directory: `stale` is the holder a dead process left in the file (or None);
    `unsupported` the error of a file system without flock (`fd` is then None and nothing is locked)."""

    path: Path
    fd: int | None
    stale: dict[str, object] | None = None
    unsupported: str | None = None

    def release(self) -> None:
        """Empty the lock file (a clean end leaves no holder behind) and let go of it; safe to call twice."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> dict[str, object] | None:
    raw = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
    if not raw:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return {"pid": "?", "host": "?", "started": raw[:80]}
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict[str, object] | None) -> str:
    """`PID 123 on host node7 (since 2026-11-28T20:41:00Z)`, or that the holder has not written itself yet."""
    if holder is None:
        return "a process that has not written its PID yet"
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')})"


def lock_run_dir(output_dir: Path, *, wait_for_holder_s: float = 2.0) -> RunDirLock:
    """Take `<output_dir>/.nrc.lock` (creating the directory); raise `RunDirBusy` when another process holds it.

    A file system without flock (some network mounts) gives a lock with `fd=None`: nothing is refused there.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited across exec (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            return RunDirLock(path, None, unsupported=str(exc))
        holder = _read_holder(fd)
        deadline = time.monotonic() + wait_for_holder_s
        while holder is None and time.monotonic() < deadline:  # it took the lock a moment ago: its PID follows
            time.sleep(0.1)
            holder = _read_holder(fd)
        os.close(fd)
        raise RunDirBusy(f"{output_dir} is in use by another nrc train: {describe_holder(holder)}, lock {path}; "
                         "wait for that run to end or stop it, or choose another run.output_dir") from None
    stale = _read_holder(fd)
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    return RunDirLock(path, fd, stale=stale)


@dataclass(frozen=True)
class PreviousRun:
    """What a run directory holds of an earlier run: the step column of `metrics.jsonl` (in file order) and the
    `step_*` checkpoint directories (`complete`: the steps whose checkpoint has its `meta.json`)."""

    output_dir: Path
    checkpoint_dir: Path
    metric_steps: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    complete: list[int] = field(default_factory=list)

    def describe(self) -> str:
        """`metrics.jsonl with steps 1-4; checkpoints step_2, step_4 in runs/x/checkpoints`."""
        parts = []
        if self.metric_steps:
            parts.append(f"metrics.jsonl with steps {_ranges(self.metric_steps)}")
        if self.checkpoints:
            names = ", ".join(f"step_{s}" for s in self.checkpoints)
            incomplete = [s for s in self.checkpoints if s not in self.complete]
            note = f" (incomplete: {', '.join(f'step_{s}' for s in incomplete)})" if incomplete else ""
            parts.append(f"checkpoints {names}{note} in {self.checkpoint_dir}")
        return "; ".join(parts)

    def refusal(self) -> str:
        """The one line that refuses a new run here, naming what was found and both ways on."""
        resume = (f"run.resume=true continues it from step_{self.complete[-1]}" if self.complete else
                  "run.resume=true has no complete checkpoint to continue from (it moves the files aside and "
                  "starts afresh)")
        return (f"{self.output_dir} holds a previous run ({self.describe()}): {resume}; run.overwrite=true moves "
                f"its files to {self.output_dir}/{PREVIOUS_PREFIX}<time>/ and starts a new run at step 1; or choose "
                "another run.output_dir")


def _ranges(steps: list[int]) -> str:
    """`[0, 1, 2, 3, 1, 2]` -> `0-3, 1-2` (runs of consecutive steps in file order)."""
    out: list[str] = []
    start = prev = steps[0]
    for step in [*steps[1:], None]:
        if step is not None and step == prev + 1:
            prev = step
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if step is not None:
            start = prev = step
    return ", ".join(out)


def _metric_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            steps.append(int(json.loads(line)["step"]))
    return steps


def find_previous_run(output_dir: Path, checkpoint_dir: Path) -> PreviousRun | None:
    """The previous run in `output_dir` (steps in `metrics.jsonl`, `step_*` under `checkpoint_dir`), or None."""
    checkpoints = sorted(int(m.group(1)) for child in (checkpoint_dir.iterdir() if checkpoint_dir.is_dir() else ())
                         if (m := _STEP_DIR.match(child.name)) and child.is_dir())
    found = PreviousRun(output_dir, checkpoint_dir, _metric_steps(output_dir / "metrics.jsonl"), checkpoints,
                        [s for s in checkpoints if (checkpoint_dir / f"step_{s}" / "meta.json").is_file()])
    return found if found.metric_steps or found.checkpoints else None


def _unique(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def move_aside(previous: PreviousRun) -> Path:
    """Move the previous run's files into `<output_dir>/previous-<UTC time>/` (its checkpoints kept under
    `checkpoints/` there; a `checkpoint.dir` outside the run directory gets its own `previous-<time>/` of the
    `step_*` directories). The lock, earlier `previous-*` directories and the MLflow store stay. Returns the
    directory the files went to."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out, ckpts = previous.output_dir, previous.checkpoint_dir
    dest = _unique(out / f"{PREVIOUS_PREFIX}{stamp}")
    dest.mkdir()
    for child in sorted(out.iterdir()):
        if child.name in KEPT or child.name.startswith(PREVIOUS_PREFIX):
            continue
        os.replace(child, dest / child.name)
    if ckpts.is_dir() and not ckpts.resolve().is_relative_to(out.resolve()):
        ckpt_dest = _unique(ckpts / f"{PREVIOUS_PREFIX}{stamp}")
        ckpt_dest.mkdir()
        for step in previous.checkpoints:
            os.replace(ckpts / f"step_{step}", ckpt_dest / f"step_{step}")
    return dest


def claim_run_dir(output_dir: Path, checkpoint_dir: Path, *, resume: bool, overwrite: bool,
                  log: Callable[[str], None]) -> RunDirLock:
    """Lock `output_dir` for this run and settle a previous run in it; returns the held lock.

    Raises `RunDirBusy` (another process holds it) or `PreviousRunFound` (a previous run, and neither
    `run.resume` nor `run.overwrite`). With `resume` and a complete checkpoint the previous run is continued;
    with `overwrite`, or `resume` without a complete checkpoint (nothing to continue, and a fresh start must not
    append to its metrics), its files are moved aside, said in one line.
    """
    lock = lock_run_dir(output_dir)
    try:
        if lock.unsupported is not None:
            log(f"[nrc train] warning: cannot lock {lock.path} ({lock.unsupported}): a second "
                "run on this directory would not be refused")
        elif lock.stale is not None:
            log(f"[nrc train] took over a stale lock in {output_dir}: {describe_holder(lock.stale)} ended without "
                "releasing it")
        previous = find_previous_run(output_dir, checkpoint_dir)
        if previous is None or (resume and previous.complete):
            return lock
        if not (overwrite or resume):
            raise PreviousRunFound(previous.refusal())
        why = "run.overwrite=true" if overwrite else "run.resume=true without a complete checkpoint"
        dest = move_aside(previous)
        log(f"[nrc train] {why}: moved the previous run ({previous.describe()}) to {dest}; starting at step 1")
    except BaseException:
        lock.release()
        raise
    return lock


__all__ = ["LOCK_NAME", "PreviousRun", "PreviousRunFound", "RunDirBusy", "RunDirLock", "claim_run_dir",
           "describe_holder", "find_previous_run", "lock_run_dir", "move_aside"]

"""Stop cleanly on SIGTERM, SIGINT and SIGUSR1: the same step on every rank, a checkpoint, exit 75.

Slurm sends SIGTERM at a time limit or a preemption, or SIGUSR1 ahead of it when asked
(`sbatch --signal=B:USR1@<s>`, containers/slurm/grpo.sbatch); a user presses Ctrl-C (SIGINT). Without a
handler each of them kills the process mid-step: every step since the last periodic checkpoint is lost
and the MLflow run stays RUNNING. Here a signal only sets a flag (`StopRequest`). The trainer asks
`StopRequest.agreed()` at each step boundary, a one-element all-reduce over the job
(`distributed.runtime.any_rank`): a signal that reached one rank only, or the ranks at different
moments, still stops every rank after the same step. The trainer then checkpoints that step (the
in-flight async rollouts with it), finishes any background save, ends the MLflow run as KILLED, and the
CLI exits with `EXIT_PREEMPTED`. A second signal exits at once (`128 + signal number`): the previous
complete checkpoint is then the one to resume from.

The exit code also goes to the file named by `$NRC_EXIT_CODE_FILE` when that is set (`write_exit_code`):
torchrun replaces its workers' exit codes by 1, so a wrapper around torchrun reads the code there
(docs/deployment.md, "Preemption, time limits and exit codes").

Why by hand: torch.distributed and Megatron have no step-boundary stop (torchrun's own handler kills its
workers after a grace period), and the choice of a consistent stop point needs the trainer's loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from nemo_rollout_correction.distributed.runtime import any_rank

EXIT_PREEMPTED = 75
"""The exit code after a clean stop on a signal (sysexits' EX_TEMPFAIL, "try again"): the checkpoint of the last
finished step is complete and `run.resume=true` continues the run. The one definition (the sbatch script
repeats the number)."""

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The signals that ask for a clean stop."""

EXIT_CODE_FILE_ENV = "NRC_EXIT_CODE_FILE"
"""Environment variable naming a file that receives the process's exit code (for wrappers around torchrun)."""


def write_exit_code(code: int) -> None:
    """Write `code` to `$NRC_EXIT_CODE_FILE` when it is set (atomically; every rank writes the same code)."""
    target = os.environ.get(EXIT_CODE_FILE_ENV)
    if not target:
        return
    path = Path(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{code}\n")
        os.replace(tmp, path)
    except OSError:  # the exit code itself still tells the caller; a read-only dir must not mask it
        pass


class StopRequest:
    """The process's stop flag, set by the first of `STOP_SIGNALS`; a second signal exits at once.

    Use `install()` (not the constructor): one instance per process, shared by the CLI (which installs it
    before any model work, so a signal during start-up is not lost) and `GrpoTrainer.train`.
    """

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._users = 0

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal (local; use `agreed()` to decide)."""
        return self.signum is not None

    @property
    def signal_name(self) -> str | None:
        """SIGTERM, SIGINT or SIGUSR1 once one arrived, else None."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def agreed(self) -> bool:
        """Collective (every rank, same point of the loop): True on every rank when any rank got a signal."""
        return any_rank(self.requested)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # a second signal: no checkpoint, no MLflow close; the process ends now
            self._say(f"[nrc train] second signal ({name}): exiting at once with {128 + signum}; resume from the "
                      "newest complete checkpoint")
            write_exit_code(128 + signum)
            os._exit(128 + signum)
        self.signum = signum
        self._say(f"[nrc train] {name} received: stopping after the current step (checkpoint, MLflow run KILLED, "
                  f"exit {EXIT_PREEMPTED}); send it again to exit at once")

    def _say(self, message: str) -> None:
        """Print from the handler: through `log` (the terminal), or straight to fd 2 when the handler interrupted
        a print of the main thread (buffered I/O is not re-entrant)."""
        try:
            self.log(message)
        except RuntimeError:
            os.write(2, f"\n{message}\n".encode())

    def _install(self) -> None:
        if self._users == 0:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        self._users += 1

    def release(self) -> None:
        """Undo one `install()`; the previous handlers come back with the last one (tests run trainers in-process)."""
        global _current
        self._users -= 1
        if self._users > 0:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if _current is self:
            _current = None


_current: StopRequest | None = None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def install(log: Callable[[str], None] = _stderr) -> StopRequest:
    """The process's `StopRequest`, its handlers installed (or the one installed already); call `release()` after.

    Signal handlers can only be set in the main thread: elsewhere (a trainer driven from a worker thread) the
    returned request never fires and signals keep their previous handling.
    """
    global _current
    if _current is None:
        _current = StopRequest(log)
    if threading.current_thread() is threading.main_thread():
        _current._install()
    else:
        _current._users += 1
    return _current


__all__ = ["EXIT_CODE_FILE_ENV", "EXIT_PREEMPTED", "STOP_SIGNALS", "StopRequest", "install", "write_exit_code"]

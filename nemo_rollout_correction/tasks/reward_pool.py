"""Rewards off the critical path: score completions in a pool of worker processes, each call bounded in time.

``task.reward_workers = N > 0`` makes :func:`~nemo_rollout_correction.tasks.builtin.build_task` wrap the
reward function in a :class:`RewardPool`. The pool scores **one completion per call** (the reward
function receives lists of length 1), in ``N`` spawned processes, and returns the rewards in the
order of the inputs, so they equal the in-process ``score()`` of the whole batch for every reward that
scores each completion on its own (the protocol in ``rewards.py``; true of the built-ins).

What the pool needs from a reward function (checked before the first call, with a clear error):

- it can be sent to a fresh process: a module-level function or class instance importable by name
  (``pkg.module:fn``, a built-in, or a ``path/file.py:fn`` spec, which every worker loads itself).
  Lambdas, closures, functions defined inside other functions and objects holding open handles are
  not picklable; define the function at module level (or use ``task.reward_workers=0``);
- the records (``PromptRecord``, its ``metadata``) are picklable: JSON-like values are;
- its reward of a completion does not depend on the other completions of the batch.

Every call runs under ``task.reward_timeout_s``, measured from the moment a worker starts it. A call
that raises, returns a bad value, hangs past the bound or whose worker dies ends the scoring with a
:class:`RewardCallError` naming the sample (prompt index, sample index, a prompt excerpt) and the
cause; on a hang or a death every worker is killed before the error is raised, so nothing waits on a
stuck process. The next call starts a fresh pool.

Built on ``multiprocessing.Pool`` (spawn): its ``terminate()`` is the public way to kill workers that
are stuck in a call (``concurrent.futures.ProcessPoolExecutor`` has no such call before Python 3.14).
What the stdlib pool does not offer, the start time of each call and the process running it, comes
from a small queue the workers write to.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.tasks.rewards import (
    RewardError,
    describe_sample,
    load_reward_fn,
    reward_fn_name,
    sample_ids_from_records,
    score,
)

__all__ = ["RewardCallError", "RewardPool"]

_POLL_S = 0.02


class RewardCallError(RewardError):
    """A reward call failed, hung or lost its worker; the message names the sample and the cause."""


# ---- worker side (runs in the spawned processes) ----------------------------------------------------

_WORKER_FN: Callable[..., Any] | None = None
_WORKER_INIT_ERROR: str | None = None
_WORKER_EVENTS: Any = None


def _init_worker(payload: bytes | None, spec: str | None, events: Any) -> None:
    """Load the reward function once per worker; a failure is kept and reported by every call."""
    global _WORKER_FN, _WORKER_INIT_ERROR, _WORKER_EVENTS
    _WORKER_EVENTS = events
    try:
        _WORKER_FN = load_reward_fn(spec) if spec is not None else pickle.loads(payload or b"")
    except BaseException as error:  # an exception escaping the initializer would respawn workers forever
        _WORKER_INIT_ERROR = f"{type(error).__name__}: {error}"
    events.put(("ready", os.getpid(), _WORKER_INIT_ERROR))


def _score_one(
    index: int, sample_id: tuple[int, int], prompt: str, completion: str, record: PromptRecord, count: int
) -> tuple[str, Any]:
    """Score completion ``index``: ``("ok", reward)`` or ``("error", message)`` (never raises: the message
    travels as text, so an exception type the parent cannot unpickle still arrives)."""
    _WORKER_EVENTS.put(("start", os.getpid(), index))
    if _WORKER_INIT_ERROR is not None:
        where = describe_sample(sample_id[0], sample_id[1], prompt)
        return "error", f"a reward worker could not load the reward function to score {where}: {_WORKER_INIT_ERROR}"
    assert _WORKER_FN is not None
    try:
        return "ok", score(_WORKER_FN, [prompt], [completion], [record], [count], sample_ids=[sample_id])[0]
    except RewardError as error:
        cause = error.__cause__
        trace = "".join(traceback.format_exception(cause)) if cause is not None else ""
        return "error", f"{error}" + (f"\n{trace.rstrip()}" if trace else "")
    except Exception as error:  # score() raises only RewardError; anything else is a bug worth the text
        where = describe_sample(sample_id[0], sample_id[1], prompt)
        return "error", f"scoring {where}: {type(error).__name__}: {error}"


# ---- parent side ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _main_script_not_rerun(reward_fn: Any) -> Iterator[None]:
    """Spawn re-runs the parent's main *script* in every worker so that objects defined in it can be unpickled.
    Under the `nrc` console script that is `from nemo_rollout_correction.cli import main`: torch, Hydra and the
    CLI, seconds to minutes on a loaded machine, against the pool's startup bound, for nothing when the reward is
    not defined in that script. Hide the script's path while the workers start (spawn then leaves the workers'
    `__main__` alone, as it does for `python -m pkg`), unless the reward comes from `__main__`."""
    main = sys.modules.get("__main__")
    module = getattr(reward_fn, "__module__", None) or type(reward_fn).__module__
    path = getattr(main, "__file__", None)
    if main is None or path is None or module == "__main__" or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


class RewardPool:
    """A reward function run in ``num_workers`` spawned processes, one completion per call.

    Callable like the reward function itself (keyword lists, the :class:`~.rewards.RewardFn` protocol), so
    it can stand in a :class:`~.builtin.Task`; :meth:`score` also takes exact sample ids for error messages.
    The processes start at the first call (ranks that never score start none) and stop at :meth:`close`
    (or at interpreter exit).

    Args:
        reward_fn: the reward function (see the module doc for what the pool needs from it).
        num_workers: processes, >= 1.
        timeout_s: bound on one call, seconds, > 0.
        spec: the ``task.reward_fn`` string it was loaded from; workers then load it themselves (needed for
            ``path/file.py:fn`` specs, whose module exists only in this process).
        startup_timeout_s: bound on starting the workers and loading the function in each.

    Raises:
        ValueError: ``num_workers`` < 1 or a non-positive timeout.
        RewardError: ``reward_fn`` cannot be pickled (and no ``spec`` was given).
    """

    def __init__(
        self,
        reward_fn: Callable[..., Sequence[float]],
        num_workers: int,
        timeout_s: float,
        *,
        spec: str | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"task.reward_workers must be an integer >= 1 for a pool, got {num_workers!r}")
        for key, value in (("task.reward_timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not value > 0:
                raise ValueError(f"{key} must be > 0 seconds, got {value!r}")
        self.reward_fn = reward_fn
        self.name = reward_fn_name(reward_fn)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.spec = spec
        self._payload: bytes | None = None
        if spec is None:
            try:
                self._payload = pickle.dumps(reward_fn)
            except Exception as error:
                raise RewardError(
                    f"task.reward_workers={num_workers} runs the reward in other processes, but reward fn "
                    f"{self.name} cannot be pickled ({type(error).__name__}: {error}). Define it at module level "
                    "(not a lambda, closure or nested function) and pass it as 'pkg.module:fn' or "
                    "'path/file.py:fn', or set task.reward_workers=0 to score in this process"
                ) from error
        self._pool: Pool | None = None
        self._events: Any = None
        self.worker_pids: list[int] = []

    # Standing in for the reward function (RewardFn protocol); `score()` sends pools to `score` below.
    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        records: list[PromptRecord],
        completion_token_counts: list[int],
        **_: Any,
    ) -> list[float]:
        """Score like the wrapped function, in the pool."""
        return self.score(prompts, completions, records, completion_token_counts)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a RewardPool holds worker processes and cannot be pickled; pickle its reward_fn instead")

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> Pool:
        if self._pool is not None:
            return self._pool
        ctx = multiprocessing.get_context("spawn")  # fork would copy torch/vLLM/gloo state into the workers
        # SimpleQueue writes synchronously: a "start" message is in the pipe before the call begins, even if
        # the call then kills its process (a Queue's feeder thread would lose it and the death go unnoticed).
        self._events = ctx.SimpleQueue()
        with _main_script_not_rerun(self.reward_fn):  # a replacement worker, if any, re-runs it: only slower
            pool = ctx.Pool(self.num_workers, initializer=_init_worker,
                            initargs=(self._payload, self.spec, self._events))
        deadline = time.monotonic() + self.startup_timeout_s
        pids: list[int] = []
        started: set[int] = set()  # pool worker processes seen so far; the pool replaces any that exit
        while len(pids) < self.num_workers:
            if self._events.empty():
                started |= {p.pid for p in multiprocessing.active_children()
                            if p.name.startswith("SpawnPoolWorker") and p.pid is not None}
                if len(started) > 3 * self.num_workers:  # workers die before loading anything: fail now, not at 120 s
                    pool.terminate()
                    raise RewardCallError(
                        f"reward fn {self.name}: reward worker processes exit while starting ({len(started)} started, "
                        "none ready; their tracebacks are on stderr). Spawned workers re-import the main module: run "
                        "from a script file or `python -m` with an `if __name__ == '__main__':` guard, not from stdin"
                    )
                if time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                pool.terminate()
                raise RewardCallError(
                    f"reward fn {self.name}: {self.num_workers - len(pids)} of {self.num_workers} reward workers "
                    f"did not start within {self.startup_timeout_s:.0f} s (importing the reward's module hangs?)"
                )
            kind, pid, error = self._events.get()
            if kind != "ready":
                continue
            if error is not None:
                pool.terminate()
                raise RewardCallError(
                    f"reward fn {self.name}: a reward worker could not load it: {error}. The workers are fresh "
                    "processes: the function must be importable by name there (a module on PYTHONPATH, a file "
                    "spec 'path/file.py:fn', not something defined interactively)"
                )
            pids.append(pid)
        self._pool, self.worker_pids = pool, pids
        atexit.register(self.close)  # a trainer that never calls close(): stop the workers before interpreter exit
        return pool

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        records: Sequence[PromptRecord],
        completion_token_counts: Sequence[int],
        sample_ids: Sequence[tuple[int, int]] | None = None,
    ) -> list[float]:
        """``[num_completions]`` rewards in input order, each from one bounded call in a worker.

        Args:
            prompts, completions, records, completion_token_counts: ``[num_completions]`` each.
            sample_ids: ``[num_completions]`` ``(prompt_index, sample_index)`` used to name a failing sample;
                by default derived from ``records`` (:func:`sample_ids_from_records`).

        Raises:
            ValueError: the inputs differ in length.
            RewardCallError: a call raised or returned a bad value, ran past ``timeout_s``, or its worker
                died; the message names the sample and the cause. Hung or dead calls kill the pool first.
        """
        num = len(completions)
        lengths = {"prompts": len(prompts), "records": len(records),
                   "completion_token_counts": len(completion_token_counts)}
        if sample_ids is not None:
            lengths["sample_ids"] = len(sample_ids)
        if any(length != num for length in lengths.values()):
            raise ValueError(f"score: inputs differ in length: completions={num}, {lengths}")
        ids = list(sample_ids) if sample_ids is not None else sample_ids_from_records(records)
        if num == 0:
            return []
        pool = self._start()

        def name(index: int) -> str:
            return describe_sample(ids[index][0], ids[index][1], prompts[index])

        pending: dict[int, AsyncResult[tuple[str, Any]]] = {
            index: pool.apply_async(
                _score_one,
                (index, ids[index], prompts[index], completions[index], records[index],
                 int(completion_token_counts[index])),
            )
            for index in range(num)
        }
        rewards: list[float | None] = [None] * num
        running: dict[int, tuple[int, float]] = {}  # index -> (worker pid, start time) of calls in flight
        while pending:
            self._drain_events(running)
            for index in sorted(pending):
                result = pending[index]
                if not result.ready():
                    continue
                del pending[index]
                running.pop(index, None)
                try:
                    status, value = result.get()
                except Exception as error:  # the pool could not send the task (an unpicklable record)
                    self.close()
                    raise RewardCallError(
                        f"reward fn {self.name}: {name(index)} could not be sent to a reward worker "
                        f"({type(error).__name__}: {error}); records must be picklable"
                    ) from error
                if status != "ok":
                    self.close()
                    raise RewardCallError(value)  # names the function and the sample (see _score_one)
                rewards[index] = value
            now = time.monotonic()
            alive = {process.pid for process in multiprocessing.active_children()}
            for index, (pid, started) in sorted(running.items()):
                if index not in pending:
                    continue
                if now - started > self.timeout_s:
                    self.kill()
                    raise RewardCallError(
                        f"reward fn {self.name} timed out on {name(index)}: no result after {self.timeout_s:g} s "
                        f"(task.reward_timeout_s); its worker (pid {pid}) and the other reward workers were killed"
                    )
                if pid not in alive:
                    self.kill()
                    raise RewardCallError(
                        f"reward fn {self.name}: the worker process (pid {pid}) died while scoring {name(index)} "
                        "(a crash in native code, os._exit, or the OOM killer); the reward workers were killed"
                    )
            if pending:
                time.sleep(_POLL_S)
        scored = [value for value in rewards if value is not None]
        assert len(scored) == num, "every call returned or raised"
        return scored

    def _drain_events(self, running: dict[int, tuple[int, float]]) -> None:
        """Record which worker started which call, and when (the parent's clock)."""
        while not self._events.empty():  # this process is the only reader, so get() cannot block here
            kind, pid, index = self._events.get()
            if kind == "start":
                running[index] = (pid, time.monotonic())

    def kill(self) -> None:
        """Kill every worker now (a stuck call never returns, so nothing is waited on) and forget the pool."""
        pool, self._pool = self._pool, None
        if pool is not None:
            atexit.unregister(self.close)
            pool.terminate()  # SIGTERM to each worker, then joins them
        if self._events is not None:
            self._events.close()
            self._events = None
        self.worker_pids = []

    def close(self) -> None:
        """Stop the workers; the next call starts new ones."""
        self.kill()  # idle workers: terminating loses nothing, and a failed call's siblings must not linger

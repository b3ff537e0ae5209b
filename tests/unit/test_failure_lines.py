"""Every expected failure of `nrc train` is one clear line (issue 36, item 4; cli/failures.py).

Cheap rows: disk full (a real ENOSPC from a 4 MiB tmpfs, wrapped as torch.distributed.checkpoint raises it) and an
engine killed by the OOM killer (a real engine-like child process killed with SIGKILL while `watched` waits on it).
The port-in-use and missing-model rows run the real CLI: tests/integration/test_failure_lines_cli.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tmpfs import mounted_tmpfs
from torch.distributed.checkpoint.api import CheckpointException

from nemo_rollout_correction.cli.failures import explain
from nemo_rollout_correction.config import load_config
from nemo_rollout_correction.rollout.engine_processes import watched
from nemo_rollout_correction.rollout.errors import EngineProcessDiedError

MIB = 2**20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only: skipped otherwise), unmounted at the end."""
    with mounted_tmpfs(tmp_path / "disk", 4) as mount:
        yield mount


def _fill(path: Path) -> OSError:
    """Write `path` until the disk is full; the real ENOSPC error."""
    with pytest.raises(OSError) as info, open(path, "wb") as out:
        while True:
            out.write(b"\0" * MIB)
            out.flush()
    assert info.value.errno == errno.ENOSPC
    return info.value


def test_disk_full_names_the_path_the_space_and_the_kept_checkpoint(small_disk: Path) -> None:
    ckpts = small_disk / "run" / "checkpoints"
    (ckpts / "step_1" / "dist").mkdir(parents=True)
    (ckpts / "step_1" / "dist" / "__0_0.distcp").write_bytes(b"\0" * MIB)  # a complete checkpoint of 1 MiB
    (ckpts / "step_1" / "meta.json").write_text(json.dumps({"step": 1}))
    (ckpts / "step_2" / "dist").mkdir(parents=True)  # the save that fills the disk
    error = _fill(ckpts / "step_2" / "dist" / "__0_0.distcp")
    cfg = load_config([f"run.output_dir={small_disk / 'run'}"])
    raised = CheckpointException("save failed", {0: (error, None)})  # how dist_checkpointing.save raises it

    line = explain(raised, cfg)

    free = shutil.disk_usage(small_disk).free / MIB
    assert line == (f"disk full: no space left on device writing {ckpts / 'step_2'} ({free:.1f} MiB free there; "
                    f"a checkpoint of this run takes {(MIB + len(json.dumps({'step': 1}))) / MIB:.1f} MiB); the last "
                    f"complete checkpoint {ckpts / 'step_1'} is kept: free space (or move checkpoint_dir to a larger "
                    "disk) and continue with run.resume=true")


def test_a_torch_save_on_a_full_disk_is_disk_full_too(small_disk: Path) -> None:
    # torch.save's C++ writer (dist/common.pt, the first file of a checkpoint) says only "iostream error"
    import torch

    ckpts = small_disk / "checkpoints"
    (ckpts / "step_3" / "dist").mkdir(parents=True)
    _fill(small_disk / "filler")
    with pytest.raises(RuntimeError) as info:
        torch.save({"weights": torch.zeros(2**18)}, ckpts / "step_3" / "dist" / "common.pt")
    cfg = load_config([f"run.output_dir={small_disk}"])

    line = explain(info.value, cfg)

    assert line is not None and line.startswith(
        f"disk full: no space left on device writing {ckpts / 'step_3'} (0.0 MiB free there; the incomplete "
        "checkpoint reached "), line
    (small_disk / "filler").unlink()  # room again: the same failure is not called a full disk
    assert explain(info.value, cfg) is None


def test_disk_full_before_any_checkpoint_says_there_is_none(small_disk: Path) -> None:
    error = _fill(small_disk / "metrics.jsonl")
    cfg = load_config([f"run.output_dir={small_disk / 'run'}"])
    line = explain(RuntimeError("writing metrics failed"), cfg)
    assert line is None  # not a disk-full error
    line = explain(error, cfg)
    assert line is not None
    # a write error names no file: the line names the run directory
    assert line.startswith(f"disk full: no space left on device writing {small_disk / 'run'} (0.0 MiB free there; ")
    assert "no checkpoint of this run is complete yet" in line and "nothing to resume from" in line


def test_an_engine_killed_by_sigkill_names_the_engine_and_its_memory_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands for VLLM::EngineCore
    never = threading.Event()
    threading.Timer(0.5, os.kill, (engine.pid, signal.SIGKILL)).start()  # what the kernel's OOM killer does
    try:
        with pytest.raises(EngineProcessDiedError) as info:
            watched("generate", lambda: never.wait(30), name="engine of rank 0", engine_processes=[engine.pid],
                    timeout_s=30, in_process=False)
    finally:
        never.set()
        engine.kill()
        engine.wait()
    assert info.value.signals == {engine.pid: signal.SIGKILL}
    cfg = load_config(["rollout.cpu_kvcache_space_gib=3"])

    line = explain(RuntimeError("rollout worker failed"), cfg)
    assert line is None
    error = RuntimeError("the async rollout worker stopped")
    error.__cause__ = info.value  # found behind whatever wraps it
    assert explain(error, cfg) == (
        f"vLLM engine of rank 0: its engine process (pid {engine.pid}) was killed by SIGKILL during generate, most "
        "likely by the kernel's out-of-memory killer (`dmesg` names the pid); its memory setting is "
        "VLLM_CPU_KVCACHE_SPACE=3 GiB of KV cache (rollout.cpu_kvcache_space_gib; an exported "
        "VLLM_CPU_KVCACHE_SPACE wins) on top of the model's weights: lower it, run fewer engines per node, or give "
        "the job more memory")


def test_an_engine_reaped_by_vllm_before_the_watchdog_looks_still_says_sigkill() -> None:
    # vLLM's monitor thread waits on each engine core's sentinel and reads `proc.exitcode` at once, which reaps it:
    # the watchdog then finds no process, and only the multiprocessing handle knows it died of SIGKILL
    from multiprocessing import connection, get_context

    from nemo_rollout_correction.rollout import engine_processes

    engine = get_context("fork").Process(target=time.sleep, args=(60,), name="VLLM::EngineCore")
    engine.start()
    assert engine.pid is not None
    engine_processes._remember_handles([engine.pid])  # what start_llm does for the engines it started
    reaped = threading.Event()

    def vllm_monitor() -> None:
        connection.wait([engine.sentinel])
        engine.exitcode  # noqa: B018 (reaps it, as vLLM does)
        reaped.set()

    threading.Thread(target=vllm_monitor, daemon=True).start()
    never = threading.Event()
    threading.Timer(0.5, os.kill, (engine.pid, signal.SIGKILL)).start()

    def call() -> None:
        never.wait(30)

    try:
        with pytest.raises(EngineProcessDiedError) as info:
            watched("weight refit", call, name="engine of rank 0", engine_processes=[engine.pid], timeout_s=30,
                    in_process=False)
    finally:
        never.set()
        engine.kill()
        engine.join()
    assert reaped.wait(5) and engine.exitcode == -signal.SIGKILL
    assert info.value.signals == {engine.pid: signal.SIGKILL}
    assert f"(pid {engine.pid}) was killed by SIGKILL during weight refit" in (explain(info.value, load_config([]))
                                                                               or "")


def test_an_engine_that_exits_keeps_the_plain_message() -> None:
    died = EngineProcessDiedError("engine of rank 0", "generate", ["pid 7, exit code 1"], {})
    assert explain(died, load_config([])) is None
    assert str(died) == ("vLLM engine of rank 0: its engine process died during generate (pid 7, exit code 1); "
                         "the run cannot go on without it")


def test_a_refused_checkpoint_is_its_own_line_through_a_wrapping_error(tmp_path: Path) -> None:
    """The door's refusal names the file and the previous checkpoint; wrapped (a rank's failure) it still is the
    line, without the `(traceback in ...)` an unexpected failure gets."""
    from nemo_rollout_correction.trainer.checkpoint_door import CorruptCheckpointError

    meta = tmp_path / "step_2" / "meta.json"
    corrupt = CorruptCheckpointError(meta, json.JSONDecodeError("Expecting value", "", 0), tmp_path / "step_1")
    try:
        raise RuntimeError("rank 0 failed") from corrupt
    except RuntimeError as wrapped:
        line = explain(wrapped, load_config([]))
    assert line == (f"CorruptCheckpointError: {meta}: unreadable checkpoint file (JSONDecodeError: Expecting value: "
                    f"line 1 column 1 (char 0)); the previous complete checkpoint is {tmp_path / 'step_1'}")

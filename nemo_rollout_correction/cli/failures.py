"""The expected failures of `nrc train`, each said in one clear line (docs/troubleshooting.md, "Messages that stop
a run").

`explain(error, cfg)` walks the exception that ended the run (its causes and, for torch.distributed.checkpoint's
`CheckpointException`, every rank's failure) and returns the line of the first row that recognises it, or None
for an unexpected failure (which keeps its `Type: message` and the traceback in the log). One function per row:

- `disk_full`: no space left on the device (a checkpoint save, metrics): the path being written, the space free
  there against what a checkpoint of this run takes, and the last complete checkpoint, which is kept;
- `engine_killed`: a vLLM engine process killed by SIGKILL (the kernel's out-of-memory killer): the engine and
  its memory setting;
- `refused_checkpoint`: the checkpoint to resume from is unsafe (a file that would run code) or corrupt (truncated,
  unreadable, a damaged `meta.json`): the file and the previous complete checkpoint (the door's error says both);
- `port_in_use`: the process group's rendezvous port (`MASTER_PORT`) is taken;
- `missing_model`: `model.source` names a directory that does not exist, with the allowed choices.

The CLI prints the line instead of the Python error, and the MLflow run ends FAILED with it as `nrc.error`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.runtime import PortInUseError
from nemo_rollout_correction.models.sources import ModelSourceNotFoundError
from nemo_rollout_correction.rollout.errors import EngineProcessDiedError
from nemo_rollout_correction.trainer import checkpoint as ckpt
from nemo_rollout_correction.trainer.checkpoint_door import META_FILE, CorruptCheckpointError, UnsafeCheckpointError

_STEP_DIR = re.compile(r"^step_(\d+)$")
_MIB = 2**20
_ENOSPC_TEXT = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
_WRITER_FAILURES = ("basic_ios::clear: iostream error", "PytorchStreamWriter failed writing")
"""How torch.save's C++ writer says a write failed (a full disk among the causes; no errno)."""


def explain(error: BaseException, cfg: TrainConfig) -> str | None:
    """The one line that says what ended the run, when `error` is an expected failure (None otherwise)."""
    for row in ROWS:
        for cause in _chain(error):
            line = row(cause, cfg)
            if line is not None:
                return line
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, its causes and contexts, and the per-rank failures of a `CheckpointException` (each once)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback summary)}
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] for pair in failures.values()
                     if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException)]
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]


# ---- the rows ---------------------------------------------------------------------------------------------------


def disk_full(error: BaseException, cfg: TrainConfig) -> str | None:
    """No space left on device: the path being written (the incomplete checkpoint, else the file the error names,
    else the run directory), the space free there against the size of the last complete checkpoint, and that
    checkpoint, kept (the next save of the same step replaces the incomplete one).

    torch.save's C++ writer (`dist/common.pt`, the first file of a save) reports a full disk without errno
    (`basic_ios::clear: iostream error`): such a write failure counts as disk full when less than a checkpoint
    (at least 1 MiB) is free where it was writing."""
    # an OSError, or its text where a checkpoint writer re-raised it as another type
    enospc = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or _ENOSPC_TEXT in str(error)
    if not enospc and not (isinstance(error, RuntimeError) and any(t in str(error) for t in _WRITER_FAILURES)):
        return None
    ckpt_dir = Path(cfg.checkpoint_dir)
    last = ckpt.latest_checkpoint(ckpt_dir)
    writing = _incomplete_checkpoint(ckpt_dir, last)
    filename = getattr(error, "filename", None)
    path = writing or (Path(os.fsdecode(filename)) if filename else Path(cfg.run.output_dir))
    free = _free_bytes(path)
    size = None if last is None else ckpt.directory_size(last)
    if not enospc and free >= max(size or 0, _MIB):
        return None  # the writer failed with room to spare: not a full disk
    if size is None:
        needed = ("no checkpoint of this run is complete yet" if writing is None else
                  f"the incomplete checkpoint reached {ckpt.directory_size(writing) / _MIB:.1f} MiB before the "
                  "disk filled; no checkpoint of this run is complete yet")
        kept = "nothing to resume from: free space (or set checkpoint_dir to a larger disk) and start again"
    else:
        needed = f"a checkpoint of this run takes {size / _MIB:.1f} MiB"
        kept = (f"the last complete checkpoint {last} is kept: free space (or move checkpoint_dir to a larger "
                "disk) and continue with run.resume=true")
    return (f"disk full: no space left on device writing {path} ({free / _MIB:.1f} MiB free there; {needed}); "
            f"{kept}")


def engine_killed(error: BaseException, cfg: TrainConfig) -> str | None:
    """A vLLM engine process killed by SIGKILL (nothing else sends it to an engine here: the kernel's
    out-of-memory killer, or a person): the engine, the call it died in and its memory setting."""
    if not isinstance(error, EngineProcessDiedError):
        return None
    killed = [pid for pid, number in error.signals.items() if number == signal.SIGKILL]
    if not killed:
        return None
    if torch.cuda.is_available():
        setting = (f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization:g} (the host memory it "
                   "needs is the model's weights while loading)")
    else:
        kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.cpu_kvcache_space_gib))
        setting = (f"VLLM_CPU_KVCACHE_SPACE={kv} GiB of KV cache (rollout.cpu_kvcache_space_gib; an exported "
                   "VLLM_CPU_KVCACHE_SPACE wins) on top of the model's weights")
    pids = ", ".join(str(pid) for pid in killed)
    return (f"vLLM {error.engine}: its engine process (pid {pids}) was killed by SIGKILL during {error.what}, most "
            f"likely by the kernel's out-of-memory killer (`dmesg` names the pid); its memory setting is {setting}: "
            "lower it, run fewer engines per node, or give the job more memory")


def refused_checkpoint(error: BaseException, cfg: TrainConfig) -> str | None:
    """A checkpoint file refused by the door (trainer/checkpoint_door.py): its error names the file and the
    previous complete checkpoint; nothing of it was loaded."""
    if isinstance(error, (UnsafeCheckpointError, CorruptCheckpointError)):
        return f"{type(error).__name__}: {error}"
    return None


def port_in_use(error: BaseException, cfg: TrainConfig) -> str | None:
    """The rendezvous port (`MASTER_PORT`) is taken: the port and what to do (the error says both)."""
    return str(error) if isinstance(error, PortInUseError) else None


def missing_model(error: BaseException, cfg: TrainConfig) -> str | None:
    """`model.source` is a path that does not exist: the path and the allowed choices (the error says both)."""
    return str(error) if isinstance(error, ModelSourceNotFoundError) else None


ROWS: tuple[Callable[[BaseException, TrainConfig], str | None], ...] = (
    disk_full, engine_killed, refused_checkpoint, port_in_use, missing_model)


# ---- helpers ----------------------------------------------------------------------------------------------------


def _incomplete_checkpoint(ckpt_dir: Path, last: Path | None) -> Path | None:
    """The newest `step_<N>` directory without `meta.json` newer than the last complete one (the save that failed)."""
    if not ckpt_dir.is_dir():
        return None
    floor = -1 if last is None else int(last.name.split("_")[1])
    steps = [int(m.group(1)) for child in ckpt_dir.iterdir() if (m := _STEP_DIR.match(child.name))
             and not (child / META_FILE).exists()]
    steps = [step for step in steps if step > floor]
    return ckpt_dir / f"step_{max(steps)}" if steps else None


def _free_bytes(path: Path) -> int:
    """Bytes free on the filesystem holding `path` (its nearest existing ancestor)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


__all__ = ["ROWS", "disk_full", "engine_killed", "explain", "missing_model", "port_in_use", "refused_checkpoint"]

"""Checkpoints: model, optimizer, RNG, data position, step and observer state; exact resume.

Layout: `<dir>/step_<N>/rank_<r>.pt` per rank (its model shard, optimizer state and RNG states) plus
`meta.json` (step, sampler state, observer state such as the MLflow run id), written by the logging rank
LAST, after every rank has written its file: a step directory without `meta.json` is incomplete (a crash
while saving) and is ignored by `latest_checkpoint`. Each file is written to a temporary name and
renamed, so a crash never leaves a truncated file under the final name.

The optimizer state is `models.optimizer.PolicyOptimizer.state_dict()`: Megatron's optimizer state (fp32
main params of a bf16/fp16 model, Adam moments, the fp16 loss scaler; with the distributed optimizer this
rank's DP shard of them) and the LR scheduler. A resume therefore needs the same layout (TP/PP/CP/DP sizes
and `policy.use_distributed_optimizer`); resuming into another layout would go through Megatron's
`sharded_state_dict` / `dist_checkpointing` instead and is not implemented.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")


class Stateful(Protocol):
    """An object with `state_dict()` / `load_state_dict()` (a torch optimizer, `PolicyOptimizer`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states of this process."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_rank_state(ckpt_dir: Path, step: int, rank: int, model: torch.nn.Module, optimizer: Stateful) -> Path:
    """Write this rank's `rank_<r>.pt` for `step`; returns the step directory."""
    step_dir = Path(ckpt_dir) / f"step_{step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()},
                       step_dir / f"rank_{rank}.pt")
    return step_dir


def write_meta(step_dir: Path, meta: dict[str, Any]) -> None:
    """Mark the checkpoint complete (call after every rank's `save_rank_state` returned: a barrier)."""
    tmp = step_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, step_dir / "meta.json")


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps with a complete checkpoint under `ckpt_dir`, ascending."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "meta.json").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete step directory, or None."""
    steps = complete_steps(ckpt_dir)
    return Path(ckpt_dir) / f"step_{steps[-1]}" if steps else None


def load_meta(step_dir: Path) -> dict[str, Any]:
    """The `meta.json` of a complete checkpoint."""
    meta: dict[str, Any] = json.loads((Path(step_dir) / "meta.json").read_text())
    return meta


def load_rank_state(step_dir: Path, rank: int, model: torch.nn.Module, optimizer: Stateful) -> None:
    """Restore this rank's model shard, optimizer state and RNG states from `step_dir`."""
    path = Path(step_dir) / f"rank_{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was written by a job with a different world size "
                                f"or layout ({sorted(p.name for p in Path(step_dir).glob('rank_*.pt'))} present)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])


def prune(ckpt_dir: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (and incomplete older ones); returns removed steps."""
    steps = complete_steps(ckpt_dir)
    removed = steps[:-keep_last] if keep_last > 0 else []
    for step in removed:
        shutil.rmtree(Path(ckpt_dir) / f"step_{step}", ignore_errors=True)
    return removed


__all__ = [
    "Stateful",
    "complete_steps",
    "latest_checkpoint",
    "load_meta",
    "load_rank_state",
    "prune",
    "rng_state",
    "save_rank_state",
    "set_rng_state",
    "write_meta",
]

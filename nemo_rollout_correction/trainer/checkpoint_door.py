"""The one door to a checkpoint: `open_checkpoint` checks every file of it as data before anything reads it.

Every reader of a checkpoint goes through here: resume (`trainer.checkpoint.load_checkpoint`: model, optimizer,
scheduler, RNG and the layer-spec check), `nrc export` (`load_model_weights`) and the fleet's restore of the
in-flight async rollouts and partial rollouts. Each takes a `VerifiedCheckpoint`, which `open_checkpoint` makes
after checking, in this order, with no full unpickler run on any file:

- `dist/metadata.json` (Megatron's, JSON) names the `torch_dist` backend, the only one whose files are checked;
- `dist/.metadata` (torch.distributed.checkpoint's index, itself a pickle) through an allowlist unpickler: only
  the checkpoint's own record classes, `torch.Size`, dtypes and paths may appear in it;
- every shard holds the extent the index gives each item, and each byte item (torch reads those with
  `weights_only=False`) loads with `torch.load(weights_only=True)`;
- every `*.pt` file of the step directory (`dist/common.pt`, `rng/rank_<r>.pt`, `async_rollouts/rank_<r>.pt`,
  `partial_rollouts.pt`) loads with `torch.load(weights_only=True)`.

A file that would run code is refused with `UnsafeCheckpointError`, a truncated or unreadable one with
`CorruptCheckpointError`; both name the file and the previous complete checkpoint, on one line. Tensors are
read later by torch itself with `weights_only=True`, and `VerifiedCheckpoint.read` reads its data files the
same way.

This is the only module of the package that calls `torch.load`, `pickle.load(s)`, `dist_checkpointing.load*`
or a `FileSystemReader` (import-linter contract "Only the checkpoint door unpickles", ci/import_contracts.py).
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DIST_DIR = "dist"
RNG_DIR = "rng"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
"""Megatron's `dist/metadata.json` backends whose files this module checks (those `save_checkpoint` writes)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than data (a pickle that would import or call code)."""

    def __init__(self, path: Path, reason: str, previous: Path | None = None) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: refused to load: {reason}{_previous_text(previous)}")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated or unreadable; the message names it and the checkpoint to resume from."""

    def __init__(self, path: Path, error: BaseException, previous: Path | None = None) -> None:
        self.path = Path(path)
        self.error = error
        text = " ".join(str(error).split())[:500]
        super().__init__(f"{path}: unreadable checkpoint file ({type(error).__name__}: {text})"
                         f"{_previous_text(previous)}")


def _previous_text(previous: Path | None) -> str:
    return "" if previous is None else f"; the previous complete checkpoint is {previous}"


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps with a complete checkpoint (a `step_<N>/meta.json`) under `ckpt_dir`, ascending."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def previous_complete(step_dir: Path) -> Path | None:
    """The newest complete checkpoint before `step_dir` in its directory (for a refused checkpoint's message)."""
    match = _STEP_DIR.match(Path(step_dir).name)
    if match is None:
        return None
    earlier = [s for s in complete_steps(Path(step_dir).parent) if s < int(match.group(1))]
    return Path(step_dir).parent / f"step_{earlier[-1]}" if earlier else None


# ---- the door ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint step directory whose every file was checked as data (made by `open_checkpoint`)."""

    step_dir: Path
    meta: dict[str, Any]
    """Its `meta.json` ({} for a step directory without one, e.g. a save not yet marked complete)."""
    tensor_names: tuple[str, ...]
    """Global names of the tensors under `dist/`, from the checked index (Megatron's `load_tensors_metadata` keys)."""

    def read(self, path: Path | str) -> Any | None:
        """A data file of this checkpoint (a path inside it, or relative to it), None when it does not exist.

        Read with `torch.load(weights_only=True)`: tensors, numbers, strings, lists, tuples and dicts only.
        """
        path = Path(path) if Path(path).is_absolute() else self.step_dir / path
        if not path.resolve().is_relative_to(self.step_dir.resolve()):
            raise ValueError(f"{path} is not a file of the checkpoint {self.step_dir}")
        return load_data_file(path) if path.exists() else None

    def load_sharded(self, request: dict[str, Any]) -> dict[str, Any]:
        """`dist_checkpointing.load(request, <step_dir>/dist)`: the slices of `request`'s sharded tensors this rank
        asks for. A shard that cannot be read (torch's CheckpointException is a BaseException) becomes a
        `CorruptCheckpointError` naming the files and the previous complete checkpoint."""
        from megatron.core import dist_checkpointing

        try:
            loaded: dict[str, Any] = dist_checkpointing.load(request, str(self.step_dir / DIST_DIR))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            raise CorruptCheckpointError(self.step_dir / DIST_DIR, exc, previous_complete(self.step_dir)) from exc
        return loaded


def open_checkpoint(step_dir: Path) -> VerifiedCheckpoint:
    """Check every file of the checkpoint `step_dir` as data (module docstring); the only way to read one.

    Raises:
        UnsafeCheckpointError: a file would run code when loaded (named, with the previous complete checkpoint).
        CorruptCheckpointError: a file is truncated or unreadable (named, with the previous complete checkpoint).
        ValueError: a per-rank checkpoint of an earlier version.
        FileNotFoundError: no `dist/` directory (not a checkpoint).
    """
    step_dir = Path(step_dir)
    _check_format(step_dir)
    try:
        metadata = verify_checkpoint_files(step_dir)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(exc.path, exc.reason, previous_complete(step_dir)) from exc
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(exc.path, exc.error, previous_complete(step_dir)) from exc
    meta = read_meta(step_dir) if (step_dir / META_FILE).is_file() else {}
    return VerifiedCheckpoint(step_dir=step_dir, meta=meta, tensor_names=_tensor_names(metadata))


def read_meta(step_dir: Path) -> dict[str, Any]:
    """The checkpoint's `meta.json` (plain JSON, so read without the door's checks: the resume checks read it first).

    Raises `CorruptCheckpointError` naming the file and the previous complete checkpoint when it is missing,
    unreadable or not a JSON object, so a damaged one never surfaces as a JSON traceback.
    """
    path = Path(step_dir) / META_FILE
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptCheckpointError(path, exc, previous_complete(Path(step_dir))) from exc
    return meta


def _check_format(step_dir: Path) -> None:
    if not (step_dir / DIST_DIR).is_dir():
        old = sorted(p.name for p in step_dir.glob("rank_*.pt"))
        if old:
            raise ValueError(
                f"{step_dir} is a per-rank checkpoint ({', '.join(old)}) of an earlier nemo_rollout_correction "
                "version; this version reads only sharded checkpoints: start a fresh run (or resume it with the "
                "version that wrote it)")
        raise FileNotFoundError(f"{step_dir / DIST_DIR} is missing: not a complete checkpoint")


def _tensor_names(metadata: Any) -> tuple[str, ...]:
    from nemo_rollout_correction.distributed.dcp_metadata import is_bytes_item

    return tuple(name for name, entry in metadata.state_dict_metadata.items() if not is_bytes_item(entry))


# ---- the checks ----------------------------------------------------------------------------------------


def load_data_file(path: Path) -> Any:
    """`torch.load(path, weights_only=True)`: tensors, numbers, strings, lists, tuples and dicts only.

    Anything else (a pickle whose objects would run code when rebuilt) is refused WITHOUT running it, with an
    error naming the file; a truncated or unreadable file gets an error naming the file too.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(path, f"it is not plain data (torch.load weights_only=True: {_why(exc)}); "
                                          "checkpoint files are read as data only") from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise CorruptCheckpointError(path, exc) from exc


def _why(exc: BaseException) -> str:
    """The line of torch's weights-only refusal that names the offending global (its first lines are advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported global" in line or "GLOBAL" in line:
            return line.split(". Please use")[0]
    return lines[0] if lines else type(exc).__name__


def verify_checkpoint_files(step_dir: Path) -> Any:
    """Check every file of the checkpoint as data (module docstring) and return its checked `.metadata` index.

    Raises `UnsafeCheckpointError` (or `CorruptCheckpointError` for a file that cannot be read), naming the file.
    """
    dist_dir = Path(step_dir) / DIST_DIR
    _check_backends(dist_dir / "metadata.json")
    metadata = _read_dcp_metadata(dist_dir / ".metadata")
    _check_shards(dist_dir, metadata)
    for data_file in sorted(Path(step_dir).rglob("*.pt")):
        load_data_file(data_file)
    return metadata


def _check_backends(path: Path) -> None:
    """Megatron picks its readers from `dist/metadata.json`: only the torch_dist files are the ones checked here."""
    if not path.is_file():
        return  # Megatron then assumes its default (torch_dist)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(path, exc) from exc
    for key, expected in _BACKENDS.items():
        if not isinstance(config, dict) or config.get(key, expected) != expected:
            found = config.get(key) if isinstance(config, dict) else config
            raise UnsafeCheckpointError(path, f"{key} {found!r} is not {expected!r}, the only backend whose files "
                                              "are checked before loading")


def _check_shards(dist_dir: Path, metadata: Any) -> None:
    """Each item within its shard's size; each byte item (read by torch with weights_only=False) plain data."""
    from nemo_rollout_correction.distributed.dcp_metadata import is_bytes_item

    sizes: dict[str, int] = {}
    for index, info in getattr(metadata, "storage_data", {}).items():
        shard = dist_dir / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = shard.stat().st_size if shard.is_file() else -1
        if sizes[info.relative_path] < info.offset + info.length:  # a truncated or missing shard, named here
            found = "missing" if sizes[info.relative_path] < 0 else f"{sizes[info.relative_path]} bytes"
            raise CorruptCheckpointError(shard, EOFError(
                f"truncated: item {index.fqn} ends at byte {info.offset + info.length}, the file is {found}"))
        if not is_bytes_item(metadata.state_dict_metadata.get(index.fqn)):
            continue  # tensors: torch reads them with weights_only=True itself
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(shard, f"item {index.fqn} is stored transformed and cannot be checked")
        try:
            with shard.open("rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
        except OSError as exc:
            raise CorruptCheckpointError(shard, exc) from exc
        if len(data) != info.length:
            raise CorruptCheckpointError(shard, EOFError(f"item {index.fqn}: {len(data)} of {info.length} bytes"))
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(shard, f"item {index.fqn} is not plain data ({_why(exc)})") from exc
        except (RuntimeError, EOFError) as exc:
            raise CorruptCheckpointError(shard, exc) from exc


# torch.distributed.checkpoint's `.metadata` is a plain pickle (torch reads it with `pickle.load`). It may name only
# the checkpoint's own record classes (dataclasses and enums of torch.distributed.checkpoint.*), torch.Size, dtypes,
# the layout helper and paths (the checkpoint id); never a function, and no class of that package that does more
# than hold fields (a reader or writer).
_DCP_METADATA_FUNCTIONS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                           ("pathlib", "PurePosixPath")}


def _allowed_metadata_global(module: str, name: str) -> bool:
    if (module, name) in _DCP_METADATA_FUNCTIONS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module.startswith("torch.distributed.checkpoint."):
        import dataclasses
        import enum
        import importlib

        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    return False


def _read_dcp_metadata(path: Path) -> Any:
    """Unpickle torch.distributed.checkpoint's `.metadata`, refusing any global outside the allowlist."""

    class _DataOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _allowed_metadata_global(module, name):
                raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")
            return super().find_class(module, name)

    try:
        with path.open("rb") as handle:
            metadata = _DataOnly(handle).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(path, f"{exc} (a checkpoint is read as data only)") from exc
    except (EOFError, OSError, AttributeError, ValueError, TypeError) as exc:
        raise CorruptCheckpointError(path, exc) from exc
    if not hasattr(metadata, "state_dict_metadata"):
        raise CorruptCheckpointError(path, TypeError(f"not a checkpoint index: a {type(metadata).__name__}"))
    return metadata


__all__ = [
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "VerifiedCheckpoint",
    "complete_steps",
    "load_data_file",
    "open_checkpoint",
    "previous_complete",
    "read_meta",
    "verify_checkpoint_files",
]

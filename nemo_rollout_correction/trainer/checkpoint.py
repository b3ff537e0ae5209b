"""Checkpoints: sharded, layout-free model and optimizer state, RNG, data position, step, observer state.

Layout of one checkpoint, `<dir>/step_<N>/`:

- `dist/`: Megatron-Core `dist_checkpointing` (torch.distributed.checkpoint underneath): the model's
  `sharded_state_dict()` and, unless `checkpoint.save_optimizer=false`, the optimizer's
  (`get_megatron_optimizer`'s fp32 main params and Adam moments; the distributed optimizer in Megatron's
  `fully_reshardable` format) plus the LR scheduler state. Tensors are stored under global names
  and shapes, each shard written once (replicas across DP and the tied-embedding copy are skipped by
  their `replica_id`), and any layout reads it back: TP, PP, CP and DP sizes may differ between save and
  load (the reader asks for the slices its own shard needs).
- `rng/rank_<r>.pt`: each rank's Python, numpy and torch RNG states (tiny; restored per rank when the
  world size is unchanged, otherwise rank 0's states on every rank).
- `meta.json`: step, sampler state, observer state (the MLflow run id), the redacted config and the
  layout that wrote the checkpoint, written by the logging rank LAST, after a barrier that follows every
  rank's save: a step directory without `meta.json` is incomplete (a crash while saving) and is ignored
  by `latest_checkpoint`. `dist_checkpointing` writes its own `metadata.json` last as well; the RNG
  files and `meta.json` go to a temporary name first.

Why `dist_checkpointing` and not `torch.distributed.checkpoint` directly: Megatron's model and optimizer
already describe their shards (`sharded_state_dict`, TP/PP offsets, tied embeddings, the distributed
optimizer's DP shards); on gloo, saves and reloads at TP=2, PP=2 and DP=2 run in seconds. (FEASIBILITY
noted a first TP=2 probe that hung silently for 150 s; with the state dicts built inside `cuda_to_cpu()`,
as here, TP=2 saved in about 6 s in every try, and the first hang was not reproduced, so its cause is
unknown. Every collective here runs under the process group's timeout, and the tests under a launch
timeout.)

Asynchronous saves (`checkpoint.async_save`): Megatron's own path, `dist_checkpointing.save(...,
async_sharded_save=True)` scheduled on its `AsyncCallsQueue`. The queue forks a writer process right
after the state dict is built, so the writer sees the weights of that moment (copy-on-write) while
training goes on; `finalize_checkpoints` (collective, every step) completes the finished saves: Megatron's
metadata, then ours (`meta.json`, last). A save that dies in the background therefore leaves no
`meta.json` and is never resumed from. On CPU the queue's CUDA calls are satisfied by
`distributed.cpu_compat` (device "cpu", a no-op synchronize); on GPU the same path stages tensors to
host memory first (Megatron's code, not run here: unverified).

The per-rank `rank_<r>.pt` pickles of earlier versions are not read: `load_checkpoint` refuses them with
a message saying so.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nemo_rollout_correction.distributed.cpu_compat import cuda_to_cpu
from nemo_rollout_correction.distributed.runtime import barrier

FORMAT = "nrc-dist-checkpoint/1"
"""`meta.json["format"]` of this layout (sharded, layout-free)."""
DIST_DIR = "dist"
RNG_DIR = "rng"
META_FILE = "meta.json"
# The distributed optimizer's `fully_reshardable` format: on save its DP shards are gathered and stored per
# parameter, in the parameter's own shape and TP/PP sharding (like the regular optimizer's state), so TP, PP
# and DP may all change on load. (Megatron 0.16.1 rejects `fully_sharded_model_space`: "ShardedTensor.
# flattened_range is not supported"; `dp_reshardable` allows DP changes only.)
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ---- layout --------------------------------------------------------------------------------------------


def current_layout(*, use_distributed_optimizer: bool) -> dict[str, Any]:
    """TP/PP/CP/DP sizes and world size of this job (Megatron's `parallel_state`), recorded in `meta.json`."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "context_parallel_size": cp,
            "data_parallel_size": dp, "world_size": tp * pp * cp * dp,
            "use_distributed_optimizer": use_distributed_optimizer}


def describe_layout_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """`"TP 2 -> 1, DP 1 -> 2"` when the layouts differ, else None (for the resume log line)."""
    names = {"tensor_parallel_size": "TP", "pipeline_parallel_size": "PP", "context_parallel_size": "CP",
             "data_parallel_size": "DP", "use_distributed_optimizer": "distributed optimizer"}
    changes = [f"{short} {saved.get(key)} -> {current.get(key)}" for key, short in names.items()
               if saved.get(key) != current.get(key)]
    return ", ".join(changes) or None


# ---- RNG -----------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states of this process, as tensors, numbers and strings only.

    The form loads with `torch.load(weights_only=True)`: a checkpoint is data and never runs code when read
    (`random.getstate()` and `np.random.get_state()` themselves are tuples that need a full unpickler).
    """
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than data (a pickle that would import or call code)."""


def load_data_file(path: Path) -> Any:
    """`torch.load(path, weights_only=True)`: tensors, numbers, strings, lists, tuples and dicts only.

    Anything else (a pickle whose objects would run code when rebuilt) is refused WITHOUT running it, with an
    error naming the file; a truncated or unreadable file gets an error naming the file too.
    """
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(
            f"{path}: refused to load: it is not plain data (torch.load weights_only=True: {first}). Checkpoint "
            "files are read as data only; a file that needs arbitrary unpickling was not written by this version "
            "or was tampered with") from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise CorruptCheckpointError(path, exc) from exc


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated or unreadable; the message names it and the checkpoint to resume from."""

    def __init__(self, path: Path, error: BaseException, previous: Path | None = None) -> None:
        self.path = Path(path)
        text = " ".join(str(error).split())[:500]
        message = f"{path}: unreadable checkpoint file ({type(error).__name__}: {text})"
        if previous is not None:
            message += f"; the previous complete checkpoint is {previous}"
        super().__init__(message)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ---- sharded state dicts -------------------------------------------------------------------------------


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _model_sharded_state(chunks: list[nn.Module]) -> dict[str, Any]:
    """The model part: one chunk's `sharded_state_dict()`, or one per virtual-pipeline chunk (the tensor
    names inside are global, so the nesting does not tie the checkpoint to a layout)."""
    stages: list[Any] = list(chunks)  # Megatron modules (`sharded_state_dict` is not on nn.Module)
    if len(stages) == 1:
        state: dict[str, Any] = stages[0].sharded_state_dict()
        return state
    return {f"chunk{i}": stage.sharded_state_dict() for i, stage in enumerate(stages)}


def _load_model_state(chunks: list[nn.Module], loaded: dict[str, Any]) -> None:
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded)
        return
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"chunk{i}"])


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Allocate Adam state before a load if no update has run yet.

    Megatron's `DistributedOptimizer.sharded_state_dict(is_loading=True)` starts from `state_dict()`, which
    on torch's Adam (no Apex/Transformer Engine: the CPU case) reads the step out of the per-parameter state
    and asserts there is one; a freshly built optimizer has none. Megatron's own helper fills the state with
    a zero-gradient step; the values are overwritten by the load.
    """
    for opt in _inner_optimizers(optimizer):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and len(opt.optimizer.state) == 0:
            init()


def _optimizer_sharded_state(optimizer: Any, model_state: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    """The optimizer part of the checkpoint: Megatron's `sharded_state_dict`, except for the non-distributed
    bf16/fp16 optimizer (`Float16OptimizerWithFloat16Params`), built here (see `_float16_sharded_state`)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    inner = _inner_optimizers(optimizer)
    if len(inner) == 1 and isinstance(inner[0], Float16OptimizerWithFloat16Params):
        return _float16_sharded_state(inner[0], model_state, is_loading=is_loading)
    state: dict[str, Any] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                         metadata=_OPTIMIZER_METADATA)
    return state


def _float16_sharded_state(opt: Any, model_state: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    """`Float16OptimizerWithFloat16Params.sharded_state_dict` of Megatron 0.16.1, correct for models whose
    parameters are not all bf16/fp16.

    The policy's norm weights stay fp32 in a bf16 model (the torch norm fallback creates them in fp32), so a
    param group holds both fp32 copies of bf16 weights and fp32 weights. Megatron numbers the optimizer
    state by the bf16/fp16 parameters only and pairs the fp32 copies with the group's first ids: with mixed
    groups the names are wrong or missing ("Param id 10 does not match any model sharded param"). Here the
    ids follow the inner optimizer's own order (each fp32 copy mapped back to its model parameter); the
    output has Megatron's structure, so its `load_state_dict` reads it back.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        opt.init_state_fn(opt.optimizer, opt.config)
    state: dict[str, Any] = opt.state_dict()
    model_of = {id(main): model for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups,
                                                          strict=True)
                for model, main in zip(models, mains, strict=True)}
    ordered = [model_of.get(id(param), param) for group in opt.optimizer.param_groups for param in group["params"]]
    id_to_sharded = get_param_id_to_sharded_param_map(model_state, ordered)
    # Keyed by group index, not a list of lists: dist_checkpointing keeps an EMPTY group (the norm weights' group
    # holds no bf16 weight) in the common part and drops full ones, so a list would come back misaligned
    # ("Cannot merge two lists with different lengths"); `_load_optimizer_state` turns it back into a list.
    groups = [
        [make_sharded_optimizer_tensor(id_to_sharded[param_id], main, prefix="optimizer.state.fp32_param")
         for param_id, main in zip(
             [pid for pid, param in zip(saved_group["params"], group["params"], strict=True)
              if id(param) in model_of],
             mains, strict=True)]
        for mains, saved_group, group in zip(state["fp32_from_fp16_params"], state["optimizer"]["param_groups"],
                                             opt.optimizer.param_groups, strict=True)
    ]
    state["fp32_from_fp16_params"] = {f"group{i}": group for i, group in enumerate(groups)}
    step = opt._extract_common_per_param_step(state["optimizer"])
    optim_state_to_sharding_state(state["optimizer"], id_to_sharded, exclude_keys="step")
    if step:
        state["optimizer"]["state"]["common_step"] = step
    return state


@dataclass(frozen=True)
class LoadReport:
    """What `load_checkpoint` restored."""

    optimizer_loaded: bool
    """False for a weights-only checkpoint (`checkpoint.save_optimizer=false`): Adam restarts from zero moments."""
    rng_source_rank: int
    """The saved rank whose RNG states this rank took (its own rank when the world size is unchanged)."""


def save_checkpoint(step_dir: Path, model: nn.Module | Sequence[nn.Module], optim: Any | None, *,
                    rank: int, save_optimizer: bool = True, log: Callable[[str], None] = lambda message: None,
                    on_complete: Callable[[], None] | None = None, async_queue: Any | None = None) -> None:
    """Write this job's model state, optimizer state and RNG states to `step_dir`.

    Collective: every rank of the job calls it with its own model chunk(s) and its `PolicyOptimizer`
    (`models.optimizer`). `save_optimizer=False` (or `optim=None`) writes the weights only; the LR
    scheduler's position is saved whenever `optim` is given (a few numbers). `meta.json` is not written here:
    `on_complete` (called on every rank once every shard is on disk) is where the caller writes it (see
    `write_meta`). An existing `step_dir` (an incomplete save of the same step) is removed first so no stale
    shard of another layout survives.

    With `async_queue` (Megatron's `AsyncCallsQueue`, see `new_async_queue`) the shards are written by a
    background process and the call returns at once; `on_complete` then runs inside a later
    `finalize_checkpoints`.
    """
    from megatron.core import dist_checkpointing

    step_dir = Path(step_dir)
    if rank == 0:
        if step_dir.exists():
            shutil.rmtree(step_dir)
        (step_dir / DIST_DIR).mkdir(parents=True)
        (step_dir / RNG_DIR).mkdir()
    barrier()
    chunks = _chunks(model)
    with cuda_to_cpu():
        model_state = _model_sharded_state(chunks)
        state: dict[str, Any] = {"model": model_state}
        if optim is not None:
            state["scheduler"] = optim.scheduler.state_dict()
            if save_optimizer:
                state["optimizer"] = _optimizer_sharded_state(optim.optimizer, model_state, is_loading=False)
        request = dist_checkpointing.save(state, str(step_dir / DIST_DIR), async_sharded_save=async_queue is not None)
    _atomic_torch_save(rng_state(), step_dir / RNG_DIR / f"rank_{rank}.pt")
    barrier()

    def complete() -> None:
        log(f"[nrc train] checkpoint written to {step_dir} ({directory_size(step_dir) / 2**20:.1f} MiB)")
        if on_complete is not None:
            on_complete()

    if async_queue is None:
        complete()
        return
    request.add_finalize_fn(complete)
    with cuda_to_cpu():
        async_queue.schedule_async_request(request)  # forks the writer: it sees the weights of this moment
    log(f"[nrc train] checkpoint {step_dir.name}: writing in the background")


def new_async_queue() -> Any:
    """Megatron's `AsyncCallsQueue` for `save_checkpoint(async_queue=...)` (a fresh writer process per save)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue(persistent=False)


def finalize_checkpoints(async_queue: Any | None, *, blocking: bool = False) -> int:
    """Complete the background saves that have finished on every rank (all of them with `blocking`); returns
    how many are still running. Collective: every rank calls it at the same point (one small all-reduce)."""
    if async_queue is None:
        return 0
    with cuda_to_cpu():
        async_queue.maybe_finalize_async_calls(blocking=blocking)
    return int(async_queue.get_num_unfinalized_calls())


def _check_format(step_dir: Path) -> None:
    step_dir = Path(step_dir)
    if not (step_dir / DIST_DIR).is_dir():
        old = sorted(p.name for p in step_dir.glob("rank_*.pt"))
        if old:
            raise ValueError(
                f"{step_dir} is a per-rank checkpoint ({', '.join(old)}) of an earlier nemo_rollout_correction "
                f"version; this version reads only sharded checkpoints ({FORMAT}): start a fresh run (or "
                "resume it with the version that wrote it)")
        raise FileNotFoundError(f"{step_dir / DIST_DIR} is missing: not a complete checkpoint")


# torch.distributed.checkpoint's `.metadata` is a plain pickle (torch reads it with `pickle.load`), and its byte
# items are read with `torch.load(weights_only=False)` (DefaultLoadPlanner.load_bytes): both are checked here
# first, so that reading a checkpoint never runs code. The metadata may name only the checkpoint's own record
# classes (torch.distributed.checkpoint.*), torch.Size, dtypes, the layout helper and paths (the checkpoint id).
_DCP_METADATA_FUNCTIONS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                           ("pathlib", "PurePosixPath")}


def _allowed_metadata_global(module: str, name: str) -> bool:
    if (module, name) in _DCP_METADATA_FUNCTIONS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module.startswith("torch.distributed.checkpoint."):
        import importlib

        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
        return isinstance(obj, type)  # record classes and enums only, never a function
    return False


def _read_dcp_metadata(path: Path) -> Any:
    """Unpickle torch.distributed.checkpoint's `.metadata`, refusing any global outside the allowlist."""
    import pickle

    class _DataOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _allowed_metadata_global(module, name):
                raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")
            return super().find_class(module, name)

    try:
        with path.open("rb") as handle:
            return _DataOnly(handle).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path}: refused to load: {exc} (a checkpoint is read as data only)") from exc
    except (EOFError, OSError, AttributeError, ValueError) as exc:
        raise CorruptCheckpointError(path, exc) from exc


def verify_checkpoint_files(step_dir: Path) -> None:
    """Check that every file of the checkpoint is data before any of it is loaded (no code runs on load).

    `.metadata` through an allowlist unpickler; each byte item of the shards, `common.pt` and the RNG files with
    `torch.load(weights_only=True)`. Raises `UnsafeCheckpointError` (or `CorruptCheckpointError` for a file
    that cannot be read), naming the file.
    """
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    dist_dir = Path(step_dir) / DIST_DIR
    metadata = _read_dcp_metadata(dist_dir / ".metadata")
    sizes: dict[str, int] = {}
    for index, info in getattr(metadata, "storage_data", {}).items():
        shard = dist_dir / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = shard.stat().st_size if shard.is_file() else -1
        if sizes[info.relative_path] < info.offset + info.length:  # a truncated or missing shard, named here
            found = "missing" if sizes[info.relative_path] < 0 else f"{sizes[info.relative_path]} bytes"
            raise CorruptCheckpointError(shard, EOFError(
                f"truncated: item {index.fqn} ends at byte {info.offset + info.length}, the file is {found}"))
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue  # tensors: torch reads them with weights_only=True itself
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{shard}: item {index.fqn} is stored transformed and cannot be checked")
        try:
            with shard.open("rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
        except OSError as exc:
            raise CorruptCheckpointError(shard, exc) from exc
        if len(data) != info.length:
            raise CorruptCheckpointError(shard, EOFError(f"item {index.fqn}: {len(data)} of {info.length} bytes"))
        _load_data_bytes(shard, index.fqn, data, io.BytesIO)
    if (dist_dir / "common.pt").exists():
        load_data_file(dist_dir / "common.pt")
    for rng_file in sorted((Path(step_dir) / RNG_DIR).glob("*.pt")):
        load_data_file(rng_file)


def _load_data_bytes(shard: Path, item: str, data: bytes, buffer: Any) -> None:
    import pickle

    try:
        torch.load(buffer(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(f"{shard}: item {item} refused: not plain data ({first})") from exc
    except (RuntimeError, EOFError) as exc:
        raise CorruptCheckpointError(shard, exc) from exc


def _previous_complete(step_dir: Path) -> Path | None:
    """The newest complete checkpoint before `step_dir` in its directory (for a corrupt checkpoint's message)."""
    match = _STEP_DIR.match(Path(step_dir).name)
    if match is None:
        return None
    earlier = [s for s in complete_steps(Path(step_dir).parent) if s < int(match.group(1))]
    return Path(step_dir).parent / f"step_{earlier[-1]}" if earlier else None


def _dist_load(request: dict[str, Any], step_dir: Path) -> dict[str, Any]:
    """`dist_checkpointing.load` of `<step_dir>/dist` after `verify_checkpoint_files`; a shard that cannot be read
    (torch's CheckpointException is a BaseException) becomes a `CorruptCheckpointError` naming the files and the
    previous complete checkpoint."""
    from megatron.core import dist_checkpointing

    try:
        verify_checkpoint_files(step_dir)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(exc.path, exc.__cause__ or exc, _previous_complete(step_dir)) from exc
    try:
        loaded: dict[str, Any] = dist_checkpointing.load(request, str(Path(step_dir) / DIST_DIR))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise CorruptCheckpointError(Path(step_dir) / DIST_DIR, exc, _previous_complete(step_dir)) from exc
    return loaded


def load_checkpoint(step_dir: Path, model: nn.Module | Sequence[nn.Module], optim: Any, *, rank: int,
                    world_size: int) -> LoadReport:
    """Restore model, optimizer (when saved), LR schedule position and RNG states from `step_dir`.

    Collective: every rank calls it; the layout may differ from the one that saved. After the load the
    model's parameters, the optimizer's fp32 main params and Adam moments equal those saved, bit for bit.
    The LR scheduler resumes at the saved update count under the CURRENT schedule settings (so a run may be
    extended with a larger `run.num_steps`). A weights-only checkpoint restores the weights and the schedule
    position; the optimizer's main params are refreshed from the loaded weights and its moments start at 0.
    """

    step_dir = Path(step_dir)
    _check_format(step_dir)
    meta = load_meta(step_dir)
    has_optimizer = bool(meta.get("has_optimizer", True))
    chunks = _chunks(model)
    with cuda_to_cpu():
        model_state = _model_sharded_state(chunks)
        request: dict[str, Any] = {"model": model_state}
        if has_optimizer:
            _ensure_optimizer_state(optim.optimizer)
            request["optimizer"] = _optimizer_sharded_state(optim.optimizer, model_state, is_loading=True)
        loaded = _dist_load(request, step_dir)
        with torch.no_grad():  # in-place copies into leaf parameters
            _load_model_state(chunks, loaded["model"])
            if has_optimizer:
                _load_optimizer_state(optim.optimizer, loaded["optimizer"])
            else:
                optim.optimizer.reload_model_params()  # fp32 main params <- the loaded weights
    _restore_scheduler(optim, loaded.get("scheduler"))
    saved_world = int(meta.get("layout", {}).get("world_size", -1))
    source = rank if saved_world == world_size and (step_dir / RNG_DIR / f"rank_{rank}.pt").is_file() else 0
    set_rng_state(load_data_file(step_dir / RNG_DIR / f"rank_{source}.pt"))
    return LoadReport(optimizer_loaded=has_optimizer, rng_source_rank=source)


def _load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, around a Megatron 0.16.1 defect of the distributed optimizer.

    On torch's Adam (no Apex/Transformer Engine: the CPU case) each parameter's state holds a `step`
    tensor, and `load_parameter_state_from_fully_reshardable` copies EVERY state key from the checkpoint,
    which (rightly) stores no per-parameter step: a KeyError. The step lives in the param groups of the
    saved state; so the non-parameter part is loaded first (it sets the step), then the parameter state
    with the step entries set aside. Afterwards each parameter gets its own step tensor
    (`models.optimizer.untie_adam_steps`, another defect of the same load).
    """
    from nemo_rollout_correction.models.optimizer import untie_adam_steps

    inner = _inner_optimizers(optimizer)
    mains = state.get("fp32_from_fp16_params")
    if isinstance(mains, dict):  # `_float16_sharded_state`'s form -> Megatron's list of groups
        state = {**state, "fp32_from_fp16_params": [mains[f"group{i}"] for i in range(len(mains))]}
    param_state = state.get("param_state") if len(inner) == 1 else None
    if param_state is None or state.get("param_state_sharding_type") != "fully_reshardable":
        optimizer.load_state_dict(state)
    else:
        (opt,) = inner
        opt.load_state_dict({key: value for key, value in state.items()
                             if key not in ("param_state", "param_state_sharding_type")})
        adam_state = opt.optimizer.state
        steps = {param: entry.pop("step") for param, entry in adam_state.items() if "step" in entry}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():
                adam_state[param]["step"] = step
    untie_adam_steps(optimizer)


def _restore_scheduler(optim: Any, state: dict[str, Any] | None) -> None:
    """Megatron's scheduler asserts that its settings equal the checkpoint's unless told to override; the
    schedule settings come from the current config (compared with the saved one by `trainer.resume_check`,
    which lets only `run.num_steps` differ), the position (`num_steps`) from the checkpoint."""
    if state is None:
        return
    scheduler = optim.scheduler
    previous = scheduler.override_opt_param_scheduler
    scheduler.override_opt_param_scheduler = True
    try:
        scheduler.load_state_dict(state)
    finally:
        scheduler.override_opt_param_scheduler = previous


def load_model_weights(step_dir: Path, model_chunks: nn.Module | Sequence[nn.Module]) -> None:
    """Load a checkpoint's model weights into a policy built at ANY layout (the exporter's entry point).

    `step_dir` is a complete checkpoint directory (`<dir>/step_<N>`, see `latest_checkpoint`);
    `model_chunks` is this rank's Megatron model stage (a `GPTModel`, or a list of virtual-pipeline chunks)
    built for the current `megatron.core.parallel_state`, at any TP/PP/CP/DP sizes including a single
    process (initialise a one-rank gloo group and `parallel_state.initialize_model_parallel()` first).
    Collective over the job: every rank calls it with its own stage and reads only the slices it holds. The
    model's parameters afterwards equal the saved ones bit for bit (in the dtype they were saved in, cast
    to the model's dtype when they differ). Optimizer state, RNG and metadata are not touched.
    """

    step_dir = Path(step_dir)
    _check_format(step_dir)
    chunks = _chunks(model_chunks)
    with cuda_to_cpu():
        model_state = _model_sharded_state(chunks)
        loaded = _dist_load({"model": model_state}, step_dir)
        with torch.no_grad():
            _load_model_state(chunks, loaded["model"])


# ---- meta and the checkpoint directory -----------------------------------------------------------------


def write_meta(step_dir: Path, meta: dict[str, Any]) -> None:
    """Mark the checkpoint complete (call after every rank's `save_checkpoint` returned: a barrier).

    `format` is added; `layout` (from `current_layout`) and `has_optimizer` should be part of `meta`.
    """
    tmp = Path(step_dir) / (META_FILE + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **meta}, indent=2, sort_keys=True))
    os.replace(tmp, Path(step_dir) / META_FILE)


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps with a complete checkpoint under `ckpt_dir`, ascending."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete step directory, or None."""
    steps = complete_steps(ckpt_dir)
    return Path(ckpt_dir) / f"step_{steps[-1]}" if steps else None


def load_meta(step_dir: Path) -> dict[str, Any]:
    """The `meta.json` of a complete checkpoint."""
    meta: dict[str, Any] = json.loads((Path(step_dir) / META_FILE).read_text())
    return meta


def directory_size(path: Path) -> int:
    """Bytes of all files under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def prune(ckpt_dir: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints; returns the removed steps."""
    steps = complete_steps(ckpt_dir)
    removed = steps[:-keep_last] if keep_last > 0 else []
    for step in removed:
        shutil.rmtree(Path(ckpt_dir) / f"step_{step}", ignore_errors=True)
    return removed


__all__ = [
    "FORMAT",
    "CorruptCheckpointError",
    "LoadReport",
    "UnsafeCheckpointError",
    "complete_steps",
    "current_layout",
    "describe_layout_change",
    "directory_size",
    "finalize_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "load_data_file",
    "load_meta",
    "load_model_weights",
    "new_async_queue",
    "prune",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint_files",
    "write_meta",
]

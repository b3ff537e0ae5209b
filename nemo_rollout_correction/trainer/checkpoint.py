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

Reading goes through ONE door, `trainer.checkpoint_door.open_checkpoint`: it checks every file of the
checkpoint as data (torch.distributed.checkpoint's `.metadata` index, the shards' byte items, `common.pt`, the
RNG and rollout files) before anything, this module's layer-spec check included, reads one. `load_checkpoint`
and `load_model_weights` take its `VerifiedCheckpoint` (or open one themselves). The per-rank `rank_<r>.pt`
pickles of earlier versions are not read: the door refuses them with a message saying so.
"""

from __future__ import annotations

import json
import os
import random
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
from nemo_rollout_correction.models.lora import has_lora, is_adapter_param
from nemo_rollout_correction.trainer.checkpoint_door import (
    DIST_DIR,
    META_FILE,
    RNG_DIR,
    VerifiedCheckpoint,
    complete_steps,
    open_checkpoint,
    read_meta,
)

FORMAT = "nrc-dist-checkpoint/1"
"""`meta.json["format"]` of this layout (sharded, layout-free)."""
# The distributed optimizer's `fully_reshardable` format: on save its DP shards are gathered and stored per
# parameter, in the parameter's own shape and TP/PP sharding (like the regular optimizer's state), so TP, PP
# and DP may all change on load. (Megatron 0.16.1 rejects `fully_sharded_model_space`: "ShardedTensor.
# flattened_range is not supported"; `dp_reshardable` allows DP changes only.)
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


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
    if len(chunks) == 1:
        return _stage_sharded_state(chunks[0])
    return {f"chunk{i}": _stage_sharded_state(stage) for i, stage in enumerate(chunks)}


def _stage_sharded_state(stage: nn.Module) -> dict[str, Any]:
    """One stage's `sharded_state_dict()`; with LoRA adapters attached, the adapters' entries alone.

    A LoRA run's base weights are frozen and never differ from `model.source`, which the saved config names and
    `trainer.resume_check` requires unchanged: the trainer and `nrc export` rebuild the policy from it before a
    load. So the checkpoint holds the adapters (and, the optimizer's state being keyed by these entries, their
    fp32 main weights and Adam moments) and not a copy of the base model. Flat keys: `<module path>.lora.a|b`.
    """
    state: dict[str, Any] = stage.sharded_state_dict()  # type: ignore[operator]  # a Megatron module
    if not has_lora(stage):
        return state
    return {key: value for key, value in state.items() if is_adapter_param(key)}


def _load_model_state(chunks: list[nn.Module], loaded: dict[str, Any]) -> None:
    if len(chunks) == 1:
        _load_stage_state(chunks[0], loaded)
        return
    for i, chunk in enumerate(chunks):
        _load_stage_state(chunk, loaded[f"chunk{i}"])


def _load_stage_state(stage: nn.Module, state: dict[str, Any]) -> None:
    """`stage.load_state_dict(state)`; for a LoRA stage the adapters only (`_stage_sharded_state`): every adapter
    must be in `state` (ValueError naming the missing ones), the base weights stay as loaded from `model.source`."""
    if not has_lora(stage):
        stage.load_state_dict(state)
        return
    inner = stage
    while isinstance(getattr(inner, "module", None), nn.Module):  # DDP / Float16Module wrappers return nothing
        inner = inner.module  # type: ignore[assignment]
    result = inner.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if is_adapter_param(key)]
    if missing or result.unexpected_keys:
        raise ValueError(f"LoRA checkpoint does not match the policy's adapters: missing {missing[:4]} "
                         f"({len(missing)} in all), unexpected {list(result.unexpected_keys)[:4]}; the checkpoint "
                         "and the run must have the same policy.lora.rank and policy.lora.target_modules")


# Parameter names that only one of Megatron-Core's two layer specs has: Transformer Engine fuses the input
# and pre-MLP RMSNorm weights into the next linear layer; the local spec keeps separate norm modules.
_TE_SPEC_NAMES = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
_LOCAL_SPEC_NAMES = ("input_layernorm.weight",)


def layer_spec_of(names: Sequence[str]) -> str | None:
    """`"transformer_engine"` or `"local"`: the Megatron-Core layer spec whose parameter names these are (None
    when they say neither, e.g. a pipeline stage without transformer layers)."""
    if any(name.endswith(_TE_SPEC_NAMES) for name in names):
        return "transformer_engine"
    if any(name.endswith(_LOCAL_SPEC_NAMES) for name in names):
        return "local"
    return None


def _sharded_tensor_keys(state: Any) -> list[str]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(state, dict):
        return [key for value in state.values() for key in _sharded_tensor_keys(value)]
    if isinstance(state, (list, tuple)):
        return [key for value in state for key in _sharded_tensor_keys(value)]
    return [state.key] if isinstance(state, ShardedTensor) else []


def check_layer_spec(step_dir: Path, saved_names: Sequence[str], model_names: Sequence[str]) -> None:
    """Refuse a checkpoint written by a model of the other layer spec (ValueError naming both and what to do).

    A checkpoint saved on CPU (local spec: `input_layernorm.weight`) does not load into the Transformer Engine spec
    (`linear_qkv.layer_norm_weight`, TE's `_extra_state`) or back: `dist_checkpointing` would fail on the first
    missing name. No translation is done here: the optimizer state is keyed by the same names.
    """
    saved, wanted = layer_spec_of(saved_names), layer_spec_of(model_names)
    if saved is None or wanted is None or saved == wanted:
        return
    raise ValueError(
        f"checkpoint {step_dir} was written by a model built with Megatron-Core's {saved} layer spec, and this model "
        f"uses the {wanted} spec (models.hf_llama.choose_layer_spec: the Transformer Engine spec wherever CUDA and "
        "Transformer Engine import); their parameter names differ and this checkpoint cannot be loaded into it. "
        f"Resume on a machine that builds the {saved} spec, or export the checkpoint to Hugging Face "
        "(`nrc export`) and start a new run from the export (model.source=<export dir>).")


def _refuse_other_layer_spec(checkpoint: VerifiedCheckpoint, model_state: dict[str, Any]) -> None:
    check_layer_spec(checkpoint.step_dir, checkpoint.tensor_names, _sharded_tensor_keys(model_state))


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
        request = dist_checkpointing.save(state, str(step_dir / DIST_DIR), async_sharded_save=async_queue is not None,
                                          **_async_strategy(dist_checkpointing.save))
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


def _async_strategy(save: Callable[..., Any]) -> dict[str, Any]:
    """Megatron's own async writer (`async_strategy="mcore"`, the only one in 0.16): megatron-core 0.19 defaults to
    "nvrx", which needs `nvidia-resiliency-ext` (not a dependency of this package, absent from both images)."""
    import inspect

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}


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


def load_checkpoint(source: Path | VerifiedCheckpoint, model: nn.Module | Sequence[nn.Module], optim: Any, *,
                    rank: int, world_size: int) -> LoadReport:
    """Restore model, optimizer (when saved), LR schedule position and RNG states from a checkpoint.

    `source` is a checkpoint opened by `checkpoint_door.open_checkpoint` (every file checked as data), or its
    step directory (opened here). Collective: every rank calls it; the layout may differ from the one that
    saved. After the load the model's parameters, the optimizer's fp32 main params and Adam moments equal those
    saved, bit for bit. The LR scheduler resumes at the saved update count under the CURRENT schedule settings
    (so a run may be extended with a larger `run.num_steps`). A weights-only checkpoint restores the weights and
    the schedule position; the optimizer's main params are refreshed from the loaded weights and its moments
    start at 0.
    """

    checkpoint = _opened(source)
    has_optimizer = bool(checkpoint.meta.get("has_optimizer", True))
    chunks = _chunks(model)
    with cuda_to_cpu():
        model_state = _model_sharded_state(chunks)
        _refuse_other_layer_spec(checkpoint, model_state)
        request: dict[str, Any] = {"model": model_state}
        if has_optimizer:
            _ensure_optimizer_state(optim.optimizer)
            request["optimizer"] = _optimizer_sharded_state(optim.optimizer, model_state, is_loading=True)
        loaded = checkpoint.load_sharded(request)
        with torch.no_grad():  # in-place copies into leaf parameters
            _load_model_state(chunks, loaded["model"])
            if has_optimizer:
                _load_optimizer_state(optim.optimizer, loaded["optimizer"])
            else:
                optim.optimizer.reload_model_params()  # fp32 main params <- the loaded weights
    _restore_scheduler(optim, loaded.get("scheduler"))
    saved_world = int(checkpoint.meta.get("layout", {}).get("world_size", -1))
    own = f"{RNG_DIR}/rank_{rank}.pt"
    source_rank = rank if saved_world == world_size and (checkpoint.step_dir / own).is_file() else 0
    rng = checkpoint.read(f"{RNG_DIR}/rank_{source_rank}.pt")
    if rng is None:
        raise FileNotFoundError(f"{checkpoint.step_dir / RNG_DIR}/rank_{source_rank}.pt is missing: not a complete "
                                "checkpoint")
    set_rng_state(rng)
    return LoadReport(optimizer_loaded=has_optimizer, rng_source_rank=source_rank)


def _opened(source: Path | VerifiedCheckpoint) -> VerifiedCheckpoint:
    """`source` itself when it went through the door, else the door opened on it (a step directory)."""
    return source if isinstance(source, VerifiedCheckpoint) else open_checkpoint(Path(source))


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


def load_model_weights(source: Path | VerifiedCheckpoint, model_chunks: nn.Module | Sequence[nn.Module]) -> None:
    """Load a checkpoint's model weights into a policy built at ANY layout (the exporter's entry point).

    `source` is a checkpoint opened by `checkpoint_door.open_checkpoint`, or its step directory (`<dir>/step_<N>`,
    see `latest_checkpoint`; opened here, every file checked as data first);
    `model_chunks` is this rank's Megatron model stage (a `GPTModel`, or a list of virtual-pipeline chunks)
    built for the current `megatron.core.parallel_state`, at any TP/PP/CP/DP sizes including a single
    process (initialise a one-rank gloo group and `parallel_state.initialize_model_parallel()` first).
    Collective over the job: every rank calls it with its own stage and reads only the slices it holds. The
    model's parameters afterwards equal the saved ones bit for bit (in the dtype they were saved in, cast
    to the model's dtype when they differ). Optimizer state, RNG and metadata are not touched.
    """

    checkpoint = _opened(source)
    chunks = _chunks(model_chunks)
    with cuda_to_cpu():
        model_state = _model_sharded_state(chunks)
        _refuse_other_layer_spec(checkpoint, model_state)
        loaded = checkpoint.load_sharded({"model": model_state})
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


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete step directory, or None."""
    steps = complete_steps(ckpt_dir)
    return Path(ckpt_dir) / f"step_{steps[-1]}" if steps else None


def load_meta(step_dir: Path) -> dict[str, Any]:
    """The `meta.json` of a complete checkpoint (`checkpoint_door.read_meta`: a damaged one is a
    `CorruptCheckpointError` naming the file)."""
    return read_meta(step_dir)


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
    "LoadReport",
    "check_layer_spec",
    "current_layout",
    "describe_layout_change",
    "directory_size",
    "finalize_checkpoints",
    "latest_checkpoint",
    "layer_spec_of",
    "load_checkpoint",
    "load_meta",
    "load_model_weights",
    "new_async_queue",
    "prune",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "write_meta",
]

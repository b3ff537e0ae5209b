"""Gloo workers of `test_checkpoint`: save a sharded checkpoint at one layout, reload it at another.

`save_after_update` builds the tiny Llama policy with Megatron's optimizer at a layout (TP/PP sizes; DP is
what the world size leaves), runs one GRPO-style update (`optimizer_worker._Updater`) so weights, fp32
main params and Adam moments all differ from a fresh build, and writes `trainer.checkpoint` to a step
directory. `reload_and_resave` builds a fresh policy at another layout, loads that checkpoint, and writes
it again to a second directory: the test then compares the two checkpoints' global tensors (every weight,
main param, moment) read back in one process, which is layout-independent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optimizer_worker


def _init(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _meta(step_dir: Path, rank: int, distributed_optimizer: bool, has_optimizer: bool) -> None:
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    if rank == 0:
        ckpt.write_meta(step_dir, {"step": 1, "has_optimizer": has_optimizer,
                                   "layout": ckpt.current_layout(use_distributed_optimizer=distributed_optimizer)})


def save_after_update(rank: int, world_size: int, hf_dir: str, step_dir: str, tp: int, pp: int,
                      distributed_optimizer: bool, dtype: str = "bfloat16",
                      save_optimizer: bool = True) -> dict[str, Any]:
    """One update at (tp, pp, dp = world / tp / pp), then a checkpoint; returns this rank's loss and lr."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.runtime import barrier
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        _init(tp, pp)
        policy, optim = optimizer_worker._setup(hf_dir, dtype, use_distributed_optimizer=distributed_optimizer)
        updater = optimizer_worker._Updater(policy, optim)
        update = updater.update(updater.mini_batches[0])
        ckpt.save_checkpoint(Path(step_dir), policy.model, optim, rank=rank, save_optimizer=save_optimizer)
        _meta(Path(step_dir), rank, distributed_optimizer, save_optimizer)
        barrier()
        return {"update": update, "lr": optim.lr}
    finally:
        ps.destroy_model_parallel()


def save_async_then_update(rank: int, world_size: int, hf_dir: str, step_dir: str, tp: int, pp: int,
                           distributed_optimizer: bool, dtype: str = "bfloat16") -> dict[str, Any]:
    """`save_after_update`'s update, then an ASYNC save, then a second update while the writer runs; the save is
    finalized only after that. Returns whether `meta.json` existed before the finalize, and the pending counts."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.runtime import barrier
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        _init(tp, pp)
        policy, optim = optimizer_worker._setup(hf_dir, dtype, use_distributed_optimizer=distributed_optimizer)
        updater = optimizer_worker._Updater(policy, optim)
        update = updater.update(updater.mini_batches[0])
        queue = ckpt.new_async_queue()
        ckpt.save_checkpoint(Path(step_dir), policy.model, optim, rank=rank,
                             on_complete=lambda: _meta(Path(step_dir), rank, distributed_optimizer, True),
                             async_queue=queue)
        updater.update(updater.mini_batches[0])  # moves weights and moments in place while the writer runs
        meta_before = (Path(step_dir) / ckpt.META_FILE).exists()
        barrier()
        pending_before = queue.get_num_unfinalized_calls()
        pending_after = ckpt.finalize_checkpoints(queue, blocking=True)
        return {"update": update, "lr_after_second": optim.lr, "meta_before_finalize": meta_before,
                "pending_before": pending_before, "pending_after": pending_after,
                "meta_after_finalize": (Path(step_dir) / ckpt.META_FILE).exists()}
    finally:
        ps.destroy_model_parallel()


def reload_and_resave(rank: int, world_size: int, hf_dir: str, step_dir: str, out_dir: str, tp: int, pp: int,
                      distributed_optimizer: bool, dtype: str = "bfloat16") -> dict[str, Any]:
    """Fresh build at (tp, pp), load `step_dir`, save to `out_dir`; returns what the load reported."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.runtime import barrier
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        _init(tp, pp)
        policy, optim = optimizer_worker._setup(hf_dir, dtype, use_distributed_optimizer=distributed_optimizer)
        report = ckpt.load_checkpoint(Path(step_dir), policy.model, optim, rank=rank, world_size=world_size)
        ckpt.save_checkpoint(Path(out_dir), policy.model, optim, rank=rank, save_optimizer=report.optimizer_loaded)
        _meta(Path(out_dir), rank, distributed_optimizer, report.optimizer_loaded)
        barrier()
        return {"optimizer_loaded": report.optimizer_loaded, "lr": optim.lr,
                "scheduler_steps": optim.scheduler.num_steps}
    finally:
        ps.destroy_model_parallel()


def load_weights_only(rank: int, world_size: int, hf_dir: str, step_dir: str, tp: int, pp: int) -> dict[str, Any]:
    """`load_model_weights` into a bare fp32 policy at (tp, pp); returns its Hugging Face weights (TP gathered)."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        _init(tp, pp)
        policy = MegatronPolicy.from_hf(hf_dir, params_dtype="float32")
        ckpt.load_model_weights(Path(step_dir), policy.model)
        return {name: tensor.clone() for name, tensor in policy.hf_weights()}
    finally:
        ps.destroy_model_parallel()

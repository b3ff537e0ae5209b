"""Checkpoint size and save/load time of `trainer.checkpoint` for one model, at world size 1.

Builds the policy (`MegatronPolicy.from_hf`) with Megatron's optimizer in one gloo process, allocates the Adam
state with one zero-gradient update, then writes a full checkpoint and a weights-only one
(`checkpoint.save_optimizer=false`) and loads the full one back. Prints, side by side, the bytes on disk
and the seconds of each, and the bytes expected from the parameter count (weights in the model dtype; fp32
main weights for bf16/fp16; two fp32 Adam moments). Then a full checkpoint in the background
(`checkpoint.async_save`): the seconds the trainer is blocked by the save call against the seconds until the
writer finished, next to the synchronous save's.

    python benchmarks/bench_checkpoint.py                                  # tiny-llama, float32
    python benchmarks/bench_checkpoint.py --model smollm2-135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="model.source: tiny-llama, smollm2-135m or a path")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=300))
    patch_cuda_for_cpu()
    ps.initialize_model_parallel()
    hf_dir = resolve_model_source(args.model)
    policy = MegatronPolicy.from_hf(hf_dir, params_dtype=args.dtype)
    optim = build_policy_optimizer(policy.model, OptimizerSettings(
        lr=1e-5, use_distributed_optimizer=args.distributed_optimizer))
    optim.zero_grad()
    optim.step()  # zero gradients: allocates the Adam state (moments) without moving the weights much
    params = sum(p.numel() for p in policy.model.parameters())
    width = torch.finfo(getattr(torch, args.dtype)).bits // 8
    expected_weights = params * width
    expected_full = expected_weights + (params * 4 if width != 4 else 0) + 2 * params * 4

    rows = []
    with tempfile.TemporaryDirectory(prefix="nrc-bench-ckpt-") as tmp:
        # warm-up (imports, dist_checkpointing's first-call set-up), so no timed save pays for it
        ckpt.save_checkpoint(Path(tmp) / "warmup" / "step_1", policy.model, optim, rank=0, save_optimizer=False)
        for name, with_optimizer in (("full", True), ("weights-only", False)):
            step_dir = Path(tmp) / name / "step_1"
            start = time.perf_counter()
            ckpt.save_checkpoint(step_dir, policy.model, optim, rank=0, save_optimizer=with_optimizer)
            ckpt.write_meta(step_dir, {"step": 1, "has_optimizer": with_optimizer,
                                       "layout": ckpt.current_layout(use_distributed_optimizer=False)})
            seconds = time.perf_counter() - start
            rows.append((name, ckpt.directory_size(step_dir), seconds,
                         expected_full if with_optimizer else expected_weights))
        queue = ckpt.new_async_queue()
        start = time.perf_counter()
        ckpt.save_checkpoint(Path(tmp) / "async" / "step_1", policy.model, optim, rank=0, async_queue=queue)
        async_blocked = time.perf_counter() - start
        ckpt.finalize_checkpoints(queue, blocking=True)
        async_total = time.perf_counter() - start
        start = time.perf_counter()
        ckpt.load_checkpoint(Path(tmp) / "full" / "step_1", policy.model, optim, rank=0, world_size=1)
        load_seconds = time.perf_counter() - start

    print(f"model {args.model} ({params:,} parameters), dtype {args.dtype}, "
          f"distributed optimizer {args.distributed_optimizer}, world size 1")
    print(f"{'checkpoint':<14}{'on disk':>12}{'expected':>12}{'ratio':>8}{'save s':>9}")
    for name, size, seconds, expected in rows:
        print(f"{name:<14}{size / 1e6:>10.1f}MB{expected / 1e6:>10.1f}MB{size / expected:>8.3f}{seconds:>9.2f}")
    print(f"load of the full checkpoint: {load_seconds:.2f} s")
    sync_seconds = rows[0][2]
    print(f"background save of the full checkpoint: trainer blocked {async_blocked:.2f} s "
          f"({async_blocked / sync_seconds:.2f}x the synchronous save's {sync_seconds:.2f} s), "
          f"written after {async_total:.2f} s")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint bytes, full fine-tuning vs LoRA (adapter-only checkpoints, trainer/checkpoint.py).

In one gloo process: the policy of `--model` without and with LoRA (rank `--rank`, every decoder linear), each
with its Megatron optimizer (float32, regular optimizer) whose Adam moments are allocated as after an update, saved
with `trainer.checkpoint.save_checkpoint` (model + optimizer + RNG); prints the bytes on disk of each.

    python benchmarks/bench_lora_checkpoint.py                              # tiny-llama, rank 8
    python benchmarks/bench_lora_checkpoint.py --model smollm2-135m --rank 16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from nemo_rollout_correction.distributed.runtime import init_runtime
    from nemo_rollout_correction.models.lora import LoraConfig
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    init_runtime()  # a one-process gloo group and Megatron's parallel state at TP = 1
    hf_dir = str(resolve_model_source(args.model))
    sizes = {}
    for name, lora in (("full", None), (f"LoRA r={args.rank}", LoraConfig(rank=args.rank, alpha=2.0 * args.rank))):
        policy = MegatronPolicy.from_hf(hf_dir, lora=lora)
        optim = build_policy_optimizer(policy.model, OptimizerSettings(lr=1e-3, total_updates=4))
        adam = optim.optimizer.optimizer  # torch Adam under Megatron's FP32Optimizer; no state before an update
        for group in adam.param_groups:
            for p in group["params"]:
                adam.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        with tempfile.TemporaryDirectory() as tmp:
            step_dir = Path(tmp) / "step_1"
            ckpt.save_checkpoint(step_dir, policy.model, optim, rank=0)
            sizes[name] = ckpt.directory_size(step_dir)
    print(f"\n{args.model}: checkpoint bytes (model + optimizer + RNG)")
    for name, size in sizes.items():
        print(f"{name:12} {size:>15,}")
    full, lora_size = sizes.values()
    print(f"{'LoRA / full':12} {lora_size / full:>15.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    main()

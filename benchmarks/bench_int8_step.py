"""The whole GRPO step with int8 rollouts against bf16 ones (issue 37): `nrc train rollout.quantization=int8` vs
`rollout.quantization=none`, side by side in one invocation.

Runs the real `nrc train` (the embedded default config, i.e. SmolLM2-135M, unless overridden) once per setting
and round, the settings alternating (round 2 starts with the setting round 1 ended with) so a load change on the
shared machine hits both alike. Reads each run's `metrics.jsonl` and prints per-step medians over steps 2..N of
every round together (step 1 pays one-off warm-ups), and each int8 / bf16 ratio:

  step          wall time of the whole step
  generation    the engine generating the step's batch (+ reward scoring and broadcast)
  gen tok/s     generated tokens per second of generation (perf/generation_tokens_per_s)
  weight sync   the refit phase: gathering the weights and pushing them into the engine (for int8: the
                trainer's quantization, the workers' int8 load) and the refit verification
  engine load   the engine's own load seconds of that sync (rollout/engine0_refit_s)
  train         the optimizer updates
  tokens        generated tokens per step (the two engines sample different tokens: compare tokens/s)

    python benchmarks/bench_int8_step.py                          # 6 steps per run, 2 rounds
    python benchmarks/bench_int8_step.py --steps 4 --rounds 3 task.prompts_per_step=8

Load averages are printed after every run (the machine is shared: report them with the table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from nrc_job import run_nrc_train

SETTINGS = {"bf16": ["rollout.quantization=none"], "int8": ["rollout.quantization=int8"]}
ROWS = (("step", "timing/step_s", "s"), ("generation", "timing/generation_s", "s"),
        ("gen tok/s", "perf/generation_tokens_per_s", "tok/s"), ("weight sync", "timing/refit_s", "s"),
        ("engine load", "rollout/engine0_refit_s", "s"), ("train", "timing/train_s", "s"),
        ("tokens", "perf/num_generated_tokens", "per step"))


def run(setting: str, overrides: list[str], steps: int, out: Path) -> list[dict[str, float]]:
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", f"run.num_steps={steps}",
           f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", "export.at_end=false",
           *overrides, *SETTINGS[setting]]
    rows, _ = run_nrc_train(cmd, out, f"[bench_int8_step] {setting}")
    print(f"[bench_int8_step] {setting}: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
          file=sys.stderr, flush=True)
    return rows[1:]  # step 1: warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (step 1 is excluded)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides applied to both settings")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is warm-up)")
    measured: dict[str, list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
    order = list(SETTINGS)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_int8_step_") as tmp:
        for round_index in range(args.rounds):
            for setting in order:
                out = Path(tmp) / f"{setting}_{round_index}"
                measured[setting] += run(setting, args.overrides, args.steps, out)
            order.reverse()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    def med(setting: str, key: str) -> float:
        return statistics.median(row.get(key, float("nan")) for row in measured[setting])

    print(f"\nmedians per step over steps 2..{args.steps} of {args.rounds} runs each "
          f"({' '.join(args.overrides) or 'default config'})\n")
    print("| per step | bf16 | int8 | int8 / bf16 |")
    print("|---|--:|--:|--:|")
    for label, key, unit in ROWS:
        bf16, int8 = med("bf16", key), med("int8", key)
        print(f"| {label} ({unit}) | {bf16:.3f} | {int8:.3f} | {int8 / bf16:.2f}x |")


if __name__ == "__main__":
    main()

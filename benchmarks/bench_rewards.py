"""Reward scoring in the trainer process vs a pool of worker processes (`task.reward_workers`), side by side.

    python benchmarks/bench_rewards.py [--completions 64] [--workers 1,2,4] [--cost-ms 20] [--kind sleep|cpu]

The reward costs `--cost-ms` per completion: `sleep` (I/O-bound: a verifier call, a sandbox) or `cpu`
(busy Python). Prints one markdown table: wall time per batch for in-process scoring and for each pool
size, the ratio to in-process, and whether the rewards are identical (they must be). Pool start-up
(spawning and importing in each worker, once per run) is reported separately and excluded from the
per-batch times, as it is paid once per training run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.tasks.reward_pool import RewardPool
from nemo_rollout_correction.tasks.rewards import score


def main() -> int:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--cost-ms", type=float, default=20.0)
    parser.add_argument("--kind", choices=("sleep", "cpu"), default="sleep")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from bench_rewards_fn import cpu_reward, sleep_reward

    fn = sleep_reward if args.kind == "sleep" else cpu_reward
    records = [PromptRecord(f"prompt {i // 4}", metadata={"cost_ms": args.cost_ms, "i": i})
               for i in range(args.completions)]
    inputs = ([r.prompt for r in records], [f"completion {i}" for i in range(len(records))], records,
              [8] * len(records))

    def timed(scorer: object) -> tuple[float, list[float]]:
        times, out = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = score(scorer, *inputs)  # type: ignore[arg-type]
            times.append(time.perf_counter() - start)
        return statistics.median(times), out

    print(f"[bench_rewards] {args.completions} completions, {args.kind} reward of {args.cost_ms:g} ms each",
          file=sys.stderr)
    base, expected = timed(fn)
    rows = [f"| in process | - | {base:.3f} | 1.00x | yes |"]
    for workers in (int(w) for w in args.workers.split(",")):
        with RewardPool(fn, workers, timeout_s=60) as pool:
            start = time.perf_counter()
            pool.score(*inputs[:4])  # start the workers (once per run)
            startup = time.perf_counter() - start
            seconds, out = timed(pool)
        rows.append(f"| pool, {workers} workers | {startup:.1f} | {seconds:.3f} | {base / seconds:.2f}x | "
                    f"{'yes' if out == expected else 'NO'} |")
        print(f"[bench_rewards] {workers} workers done", file=sys.stderr)
    print("| scoring | start-up s (incl. first batch) | s per batch (median) | speed-up | rewards identical |")
    print("|---|--:|--:|--:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

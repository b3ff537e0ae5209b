"""The rollout engine alone: generation tokens/s, refit and refit-verification seconds, per engine setting.

Each setting runs in its own subprocess (one engine at a time on this 2-core machine), settings interleaved
over `--rounds` so a load change on the machine hits them all alike. Prints medians and ratios to the first
setting:

    python benchmarks/bench_engine.py                       # SmolLM2-135M, bf16, 4 prompts x 4 x 48 tokens
    python benchmarks/bench_engine.py --settings mp,inproc --rounds 3

Settings (`--settings`, comma list):
  mp       the engine as `nrc train` starts it (vLLM's engine core in its own process)
  inproc   the same engine in this process (`EngineOptions.in_process`: VLLM_ENABLE_V1_MULTIPROCESSING=0, as
           TRL's colocated mode runs it)
  noseed   like mp, but requests without a per-request seed (vLLM then samples the batch with one generator)
  inproc_threads  inproc, `generate` from the main thread against the same call from a new thread (prints both)
  reload   like mp, but the refit always takes vLLM's layer-wise `reload_weights` (`direct_refit=False`), the
           path before `rollout/direct_load.py`
  int8     like mp, with `rollout.quantization=int8` (W8A8 int8 engine; the refit re-quantizes the weights:
           `rollout/refit/int8.py`); `--settings mp,int8` puts int8 and bf16 side by side (docs/rollout.md)
The refit is split into the trainer's side (cast and copy into the shared buffer), the engine's side (RPC, the
workers' load, the prefix-cache reset) and the workers' own seconds (`VllmRolloutEngine.last_refit_phases`).

    python benchmarks/bench_engine.py --settings mp,reload --reps 0 --refits 5   # refit only
    python benchmarks/bench_engine.py --ab --reps 6     # our engine vs a plain in-process vllm.LLM, one process

`--ab` keeps our `VllmRolloutEngine` and a plain `vllm.LLM` (same `llm_kwargs`, engine core in this process as
TRL runs it) alive side by side and times each call variant (`AB_VARIANTS`) once per round, in a rotated order,
so the machine's load hits them alike. The `vllm*` settings time a plain `vllm.LLM` alone, one per subprocess.
On a shared machine with the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled = 1),
`nice` only ranks processes within their session: raise this benchmark's session instead
(`echo -20 > /proc/self/autogroup` in the shell that starts it) and report the load averages it prints.
Generation uses `ignore_eos` so every call makes exactly prompts x n x max_tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

QUESTIONS = ["What is 2 + 3?", "Name a color of the sky.", "Write one word that rhymes with cat.",
             "How many legs does a spider have?", "What is the capital of France?", "Say hello politely.",
             "What is 7 times 6?", "Give a synonym for quick."]
SETTINGS: dict[str, dict[str, str]] = {
    "mp": {},
    "inproc": {},
    "noseed": {},
    "reload": {},
    "int8": {},
    # plain `vllm.LLM(...).generate`, no VllmRolloutEngine: the engine's own speed with the same engine arguments
    "vllm": {},
    "vllm_inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "vllm_nologp": {},
    "vllm_trl": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "inproc_threads": {},
}
"""Environment per setting (on top of VLLM_CPU_KVCACHE_SPACE=1 and VLLM_CPU_NUM_OF_RESERVED_CPU=0)."""


def _plain_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """The `vllm*` settings: `vllm.LLM` built from the same `llm_kwargs` as our engine (our worker extension
    left out), generating with `LLM.generate` directly (no scheduler pause, no watchdog thread).

      vllm         our requests: prompts x n with a seed per request, one processed logprob per token
      vllm_inproc  the same, engine core in this process
      vllm_nologp  like vllm, without logprobs
      vllm_trl     as TRL's colocated GRPOTrainer asks: engine in process, prompts x n rows each with n=1, no
                   seed, one logprob per token
    """
    from vllm import LLM, SamplingParams

    from nemo_rollout_correction.rollout.engine_processes import llm_kwargs
    from nemo_rollout_correction.rollout.options import EngineOptions

    kwargs = llm_kwargs(EngineOptions(model_dir=args.model, dtype=args.dtype, max_model_len=512, seed=0), cuda=False)
    kwargs.pop("worker_extension_cls")
    began = time.perf_counter()
    llm = LLM(**kwargs)
    out: dict[str, Any] = {"setting": args.setting, "start_s": time.perf_counter() - began, "gen_tok_s": [],
                           "refit_s": [], "verify_s": [], "write_s": [], "load_s": [], "worker_s": [], "path": ""}
    trl = args.setting == "vllm_trl"
    logprobs = None if args.setting == "vllm_nologp" else 0

    def call(seed: int) -> float:
        if trl:
            rows = [{"prompt_token_ids": p} for p in prompts for _ in range(args.n)]
            params: Any = SamplingParams(n=1, max_tokens=args.max_tokens, temperature=1.0, logprobs=logprobs,
                                         ignore_eos=True)
        else:
            rows = [{"prompt_token_ids": p} for p in prompts]
            params = [SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, logprobs=logprobs,
                                     ignore_eos=True, seed=seed + i * args.n) for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = llm.generate(rows, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outputs for c in o.outputs) / seconds

    call(1)  # warm-up
    out["gen_tok_s"] = [call(100 + rep) for rep in range(args.reps)]
    return out


AB_VARIANTS = ("ours", "ours_llm_generate", "ours_nologp", "ours_trl_requests", "vllm_inproc",
               "vllm_inproc_trl_requests")
"""`--ab`: the calls timed against each other in one process, each round in a rotated order.

  ours                      `VllmRolloutEngine.generate` (engine core in its own process, the default)
  ours_llm_generate         the same engine's `LLM.generate` with the same requests: no scheduler pause, no
                            watchdog thread, no conversion to RolloutBatch
  ours_nologp               like ours_llm_generate, without logprobs
  ours_trl_requests         the same engine asked as TRL asks: prompts x n rows with n=1 each, no seed
  vllm_inproc               a plain `vllm.LLM` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, TRL's colocated
                            engine) with our requests
  vllm_inproc_trl_requests  that engine asked as TRL asks
"""


def _ab(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Our engine and a plain in-process `vllm.LLM` alive side by side; every variant once per round."""
    from vllm import LLM, SamplingParams

    from nemo_rollout_correction.rollout.engine_processes import llm_kwargs
    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    options = EngineOptions(model_dir=args.model, dtype=args.dtype, max_model_len=512, seed=0)
    ours = VllmRolloutEngine(options)
    kwargs = llm_kwargs(options, cuda=False)
    kwargs.pop("worker_extension_cls")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    plain = LLM(**kwargs)
    sampling = SamplingOptions(n=args.n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

    def requests(seed: int, trl: bool, logprobs: int | None = 0) -> tuple[list[Any], Any]:
        if trl:
            return ([{"prompt_token_ids": p} for p in prompts for _ in range(args.n)],
                    SamplingParams(n=1, max_tokens=args.max_tokens, temperature=1.0, logprobs=logprobs,
                                   ignore_eos=True))
        return ([{"prompt_token_ids": p} for p in prompts],
                [SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, logprobs=logprobs,
                                ignore_eos=True, seed=seed + i * args.n) for i in range(len(prompts))])

    def timed(llm: Any, rows: list[Any], params: Any) -> float:
        start = time.perf_counter()
        outputs = llm.generate(rows, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs) / (time.perf_counter() - start)

    def run(variant: str, seed: int) -> float:
        if variant == "ours":
            batch = ours.generate(prompts, sampling, seed=seed)
            return batch.num_generated_tokens / batch.seconds
        llm = plain if variant.startswith("vllm") else ours.llm
        return timed(llm, *requests(seed, trl=variant.endswith("trl_requests"),
                                    logprobs=None if variant.endswith("nologp") else 0))

    out: dict[str, Any] = {variant: [] for variant in AB_VARIANTS}
    for variant in AB_VARIANTS:  # warm-up
        run(variant, 1)
    for rep in range(args.reps):
        shift = rep % len(AB_VARIANTS)
        for variant in AB_VARIANTS[shift:] + AB_VARIANTS[:shift]:
            out[variant].append(run(variant, 100 + rep))
        print(f"[ab rep {rep + 1}] " + ", ".join(f"{v} {out[v][-1]:.0f}" for v in AB_VARIANTS) + f" | load "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr, flush=True)
    ours.shutdown()
    return out


def _inproc_threads(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """`inproc_threads`: an in-process engine's `generate` called from the main thread (it runs there) against
    the same call from a new thread each time (where torch's OpenMP kernels run slower)."""
    import threading

    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    engine = VllmRolloutEngine(EngineOptions(model_dir=args.model, dtype=args.dtype, max_model_len=512, seed=0,
                                             in_process=True))
    sampling = SamplingOptions(n=args.n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

    def main_thread(seed: int) -> float:
        batch = engine.generate(prompts, sampling, seed=seed)
        return batch.num_generated_tokens / batch.seconds

    def new_thread(seed: int) -> float:
        out: list[float] = []
        worker = threading.Thread(target=lambda: out.append(main_thread(seed)))
        worker.start()
        worker.join()
        return out[0]

    result: dict[str, Any] = {"setting": args.setting, "main_thread_tok_s": [], "new_thread_tok_s": [],
                              "refit_s": [], "verify_s": [], "write_s": [], "load_s": [], "worker_s": [], "path": ""}
    main_thread(1)
    new_thread(1)
    for rep in range(args.reps):
        result["main_thread_tok_s"].append(main_thread(100 + rep))
        result["new_thread_tok_s"].append(new_thread(100 + rep))
        print(f"[inproc_threads rep {rep + 1}] main thread {result['main_thread_tok_s'][-1]:.0f}, new thread "
              f"{result['new_thread_tok_s'][-1]:.0f} tok/s | load {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
              file=sys.stderr, flush=True)
    engine.shutdown()
    result["gen_tok_s"] = result["main_thread_tok_s"]
    return result


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True) for q in QUESTIONS[: args.prompts]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    if args.ab:
        return _ab(args, prompts)
    if args.setting == "inproc_threads":
        return _inproc_threads(args, prompts)
    if args.setting.startswith("vllm"):
        return _plain_vllm(args, prompts)
    extra: dict[str, Any] = ({"in_process": True} if args.setting == "inproc"
                             else {"direct_refit": False} if args.setting == "reload"
                             else {"quantization": "int8"} if args.setting == "int8" else {})
    engine = VllmRolloutEngine(EngineOptions(model_dir=args.model, dtype=args.dtype, max_model_len=512, seed=0,
                                             **extra))
    sampling = SamplingOptions(n=args.n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    seeded = args.setting != "noseed"
    out: dict[str, Any] = {"setting": args.setting, "start_s": engine.start_seconds, "gen_tok_s": [],
                           "refit_s": [], "verify_s": [], "write_s": [], "load_s": [], "worker_s": [], "path": ""}
    try:
        engine.generate(prompts, sampling, seed=1 if seeded else None)  # warm-up
        for rep in range(args.reps):
            batch = engine.generate(prompts, sampling, seed=100 + rep if seeded else None)
            out["gen_tok_s"].append(batch.num_generated_tokens / batch.seconds)
        if args.refits:
            state = {k: v.float() for k, v in load_file(os.path.join(args.model, "model.safetensors")).items()}
            gen = torch.Generator().manual_seed(0)
            for _ in range(args.refits + 1):  # the first creates the shared buffer: not counted
                for tensor in state.values():  # a small change everywhere, like an optimizer step
                    tensor.add_(torch.randn(tensor.shape, generator=gen) * 1e-4)
                engine.refit(state.items())
                out["refit_s"].append(engine.refit_seconds[-1])
                verify = getattr(engine, "verify_seconds", [])  # absent before issue 27 (--code-path of an old tree)
                out["verify_s"].append(verify[-1] if verify else float("nan"))
                phases = getattr(engine, "last_refit_phases", {})  # absent before the direct path
                for key in ("write", "load", "worker"):
                    out[f"{key}_s"].append(phases.get(key, float("nan")))
                report = getattr(engine, "last_refit_report", [])
                out["path"] = ",".join(str(r.get("path", "?")) for r in report)
            for key in ("refit_s", "verify_s", "write_s", "load_s", "worker_s"):
                out[key] = out[key][1:]
    finally:
        engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: the built SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--settings", default="mp,inproc")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--refits", type=int, default=5)
    parser.add_argument("--code-path", default=None,
                        help="run the engine code of another checkout (its PYTHONPATH), e.g. the tree before a change")
    parser.add_argument("--ab", action="store_true",
                        help="time our engine against a plain in-process vllm.LLM in one process (AB_VARIANTS)")
    parser.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from nemo_rollout_correction.models.sources import smollm2_135m_dir

        args.model = str(smollm2_135m_dir())
    if args.setting is not None or args.ab:  # the child (--ab runs in this process)
        if args.ab:
            args.setting = "ab"
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        result = _child(args)
        if not args.ab:
            print("RESULT " + json.dumps(result), flush=True)
            return
        base = statistics.median(result["vllm_inproc"])
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        print(f"| call | generation tok/s (median of {args.reps}) | vs vllm_inproc |")
        print("|---|--:|--:|")
        for variant in AB_VARIANTS:
            value = statistics.median(result[variant])
            print(f"| {variant} | {value:.1f} | {value / base:.2f}x |")
        return
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; allowed: {sorted(SETTINGS)}")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for round_index in range(args.rounds):
        for setting in settings:
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   **SETTINGS[setting], **({"PYTHONPATH": args.code_path} if args.code_path else {})}
            argv = [sys.executable, __file__, "--setting", setting, "--model", args.model, "--dtype", args.dtype,
                    "--prompts", str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
                    "--reps", str(args.reps), "--refits", str(args.refits)]
            began = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
                raise SystemExit(f"setting {setting} failed (exit {proc.returncode})")
            result = json.loads(lines[-1][len("RESULT "):])
            results[setting].append(result)
            gen = statistics.median(result["gen_tok_s"] or [float("nan")])
            if "new_thread_tok_s" in result:
                print(f"[round {round_index + 1}] {setting}: generate from the main thread {gen:.1f} tok/s, from a new "
                      f"thread {statistics.median(result['new_thread_tok_s']):.1f} tok/s (medians of {args.reps}; "
                      f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())})", file=sys.stderr, flush=True)
            def med1(key: str, r: dict[str, Any] = result) -> float:
                return statistics.median(r.get(key) or [float("nan")])

            print(f"[round {round_index + 1}] {setting}: gen {gen:.1f} tok/s, refit {med1('refit_s'):.3f} s "
                  f"(trainer side {med1('write_s'):.3f}, engine side {med1('load_s'):.3f}, in the worker "
                  f"{med1('worker_s'):.3f}; path {result.get('path', '?')}), verify {med1('verify_s') * 1e3:.1f} ms "
                  f"({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
    base = settings[0]

    def med(setting: str, key: str) -> float:
        values = [v for r in results[setting] for v in r[key]]
        return statistics.median(values) if values else float("nan")

    print(f"| setting | generation tok/s | vs {base} | refit s | refit - {base} s | trainer side s | engine side s | "
          f"in worker s | vs {base} (engine side) | verify ms |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for setting in settings:
        print(f"| {setting} | {med(setting, 'gen_tok_s'):.1f} | "
              f"{med(setting, 'gen_tok_s') / med(base, 'gen_tok_s'):.2f}x | {med(setting, 'refit_s'):.3f} | "
              f"{med(setting, 'refit_s') - med(base, 'refit_s'):+.3f} | "
              f"{med(setting, 'write_s'):.3f} | {med(setting, 'load_s'):.3f} | {med(setting, 'worker_s'):.3f} | "
              f"{med(setting, 'load_s') / med(base, 'load_s'):.2f}x | {med(setting, 'verify_s') * 1e3:.1f} |")
    # issue 37's budget for a quantized refit: at most the bf16 refit + 0.3 s, quantization (the trainer side) and
    # the refit verification included
    synced = {setting: med(setting, "refit_s") + med(setting, "verify_s") for setting in settings}
    for setting in settings[1:]:
        extra = synced[setting] - synced[base]
        print(f"refit + verify: {setting} {synced[setting]:.3f} s, {base} {synced[base]:.3f} s: {extra:+.3f} s, "
              f"ratio {synced[setting] / synced[base]:.2f}x ({'within' if extra <= 0.3 else 'over'} the +0.3 s "
              "budget of a quantized refit)")


if __name__ == "__main__":
    main()

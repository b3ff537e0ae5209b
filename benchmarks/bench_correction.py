"""Benchmark: our `compute_rollout_correction` vs verl 0.9.1's
`compute_rollout_correction_and_rejection_mask`, side by side in one run, on identical inputs.

CPU, one thread (`torch.set_num_threads(1)`), float32. For every size and setting it reports

* wall time (median of interleaved repeats after a warm-up) and throughput (tokens/s) of both,
  and the speed ratio verl_time / ours_time (target >= 5x);
* peak EXTRA memory of one call (peak resident memory during the call minus the resident
  memory just before it, inputs and warm state already in place; outputs count), measured in a
  fresh subprocess per (implementation, size, setting) -- see `memory_worker` -- and the ratio
  ours / verl (target <= 0.5);
* agreement of the two where the definitions coincide (keep mask, IS weights on tokens both
  keep, metrics with the same `rollout_corr/<name>`). Differences are printed, never hidden.

The markdown report goes to stdout and to benchmarks/results/<timestamp>.md.

    python benchmarks/bench_correction.py                       # all four sizes, all settings
    python benchmarks/bench_correction.py --sizes 64x2048,256x4096 --settings a,b
    python benchmarks/bench_correction.py --profile             # + cProfile/torch.profiler of ours

Run it inside .venv-bench (benchmarks/setup_bench_env.sh builds it).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as _dt
import gc
import io
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

DEFAULT_SIZES = "64x2048,256x4096,128x32768,256x32768"
SPEED_TARGET = 5.0  # verl_time / ours_time >= this
MEMORY_TARGET = 0.5  # ours_peak_extra / verl_peak_extra <= this
# glibc: every allocation >= 64 KiB is its own mmap, returned to the OS on free, so resident
# memory follows live tensor memory (no heap caching that hides or inflates a peak).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# `--timing-malloc heap`: glibc never mmaps and never trims, so freed tensor memory is reused
# without page faults (closer to a caching allocator, as on GPU). Timing only.
HEAP_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": "0"}


# ---- the settings compared ------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    key: str
    label: str
    ours_preset: str
    verl_kwargs: dict[str, Any]


SETTINGS: dict[str, Setting] = {
    "a": Setting(
        "a",
        "token TIS + geometric RS",
        "decoupled_geo_rs_token_tis",
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
             rollout_rs_threshold="0.999_1.001"),
    ),
    "b": Setting(
        "b",
        "sequence IS + sequence RS",
        "decoupled_seq_is_rs",
        dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
             rollout_rs_threshold="0.5_2.0"),
    ),
    "c": Setting("c", "metrics only", "disabled", dict(rollout_is=None, rollout_rs=None)),
}


# ---- inputs ---------------------------------------------------------------------------------


def parse_size(text: str) -> tuple[int, int]:
    batch, seq = text.lower().split("x")
    return int(batch), int(seq)


def make_inputs(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic (old_logprobs, rollout_logprobs, loss_mask[bool]), float32 `[batch, seq]`.

    rollout_logprobs = -Exponential(mean 1) (sampled-token logprobs: many near 0, a long tail);
    old_logprobs = rollout + N(0, 0.02) noise (bf16-vs-fp32 scale), 0.1% of tokens with N(0, 1)
    outliers, capped at 0 (a logprob). Response lengths are uniform in [seq/16, seq] per row,
    right-padded; padding holds 0.0 in both logprob tensors (as trainers pad).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 7919 + seq)
    rollout = torch.empty(batch, seq).exponential_(1.0, generator=gen).neg_()
    old = torch.randn(batch, seq, generator=gen).mul_(0.02)
    outliers = torch.rand(batch, seq, generator=gen) < 1e-3
    old[outliers] *= 50.0
    del outliers
    old.add_(rollout).clamp_(max=0.0)
    lengths = torch.randint(max(1, seq // 16), seq + 1, (batch, 1), generator=gen)
    mask = torch.arange(seq).unsqueeze(0) < lengths
    rollout.masked_fill_(~mask, 0.0)
    old.masked_fill_(~mask, 0.0)
    return old, rollout, mask


# ---- the two implementations, behind one call signature --------------------------------------


class Impl:
    """`prepare(old, rollout, mask_bool)` once (outside the timed region), then `__call__()`."""

    name = ""

    def prepare(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, setting: Setting) -> None:
        raise NotImplementedError

    def __call__(self) -> Any:
        raise NotImplementedError


class Ours(Impl):
    name = "ours"

    def __init__(self) -> None:
        from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

        self._cfg_cls = RolloutCorrectionConfig
        self._fn = compute_rollout_correction

    def prepare(self, old, rollout, mask, setting):  # type: ignore[no-untyped-def]
        self.args = (old, rollout, mask)  # our loss_mask is bool
        self.cfg = self._cfg_cls.from_preset(setting.ours_preset)

    def __call__(self):  # type: ignore[no-untyped-def]
        return self._fn(*self.args, self.cfg)


class Verl(Impl):
    name = "verl"

    def __init__(self, mask_dtype: torch.dtype = torch.float32) -> None:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        self._fn = compute_rollout_correction_and_rejection_mask
        self.mask_dtype = mask_dtype

    def prepare(self, old, rollout, mask, setting):  # type: ignore[no-untyped-def]
        # verl multiplies by response_mask: it takes a numeric 0/1 mask.
        self.args = (old, rollout, mask.to(self.mask_dtype))
        self.kwargs = dict(setting.verl_kwargs)

    def __call__(self):  # type: ignore[no-untyped-def]
        return self._fn(*self.args, **self.kwargs)


class Sanity(Impl):
    """Allocates, writes and frees `mb` MiB (peak extra must read ~mb), keeps nothing."""

    name = "sanity"

    def __init__(self, mb: int) -> None:
        self.mb = mb

    def prepare(self, old, rollout, mask, setting):  # type: ignore[no-untyped-def]
        pass

    def __call__(self):  # type: ignore[no-untyped-def]
        buf = torch.ones(self.mb * (1 << 20) // 4, dtype=torch.float32)
        total = float(buf[:: 1 << 14].sum())
        del buf
        return total


def make_impl(name: str, verl_mask_dtype: str) -> Impl:
    if name == "ours":
        return Ours()
    if name == "verl":
        return Verl(getattr(torch, verl_mask_dtype))
    if name.startswith("sanity"):
        return Sanity(int(name.removeprefix("sanity")))
    raise ValueError(name)


# ---- memory: one fresh subprocess per measurement --------------------------------------------


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak_rss() -> None:
    # Linux >= 4.0: writing 5 resets VmHWM (peak RSS) to the current RSS.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def memory_worker(impl_name: str, size: str, setting_key: str, seed: int, repeats: int,
                  verl_mask_dtype: str) -> dict[str, float]:
    """Peak extra resident memory (MiB) of one call, inputs already allocated.

    Runs in a fresh process started with MALLOC_MMAP_THRESHOLD_=65536. After one warm-up call
    (lazy library pages, first-use allocations) and gc, it resets VmHWM to the current VmRSS
    through /proc/self/clear_refs (that value is the baseline), calls once holding the result
    (outputs count: they are memory the call added), and reads VmHWM again. Repeated `repeats`
    times; the median is reported.
    """
    torch.set_num_threads(1)
    impl = make_impl(impl_name, verl_mask_dtype)
    batch, seq = parse_size(size)
    old, rollout, mask = make_inputs(batch, seq, seed)
    impl.prepare(old, rollout, mask, SETTINGS[setting_key])
    if not isinstance(impl, Sanity):
        del mask  # ours holds it through impl.args; verl holds its own numeric copy
    result = impl()
    del result
    peaks, retained = [], []
    for _ in range(repeats):
        gc.collect()
        for _attempt in range(10):
            _reset_peak_rss()
            base = _status_kb("VmHWM")  # = VmRSS at the reset
            if base - _status_kb("VmRSS") <= 256:
                break
        else:
            raise RuntimeError("could not reset VmHWM through /proc/self/clear_refs")
        result = impl()
        peak = _status_kb("VmHWM")
        after = _status_kb("VmRSS")
        del result
        peaks.append((peak - base) / 1024.0)
        retained.append((after - base) / 1024.0)
    return {"peak_extra_mb": statistics.median(peaks), "retained_mb": statistics.median(retained),
            "peak_extra_mb_all": peaks}


def measure_memory(impl_name: str, size: str, setting_key: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_memory-worker", impl_name, size, setting_key,
           "--seed", str(args.seed), "--memory-repeats", str(args.memory_repeats),
           "--verl-mask-dtype", args.verl_mask_dtype]
    # The timing process may run under other glibc malloc settings; the memory method needs exactly these.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(MALLOC_ENV, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker {impl_name} {size} {setting_key} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- timing: both implementations interleaved in this process --------------------------------


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def time_pair(ours: Impl, verl: Impl, repeats: int | None, budget_s: float) -> tuple[list[float], list[float]]:
    """Interleaved repeats (order alternates each round) after the caller's warm-up."""
    t_o, _ = _timed(ours)
    t_v, _ = _timed(verl)
    n = repeats or max(5, min(25, math.ceil(budget_s / max(t_o + t_v, 1e-9))))
    times_o, times_v = [], []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(n):
            pair = [(ours, times_o), (verl, times_v)]
            for impl, sink in pair if i % 2 == 0 else pair[::-1]:
                dt, out = _timed(impl)
                del out
                sink.append(dt)
    finally:
        if gc_was:
            gc.enable()
    return times_o, times_v


# ---- agreement --------------------------------------------------------------------------------

COINCIDING_METRICS = [
    "kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "training_log_ppl", "rollout_ppl",
    "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
]


def compare(ours_out: Any, verl_out: Any, mask: torch.Tensor) -> dict[str, Any]:
    verl_w_proto, verl_mask, verl_metrics = verl_out
    v_keep = verl_mask.bool() & mask
    o_keep = ours_out.keep_mask
    diff = o_keep ^ v_keep
    rows_o = (mask & ~o_keep).any(-1)  # sequences with a rejected token
    rows_v = (mask & ~v_keep).any(-1)
    res: dict[str, Any] = {
        "keep_tokens_ours": int(o_keep.sum()),
        "keep_tokens_verl": int(v_keep.sum()),
        "keep_token_diff": int(diff.sum()),
        "keep_seq_diff": int((rows_o ^ rows_v).sum()),
    }
    both = o_keep & v_keep
    if verl_w_proto is not None and bool(both.any()):
        v_w = verl_w_proto.batch["rollout_is_weights"]
        res["is_weight_maxabs"] = float((ours_out.is_weights[both] - v_w[both]).abs().max())
    else:
        res["is_weight_maxabs"] = None
    o_m = {k.removeprefix("rollout_corr/"): v for k, v in ours_out.metrics.items()}
    v_m = verl_k1_in_our_convention({k.removeprefix("rollout_corr/"): v for k, v in verl_metrics.items()})
    common = sorted(set(o_m) & set(v_m))
    rows = []
    for k in common:
        a, b = float(o_m[k]), float(v_m[k])
        ad = abs(a - b)
        rd = ad / max(abs(a), abs(b), 1e-30)
        rows.append((k, a, b, ad, rd))
    res["metrics"] = rows
    res["common_metrics"] = len(common)
    res["only_verl"] = sorted(set(v_m) - set(o_m))
    res["only_ours"] = sorted(set(o_m) - set(v_m))
    coincide = [r for r in rows if r[0] in COINCIDING_METRICS]
    res["coinciding_max_abs"] = max((r[3] for r in coincide), default=None)
    res["coinciding_max_rel"] = max((r[4] for r in coincide), default=None)
    res["metric_mismatches"] = [r for r in rows if r[4] > 1e-3 and r[3] > 1e-6]
    return res


def verl_k1_in_our_convention(metrics: dict[str, float]) -> dict[str, float]:
    """verl's k1 rejection metrics are statistics of -log(rho); ours describe log(rho), the quantity
    the ratio bounds apply to (docs/design.md decision 1). Convert verl's so both compare like for like:
    means change sign, max and min swap and change sign, high and low fractions swap. Spreads,
    deviations and masked fractions are unchanged."""
    out = dict(metrics)
    for key, value in metrics.items():
        if "_k1_" not in key:
            continue
        prefix, _, suffix = key.rpartition("_k1_")
        base = f"{prefix}_k1_"
        if suffix in ("mean", "seq_mean"):
            out[key] = -value
        elif suffix in ("max", "seq_max"):
            out[key] = -metrics[base + suffix.replace("max", "min")]
        elif suffix in ("min", "seq_min"):
            out[key] = -metrics[base + suffix.replace("min", "max")]
        elif suffix.endswith("fraction_high"):
            out[key] = metrics[base + suffix.replace("high", "low")]
        elif suffix.endswith("fraction_low"):
            out[key] = metrics[base + suffix.replace("low", "high")]
    return out


# ---- profile of ours ---------------------------------------------------------------------------


def profile_ours(size: str, setting: Setting, seed: int) -> str:
    batch, seq = parse_size(size)
    old, rollout, mask = make_inputs(batch, seq, seed)
    ours = Ours()
    ours.prepare(old, rollout, mask, setting)
    ours()
    out = io.StringIO()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        ours()
    prof.disable()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    text = [f"### cProfile, ours, {size}, setting {setting.key} ({setting.ours_preset}), 5 calls, by tottime",
            "```", _trim_pstats(out.getvalue()), "```"]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(5):
            ours()
    text += [f"### torch.profiler, ours, {size}, setting {setting.key}, 5 calls, by self CPU time", "```",
             tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), "```"]
    return "\n".join(text)


def _trim_pstats(text: str) -> str:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("ncalls"):
            return "\n".join(lines[i - 2 if i >= 2 else 0:]).replace(str(REPO) + "/", "")
    return text


# ---- report ------------------------------------------------------------------------------------


@dataclass
class Row:
    size: str
    setting: Setting
    ours_ms: float
    verl_ms: float
    repeats: int
    ours_ms_all: list[float] = field(default_factory=list)
    verl_ms_all: list[float] = field(default_factory=list)
    ours_mem: float | None = None
    verl_mem: float | None = None
    agreement: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        b, s = parse_size(self.size)
        return b * s

    @property
    def speed_ratio(self) -> float:
        return self.verl_ms / self.ours_ms

    @property
    def mem_ratio(self) -> float | None:
        if self.ours_mem is None or not self.verl_mem:
            return None
        return self.ours_mem / self.verl_mem


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def environment(args: argparse.Namespace) -> list[str]:
    import importlib.metadata as md

    def ver(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "absent"

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "nemo_rollout_correction"],
                               capture_output=True, text=True, check=False).stdout.strip()
        commit += " (nemo_rollout_correction/ has uncommitted changes)" if dirty else ""
    except OSError:
        commit = "?"
    return [
        f"- date: {_dt.datetime.now().isoformat(timespec='seconds')}",
        f"- repo commit: {commit}",
        f"- python {platform.python_version()}, torch {torch.__version__}, verl {ver('verl')}, "
        f"tensordict {ver('tensordict')}",
        f"- CPU: {cpu}, {os.cpu_count()} cores visible; torch threads: {torch.get_num_threads()} "
        f"(interop {torch.get_num_interop_threads()})",
        "- dtype float32; time = median wall time of interleaved repeats after one warm-up; "
        "throughput = batch*seq / time",
        f"- timing process malloc: {args.timing_malloc}"
        + (f" ({' '.join(f'{k}={v}' for k, v in HEAP_MALLOC_ENV.items())}: freed memory reused, no page faults)"
           if args.timing_malloc == "heap" else " (glibc defaults: tensors above the mmap threshold, at most "
           "32 MiB, are fresh mmaps page-faulted on every call)"),
        f"- verl response_mask dtype: {args.verl_mask_dtype}; ours loss_mask: bool",
        "- peak extra memory = VmHWM - VmRSS around one call in a fresh process "
        f"({' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}; VmHWM reset via /proc/self/clear_refs); "
        "outputs count",
    ]


def render(rows: list[Row], sanity: list[tuple[int, float]], args: argparse.Namespace, profile_md: str) -> str:
    out = ["# Rollout correction: ours vs verl 0.9.1 (CPU, 1 thread)", "", *environment(args), ""]
    if sanity:
        out += ["Memory method sanity check (a call that allocates, writes and frees k MiB): " +
                ", ".join(f"k={k} -> {m:.1f} MiB" for k, m in sanity), ""]
    out += ["| size (batch x seq) | setting | ours ms | verl ms | ours Mtok/s | verl Mtok/s | speed ratio "
            "verl/ours | ours peak extra MiB | verl peak extra MiB | mem ratio ours/verl | speed >= 5x | "
            "mem <= 0.5 |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|:-:|"]
    for r in rows:
        speed_ok = "PASS" if r.speed_ratio >= SPEED_TARGET else "FAIL"
        mr = r.mem_ratio
        mem_ok = "n/a" if mr is None else ("PASS" if mr <= MEMORY_TARGET else "FAIL")
        out.append(
            f"| {r.size} ({r.tokens / 1e6:.2f}M tok) | {r.setting.key}: {r.setting.label} | {r.ours_ms:.1f} | "
            f"{r.verl_ms:.1f} | {r.tokens / r.ours_ms / 1e3:.1f} | {r.tokens / r.verl_ms / 1e3:.1f} | "
            f"{r.speed_ratio:.2f}x | {_fmt(r.ours_mem, '.1f')} | {_fmt(r.verl_mem, '.1f')} | {_fmt(mr, '.3f')} | "
            f"{speed_ok} | {mem_ok} |"
        )
    out += ["", "Timing spread (ms, min / median / max over the interleaved repeats):", "",
            "| size | setting | repeats | ours | verl |", "|---|---|---:|---|---|"]
    out += [f"| {r.size} | {r.setting.key} | {r.repeats} | {min(r.ours_ms_all):.1f} / {r.ours_ms:.1f} / "
            f"{max(r.ours_ms_all):.1f} | {min(r.verl_ms_all):.1f} / {r.verl_ms:.1f} / {max(r.verl_ms_all):.1f} |"
            for r in rows]
    out += ["", "Settings: " + "; ".join(
        f"**{s.key}** ours preset `{s.ours_preset}` vs verl `{s.verl_kwargs}`" for s in SETTINGS.values()
        if s.key in args.settings.split(",")), ""]

    out += ["## Agreement (where the definitions coincide)", "",
            "keep mask: tokens where ours and verl differ (and sequences whose rejected/kept status differs); "
            "IS weights: max |ours - verl| on tokens both keep; metrics: max abs/rel diff over the off-policy "
            f"diagnostics both define ({', '.join(COINCIDING_METRICS)}); mismatches: any common "
            "`rollout_corr/<name>` with rel diff > 1e-3 and abs diff > 1e-6. verl's k1 rejection metrics "
            "describe -log(rho) and ours log(rho) (docs/design.md decision 1); verl's are converted to our "
            "convention before comparing (means negated, max/min and high/low swapped).", "",
            "| size | setting | kept tokens ours / verl | keep-mask token diff | seq diff | IS weight max abs diff "
            "| coinciding metrics max abs / rel diff | common metric names | mismatching common metrics |",
            "|---|---|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        a = r.agreement
        mism = ", ".join(f"{k} ({x:.6g} vs {y:.6g})" for k, x, y, _, _ in a["metric_mismatches"]) or "none"
        out.append(
            f"| {r.size} | {r.setting.key} | {a['keep_tokens_ours']} / {a['keep_tokens_verl']} | "
            f"{a['keep_token_diff']} | {a['keep_seq_diff']} | {_fmt(a['is_weight_maxabs'], '.3g')} | "
            f"{_fmt(a['coinciding_max_abs'], '.3g')} / {_fmt(a['coinciding_max_rel'], '.3g')} | "
            f"{a['common_metrics']} | {mism} |"
        )
    detail = [r for r in rows if r.size == args.detail_size] or rows[:len(args.settings.split(","))]
    for r in detail:
        a = r.agreement
        out += ["", f"### Common metrics, {r.size}, setting {r.setting.key} ({r.setting.label})", "",
                "| metric | ours | verl | abs diff | rel diff |", "|---|---:|---:|---:|---:|"]
        out += [f"| {k} | {x:.9g} | {y:.9g} | {ad:.3g} | {rd:.3g} |" for k, x, y, ad, rd in a["metrics"]]
        out += ["", f"verl-only names: {', '.join(a['only_verl']) or 'none'}", "",
                f"ours-only names: {', '.join(a['only_ours']) or 'none'}"]
    if profile_md:
        out += ["", "## Profile of ours", "", profile_md]
    return "\n".join(out) + "\n"


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of BATCHxSEQ (default {DEFAULT_SIZES})")
    p.add_argument("--settings", default="a,b,c", help="comma list of a,b,c (default all)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per implementation (default: 5..25, about --time-budget seconds)")
    p.add_argument("--time-budget", type=float, default=12.0, help="seconds of timed calls per size/setting")
    p.add_argument("--memory-repeats", type=int, default=3, help="measured calls per memory subprocess")
    p.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    p.add_argument("--verl-mask-dtype", default="float32", choices=["float32", "int64", "bool"],
                   help="dtype of verl's response_mask (float32 default; verl's trainer passes the "
                        "attention-mask slice, often int64)")
    p.add_argument("--timing-malloc", default="default", choices=["default", "heap"],
                   help="glibc malloc for the timing process: 'default' (large tensors are fresh mmaps, "
                        "page-faulted on every call) or 'heap' (no mmap, no trim: freed memory is reused, "
                        "like a caching allocator); memory is always measured with its own settings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="always append a profile of ours (otherwise only when a speed target fails)")
    p.add_argument("--profile-size", default="256x4096")
    p.add_argument("--detail-size", default="256x4096", help="size whose per-metric comparison is printed")
    p.add_argument("--results-dir", default=str(HERE / "results"))
    p.add_argument("--_memory-worker", nargs=3, metavar=("IMPL", "SIZE", "SETTING"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if not args._memory_worker and args.timing_malloc == "heap" and any(
            os.environ.get(k) != v for k, v in HEAP_MALLOC_ENV.items()):
        # glibc reads these at process start: re-run this script under them.
        argv_now = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv_now],
                  {**os.environ, **HEAP_MALLOC_ENV})

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)

    if args._memory_worker:
        impl_name, size, setting_key = args._memory_worker
        print(json.dumps(memory_worker(impl_name, size, setting_key, args.seed, args.memory_repeats,
                                       args.verl_mask_dtype)))
        return 0

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    settings = [SETTINGS[k.strip()] for k in args.settings.split(",") if k.strip()]
    ours = Ours()
    verl = Verl(getattr(torch, args.verl_mask_dtype))

    sanity: list[tuple[int, float]] = []
    if not args.no_memory:
        for k in (16, 256):
            m = measure_memory(f"sanity{k}", "1x1", "c", args)["peak_extra_mb"]
            sanity.append((k, m))
            print(f"[memory sanity] allocate {k} MiB -> measured peak extra {m:.2f} MiB", file=sys.stderr)
            if abs(m - k) > max(1.0, 0.05 * k):
                raise SystemExit(f"memory method failed its sanity check: {k} MiB measured as {m:.2f} MiB")

    rows: list[Row] = []
    for size in sizes:
        batch, seq = parse_size(size)
        old, rollout, mask = make_inputs(batch, seq, args.seed)
        for st in settings:
            ours.prepare(old, rollout, mask, st)
            verl.prepare(old, rollout, mask, st)
            o_out, v_out = ours(), verl()  # warm-up, and the outputs to compare
            agreement = compare(o_out, v_out, mask)
            del o_out, v_out
            gc.collect()
            t_o, t_v = time_pair(ours, verl, args.repeats, args.time_budget)
            row = Row(size, st, 1e3 * statistics.median(t_o), 1e3 * statistics.median(t_v), len(t_o),
                      ours_ms_all=[1e3 * t for t in t_o], verl_ms_all=[1e3 * t for t in t_v],
                      agreement=agreement)
            print(f"[time] {size} {st.key}: ours {row.ours_ms:.1f} ms, verl {row.verl_ms:.1f} ms "
                  f"({row.speed_ratio:.2f}x, {len(t_o)} repeats)", file=sys.stderr)
            rows.append(row)
        verl.args = ours.args = ()  # drop references before freeing the inputs
        del old, rollout, mask
        gc.collect()
        if not args.no_memory:
            for row in (r for r in rows if r.size == size):
                row.ours_mem = measure_memory("ours", size, row.setting.key, args)["peak_extra_mb"]
                row.verl_mem = measure_memory("verl", size, row.setting.key, args)["peak_extra_mb"]
                print(f"[memory] {size} {row.setting.key}: ours {row.ours_mem:.1f} MiB, "
                      f"verl {row.verl_mem:.1f} MiB", file=sys.stderr)

    profile_md = ""
    slow = [r for r in rows if r.speed_ratio < SPEED_TARGET]
    if args.profile or slow:
        pst = slow[0].setting if slow else settings[0]
        for r in slow:
            if r.size == args.profile_size:
                pst = r.setting
                break
        profile_md = profile_ours(args.profile_size, pst, args.seed)

    report = render(rows, sanity, args, profile_md)
    print(report)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.md"
    path.write_text(report)
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Collectives, bytes and time of the distributed rollout correction on 8 gloo processes.

Layout TP2 x CP2 x DP2 (`build_parallel_groups`, Megatron's rank order: TP fastest, then CP, then
DP). Each DP rank corrects `--microbatches` microbatches of `batch x seq` per step; every rank holds
its load-balanced CP shard (`batch x seq/2`). Two approaches, same inputs:

- **ours**: `distributed_rollout_correction` per microbatch (one all-gather of the `[k, batch]`
  float64 per-sequence partials over CP) and one `reduce_step` per step (one fused all-reduce over
  DP x CP: metrics, loss denominators, checks).
- **gather-full**: what NeMo-RL (`allgather_cp_sharded_tensor` in `nemo_rl/distributed/model_utils.py`:
  `torch.distributed.all_gather(tensor_list, tensor, group=cp_group)`, then the load-balanced chunks
  are put back in order) and verl's CP path do: all-gather old_logprobs, rollout_logprobs and
  loss_mask over CP (one `all_gather` each, as that function does per tensor), rebuild full
  sequences on every CP rank, run `core.compute_rollout_correction` on them, then reduce over DP:
  - `gather-full/allreduce`: one scalar all-reduce per metric per microbatch over DP (Megatron's
    `average_losses_across_data_parallel_group` pattern applied to each logged value);
  - `gather-full/object`: one `all_gather_object` of the rank's per-microbatch metric dicts over DP
    per step (verl `allgather_dict_into_dict`; NeMo-RL and verl's single controller collect the same
    per-rank lists through Ray instead of a torch collective);
  both plus one 2-element all-reduce per step for the global loss denominators (kept tokens and
  sequences; NeMo-RL all-reduces `global_valid_toks` / `global_valid_seqs` over DP).

Counts and bytes are exact: every torch.distributed collective is wrapped in each worker; bytes are
the payload one rank contributes to the collective (the input tensor; the pickled object for
`all_gather_object`), not the ring traffic. Times are measured between barriers, per step, max over
the 8 ranks, median over `--repeats` steps; "collective ms" is the time spent inside the wrapped
collectives (it includes waiting for the slowest peer).

    /work/venv/bin/python benchmarks/bench_distributed.py [--shapes 8x4096,8x16384] [--repeats 15]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import os
import pickle
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Same inputs as the single-process benchmark (this directory is on sys.path when run as a script).
from bench_correction import make_inputs
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.distributed.context_parallel import shard_sequence, unshard_sequence
from nemo_rollout_correction.distributed.correction import distributed_rollout_correction, reduce_step
from nemo_rollout_correction.distributed.groups import ParallelGroups, build_parallel_groups

TP, CP, DP = 2, 2, 2
WORLD = TP * CP * DP
PRESETS = ("decoupled_seq_is_rs", "decoupled_geo_rs_token_tis", "decoupled_token_is")
APPROACHES = ("ours", "gather-full/allreduce", "gather-full/object")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
                "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter",
                "all_to_all", "all_to_all_single", "barrier")


class Counter:
    """Wraps torch.distributed's collectives: per section, (op, bytes) calls and seconds inside them."""

    def __init__(self) -> None:
        self.enabled = False
        self.section = "other"
        self.calls: list[tuple[str, str, int]] = []
        self.seconds = 0.0
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def reset(self) -> None:
        self.calls, self.seconds = [], 0.0

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return original(*args, **kwargs)
            if name == "all_gather_object":
                obj = args[1] if len(args) > 1 else kwargs["obj"]
                nbytes = len(pickle.dumps(obj))
            else:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
                tensor = tensors[-1] if tensors else None  # the input (gathers take the output first)
                nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
            self.calls.append((self.section, name, nbytes))
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    @contextmanager
    def during(self, section: str) -> Iterator[None]:
        previous, self.section = self.section, section
        try:
            yield
        finally:
            self.section = previous


Microbatch = tuple[Tensor, Tensor, Tensor]


def ours_step(mbs: list[Microbatch], cfg: RolloutCorrectionConfig, groups: ParallelGroups, counter: Counter) -> Any:
    corrections = []
    for old, rollout, mask in mbs:
        with counter.during("mb"):
            corrections.append(distributed_rollout_correction(old, rollout, mask, cfg, groups))
    with counter.during("step"):
        return reduce_step(corrections, cfg, groups)


def _gather_full(shard: Tensor, groups: ParallelGroups) -> Tensor:
    """NeMo-RL's AllGatherCPTensor forward: all_gather the shards, undo the load-balanced chunking."""
    chunks = [torch.empty_like(shard) for _ in range(groups.cp_size)]
    dist.all_gather(chunks, shard, group=groups.cp_group)
    return unshard_sequence(chunks, "load_balanced")


def gather_full_step(mbs: list[Microbatch], cfg: RolloutCorrectionConfig, groups: ParallelGroups, counter: Counter,
                     metric_mode: str) -> Any:
    per_mb: list[dict[str, float]] = []
    kept_tokens = kept_seqs = 0.0
    for old, rollout, mask in mbs:
        with counter.during("mb"):
            full = [_gather_full(t, groups) for t in (old, rollout, mask)]
            out = compute_rollout_correction(full[0], full[1], full[2], cfg)
            kept_tokens += float(out.denominator_mask.sum())
            kept_seqs += float(out.denominator_mask.any(dim=-1).sum())
            if metric_mode == "allreduce":
                reduced = {}
                for key in sorted(out.metrics):
                    value = torch.tensor([out.metrics[key]], dtype=torch.float32)
                    dist.all_reduce(value, group=groups.dp_group)
                    reduced[key] = float(value) / groups.dp_size
                per_mb.append(reduced)
            else:
                per_mb.append(out.metrics)
    with counter.during("step"):
        denominators = torch.tensor([kept_tokens, kept_seqs], dtype=torch.float64)
        dist.all_reduce(denominators, group=groups.dp_group)
        if metric_mode == "object":
            gathered: list[Any] = [None] * groups.dp_size
            dist.all_gather_object(gathered, per_mb, group=groups.dp_group)
            return gathered, denominators
    return per_mb, denominators


def worker(rank: int, port: int, opts: dict[str, Any], outfile: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=_dt.timedelta(seconds=600))
    groups = build_parallel_groups(TP, CP, DP)
    assert groups is not None
    counter = Counter()
    counter.install()
    rows = []
    try:
        for batch, seq in opts["shapes"]:
            mbs: list[Microbatch] = []
            for m in range(opts["microbatches"]):
                old, rollout, mask = make_inputs(batch, seq, seed=groups.dp_rank * 1000 + m)
                mbs.append((shard_sequence(old, CP, groups.cp_rank), shard_sequence(rollout, CP, groups.cp_rank),
                            shard_sequence(mask, CP, groups.cp_rank)))
            for preset in opts["presets"]:
                cfg = RolloutCorrectionConfig.from_preset(preset)
                for approach in opts["approaches"]:
                    step: Callable[[], Any]
                    if approach == "ours":
                        step = functools.partial(ours_step, mbs, cfg, groups, counter)
                    else:
                        step = functools.partial(gather_full_step, mbs, cfg, groups, counter, approach.split("/")[1])

                    step()  # warm-up
                    totals, colls, calls = [], [], []
                    for _ in range(opts["repeats"]):
                        dist.barrier()
                        counter.reset()
                        counter.enabled = True
                        start = time.perf_counter()
                        step()
                        totals.append(time.perf_counter() - start)
                        counter.enabled = False
                        colls.append(counter.seconds)
                        calls = list(counter.calls)
                    times = torch.tensor([totals, colls], dtype=torch.float64)
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # not counted: the slowest rank per step
                    stats = torch.tensor([float(len(calls)), float(sum(c[2] for c in calls))], dtype=torch.float64)
                    spread = torch.stack([stats, -stats])
                    dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # same counts/bytes on every rank?
                    rows.append({
                        "approach": approach, "preset": preset, "shape": f"{batch}x{seq}",
                        "calls": calls, "uniform": bool((spread[0] == -spread[1]).all()),
                        "total_ms": 1e3 * statistics.median(times[0].tolist()),
                        "coll_ms": 1e3 * statistics.median(times[1].tolist()),
                    })
                    if rank == 0:
                        print(f"  {batch}x{seq} {preset} {approach}: {rows[-1]['total_ms']:.1f} ms/step",
                              file=sys.stderr, flush=True)
    finally:
        counter.uninstall()
    if rank == 0:
        with open(outfile, "wb") as fh:
            pickle.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def _summarise(calls: list[tuple[str, str, int]], section: str, per: int = 1) -> tuple[int, int, str]:
    """Calls, bytes and 'n op' list of one section; the op counts divided by `per` (microbatches)."""
    picked = [c for c in calls if c[0] == section]
    ops: dict[str, int] = {}
    for _, op, _ in picked:
        ops[op] = ops.get(op, 0) + 1
    return len(picked), sum(c[2] for c in picked), ", ".join(f"{n / per:g} {op}" for op, n in sorted(ops.items()))


def report(rows: list[dict[str, Any]], opts: dict[str, Any]) -> str:
    m = opts["microbatches"]
    lines = [
        f"# Distributed rollout correction: ours vs gather-full-sequences ({_dt.datetime.now():%Y-%m-%d %H:%M})",
        "",
        f"8 gloo processes, TP{TP} x CP{CP} x DP{DP} (Megatron order), {m} microbatches per step per DP rank, "
        f"shape = batch x full sequence per microbatch (each rank holds a load-balanced CP shard of seq/{CP}); "
        f"median of {opts['repeats']} steps, slowest rank per step. torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores shared by {WORLD} processes: times are indicative, "
        "counts and bytes are exact.",
        "",
        "Bytes: payload one rank contributes (input tensor; pickled object for all_gather_object). "
        "'/ mb' = inside one microbatch's correction; 'step' = once per step; 'amortised / mb' = "
        f"(M x mb + step) / M with M = {m}.",
        "",
        "| approach | preset | shape | collectives / mb | collectives / step | amortised collectives / mb "
        "| bytes / rank / mb | bytes / rank / step | amortised bytes / mb | collective ms / mb | total ms / mb |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n_mb, b_mb, ops_mb = _summarise(r["calls"], "mb", m)
        n_st, b_st, ops_st = _summarise(r["calls"], "step")
        flag = "" if r["uniform"] else " (differs across ranks)"
        lines.append(
            f"| {r['approach']} | {r['preset']} | {r['shape']} | {n_mb / m:g} ({ops_mb or '-'}) | "
            f"{n_st} ({ops_st or '-'}) | {(n_mb + n_st) / m:g}{flag} | {b_mb / m:,.0f} | {b_st:,} | "
            f"{(b_mb + b_st) / m:,.0f} | {r['coll_ms'] / m:.2f} | {r['total_ms'] / m:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--shapes", default="8x4096,8x16384", help="comma list of BATCHxSEQ per microbatch")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--approaches", default=",".join(APPROACHES))
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per step per DP rank")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    opts = {
        "shapes": [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")],
        "presets": args.presets.split(","), "approaches": args.approaches.split(","),
        "microbatches": args.microbatches, "repeats": args.repeats,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="nrc-bench-") as tmp:
        outfile = os.path.join(tmp, "rows.pkl")
        mp.spawn(worker, args=(port, opts, outfile), nprocs=WORLD, join=True)  # type: ignore[attr-defined,no-untyped-call]
        with open(outfile, "rb") as fh:
            rows = pickle.load(fh)
    text = report(rows, opts)
    print(text)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"{_dt.datetime.now():%Y%m%d-%H%M%S}-distributed.md"
    path.write_text(text)
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

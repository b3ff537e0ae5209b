"""A multi-process smoke job for the launchers: real collectives and a real rollout-correction step.

Run under torchrun (directly, through `containers/slurm/grpo.sbatch`, or through NeMo-Run's executors):

    torchrun --nproc-per-node 2 -m nemo_rollout_correction.launch.smoke --output-dir out/ --preset token_tis

Every rank:
1. joins the default process group (gloo on CPU, nccl when CUDA is available and asked for) from the
   torchrun environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`);
2. all-reduces its rank id (a plain SUM) so a broken rendezvous shows up as a wrong sum, not a hang;
3. builds the same generated global batch `[batch, seq]` on every rank, takes its data-parallel rows,
   runs `distributed_rollout_correction` on them and `reduce_step` over the data-parallel group
   (the fused metric all-reduce the trainer uses), and also the single-process
   `compute_rollout_correction` on the whole batch;
4. writes `rank<r>.json` with what it saw (world size, host, pid, the all-reduce result, the step's
   metrics from both paths and the largest relative difference between them).

The job fails (non-zero exit) when the two paths disagree beyond `--tolerance`, so a launcher test
that checks the exit status and the files checks a working multi-process job, not just a started one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.distributed.correction import distributed_rollout_correction, reduce_step
from nemo_rollout_correction.distributed.groups import build_parallel_groups
from nemo_rollout_correction.distributed.runtime import barrier, launched_process_group, sum_over_world


def generated_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """One global batch with a real bf16-vs-fp32 mismatch, identical on every rank.

    Returns `old_logprobs`, `rollout_logprobs` (float32 `[batch, seq]`) and `loss_mask` (bool
    `[batch, seq]`, right-padded responses of varying length).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen) * 3.0
    rollout_all = torch.log_softmax(logits.bfloat16(), dim=-1).float()
    tokens = torch.multinomial(rollout_all.exp().reshape(-1, vocab), 1, generator=gen).reshape(batch, seq, 1)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=gen)
    return {
        "old_logprobs": torch.log_softmax(logits, dim=-1).gather(-1, tokens).squeeze(-1),
        "rollout_logprobs": rollout_all.gather(-1, tokens).squeeze(-1),
        "loss_mask": torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1),
    }


def _max_rel_diff(a: dict[str, float], b: dict[str, float]) -> tuple[float, list[str]]:
    """Largest |a - b| / max(1, |b|) over the shared keys, and the keys present in only one of them.

    Relative above 1 because some metrics (perplexities, counts) are large; the float32 sums of two
    ranks and of one process differ in their last bits.
    """
    only = sorted(set(a) ^ set(b))
    diff = max((abs(a[k] - b[k]) / max(1.0, abs(b[k])) for k in set(a) & set(b)), default=0.0)
    return diff, only


def run(args: argparse.Namespace) -> dict[str, object]:
    """Join the process group, do the collectives and the correction step, return this rank's record."""
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    with launched_process_group(backend) as (rank, world):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else None
        if device is not None:
            torch.cuda.set_device(device)
        ranks_sum = sum_over_world(float(rank), device)  # 0 + 1 + ... + world-1

        if args.batch % world:
            raise ValueError(f"--batch={args.batch} must be divisible by the world size {world}")
        cfg = RolloutCorrectionConfig.from_preset(args.preset)
        data = generated_batch(args.batch, args.seq, args.vocab, args.seed)
        rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        groups = build_parallel_groups(dp=world)
        assert groups is not None  # every rank is in the layout
        mb = distributed_rollout_correction(data["old_logprobs"][rows], data["rollout_logprobs"][rows],
                                            data["loss_mask"][rows], cfg, groups)
        step = reduce_step([mb], cfg, groups)
        reference = compute_rollout_correction(data["old_logprobs"], data["rollout_logprobs"], data["loss_mask"], cfg)
        diff, only = _max_rel_diff(step.metrics, reference.metrics)
        record: dict[str, object] = {
            "rank": rank,
            "world_size": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "backend": backend,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ranks_sum": ranks_sum,
            "preset": args.preset,
            "rows": [rows.start, rows.stop],
            "num_local_tokens": int(data["loss_mask"][rows].sum()),
            "num_global_tokens": float(step.num_global_tokens),
            "reference_num_kept_tokens": float(reference.metrics["rollout_corr/num_kept_tokens"]),
            "metrics": step.metrics,
            "reference_metrics": reference.metrics,
            "max_rel_diff": diff,
            "keys_only_in_one": only,
        }
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(record, indent=2, sort_keys=True))
        barrier()
        return record


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the smoke job."""
    p = argparse.ArgumentParser(prog="python -m nemo_rollout_correction.launch.smoke",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--output-dir", required=True, help="where each rank writes rank<r>.json")
    p.add_argument("--preset", default="token_tis", help="rollout-correction preset (see `nrc presets`)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="gloo",
                   help="process-group backend; auto = nccl with CUDA, else gloo")
    p.add_argument("--batch", type=int, default=16, help="global batch rows (divisible by the world size)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary of the generated logits")
    p.add_argument("--seed", type=int, default=1234, help="seed of the generated batch (same on every rank)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest allowed |distributed - single-process| / max(1, |single-process|) per metric")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 when the distributed step matches the single-process one."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("smoke: RANK/WORLD_SIZE are not set; start this module with torchrun (or srun + torchrun)",
              file=sys.stderr)
        return 2
    record = run(args)
    diff, only = record["max_rel_diff"], record["keys_only_in_one"]
    ok = isinstance(diff, float) and diff <= args.tolerance and not only
    print(f"smoke rank {record['rank']}/{record['world_size']}: ranks_sum={record['ranks_sum']} "
          f"num_global_tokens={record['num_global_tokens']} max_rel_diff={record['max_rel_diff']:.3g} "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

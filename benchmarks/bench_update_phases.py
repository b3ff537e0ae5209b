"""Where an optimizer update spends its time on CPU: the Megatron path vs the former hand-written path, per phase.

Three update paths on the same model and batch, built side by side in ONE process and run interleaved (so
machine load hits them alike), each phase timed in CPU time of this thread and in wall time:

  megatron        the trainer's path: Megatron DDP + `get_megatron_optimizer` via `models.optimizer`,
                  with the CPU fast paths of `models.cpu_training`
  megatron-plain  the same without those fast paths (Megatron's own DDP hook, no-Apex multi_tensor_scale and
                  single-tensor Adam loop instead of torch's fused CPU Adam)
  hand-written    the path before issue 11 (commit 71062bd): torch AdamW on the model's own parameters,
                  gradients accumulated in `.grad`, a flat all-reduce, a float64 global-norm clip

Phases: `fwdbwd` (Megatron's schedule: forward, loss, backward; for the Megatron paths also the DDP hooks
and `finalize_model_grads`), `step` (Megatron: `optimizer.step()`, which clips and updates; hand-written:
all-reduce + clip + AdamW), `zero`. The first update is warm-up and excluded; medians of the rest.

    python benchmarks/bench_update_phases.py --model tiny-llama --dtype float32 --dp 2
    python benchmarks/bench_update_phases.py --model <hf dir> --dtype bfloat16 --updates 6

`--model` takes what `nrc train` takes (`tiny-llama`, `smollm2-135m`, or a Hugging Face directory).

`--compare attention` times instead the trainer's path with two core attentions, built side by side the same way:

  sdpa            the CPU layer spec's core attention (`models.sdpa_attention`, torch's fused kernel)
  unfused         the same model with Megatron's unfused `DotProductAttention` math (`fused = False`)

    python benchmarks/bench_update_phases.py --model smollm2-135m --compare attention --rows 8 --width 104

`--compare lm-head`: the trainer's path with the loss on the last `width - prompt` positions of every row,

  cut             the output layer and the log-softmax from the first loss position on (`models.logit_positions`)
  full            every position's logits computed (before it), those of the prompt discarded

    python benchmarks/bench_update_phases.py --model smollm2-135m --compare lm-head --rows 8 --width 104 --prompt 56

`--compare packing`: the trainer's whole update phase (`PolicyUpdate.cut` + `run`: the passes, forward/backward and
optimizer step of one step) on a batch of uneven rows, three ways built side by side:

  packed-budget   `policy.sequence_packing=true` with `policy.max_tokens_per_microbatch=--max-tokens` (not with 0)
  packed          `policy.sequence_packing=true`, `--rows` rows per microbatch
  padded          `policy.sequence_packing=false`: `--rows` rows per microbatch padded to the longest (the ratios'
                  denominator)
(both packed paths with `policy.prefix_sharing=false`: the batch's rows share no prompt anyway.)

`--lengths default`: the default run's shapes (16 rows, prompts of 50-60 tokens, responses of 8-48);
`--lengths long-tail`: rows of 16 to 512 tokens, log-uniform (a quarter of them over 150), prompts of 8 + 1/8.

    python benchmarks/bench_update_phases.py --model smollm2-135m --compare packing --lengths default --rows 8
    python benchmarks/bench_update_phases.py --model smollm2-135m --compare packing --lengths long-tail --rows 8

`--compare prefix`: the same update phase on a batch of GRPO shape (4 samples per prompt: the rows of a prompt
begin with the same prompt tokens; `--lengths` as above), two ways:

  shared          `policy.sequence_packing=true`, `policy.prefix_sharing=true`: each prompt packed once per
                  microbatch (`models.prefix_sharing`)
  packed          the same packs without sharing (`policy.prefix_sharing=false`; the ratios' denominator)

    python benchmarks/bench_update_phases.py --model smollm2-135m --compare prefix --lengths default --rows 8
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

PATHS = ("megatron", "megatron-plain", "hand-written")
COMPARISONS = {"paths": PATHS, "attention": ("sdpa", "unfused"), "lm-head": ("cut", "full"),
               "packing": ("packed-budget", "packed", "padded"), "prefix": ("shared", "packed")}
PACKING = {"packed-budget": {"sequence_packing": True, "prefix_sharing": False},
           "packed": {"sequence_packing": True, "prefix_sharing": False},
           "padded": {"sequence_packing": False}, "shared": {"sequence_packing": True, "prefix_sharing": True}}
SAMPLES_PER_PROMPT = 4  # --compare prefix: rows per prompt (the default run's rollout.num_samples_per_prompt)


def _uneven_batch(kind: str, samples: int, seed: int, shared_prompts: bool = False) -> tuple[dict[str, Any], Any]:
    """A step's batch tensors of `samples` uneven rows (`--lengths`) and their advantages; `shared_prompts`: every
    `SAMPLES_PER_PROMPT` consecutive rows have the same prompt (length and tokens)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if kind == "default":
        prompts = torch.randint(50, 61, (samples,), generator=gen)
        responses = torch.randint(8, 49, (samples,), generator=gen)
    else:
        lengths = torch.exp(torch.empty(samples).uniform_(math.log(16), math.log(512), generator=gen)).round().long()
        prompts = 8 + lengths // 8
        responses = (lengths - prompts).clamp(min=1)
    if shared_prompts:
        prompts = prompts[::SAMPLES_PER_PROMPT].repeat_interleave(SAMPLES_PER_PROMPT)[:samples]
    total = prompts + responses
    width = int(total.max())
    columns = torch.arange(width - 1)[None, :]
    loss_mask = (columns >= (prompts - 1)[:, None]) & (columns < (total - 1)[:, None])
    input_ids = torch.randint(3, 400, (samples, width), generator=gen)
    if shared_prompts:
        for first in range(0, samples, SAMPLES_PER_PROMPT):
            n = int(prompts[first])
            input_ids[first + 1:first + SAMPLES_PER_PROMPT, :n] = input_ids[first, :n]
    tensors = {"input_ids": input_ids, "loss_mask": loss_mask,
               "rollout_logprobs": torch.where(loss_mask, -2.0 + 0.1 * torch.randn(samples, width - 1, generator=gen),
                                               0.0),
               "prompt_lengths": prompts, "response_lengths": responses}
    return tensors, torch.randn(samples, generator=gen)


def _packing_rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    """`--compare packing|prefix`: each path's `PolicyUpdate.cut` + `run` on the same batch, interleaved."""
    import contextlib

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.config.loader import from_dict
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.trainer.policy_update import PolicyUpdate

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    patch_cuda_for_cpu()
    ps.initialize_model_parallel()
    groups = ParallelGroups.from_megatron()
    source = resolve_model_source(args["model"])
    tensors, advantages = _uneven_batch(args["lengths"], args["samples"], seed=0,
                                        shared_prompts=args["compare"] == "prefix")
    if rank == 0:
        total = tensors["prompt_lengths"] + tensors["response_lengths"]
        print(f"[bench_update_phases] {args['samples']} rows of {int(total.min())}-{int(total.max())} tokens, "
              f"{int(total.sum())} in all; padded to the longest row of each microbatch of {args['rows']}",
              file=sys.stderr, flush=True)
    updates: dict[str, Any] = {}
    for name in COMPARISONS[args["compare"]]:
        settings = PACKING[name]
        if name == "packed-budget" and not args["max_tokens"]:
            continue  # --max-tokens 0: two paths (a third SmolLM2 with its optimizer costs about 3 GB)
        policy_cfg: dict[str, Any] = {"micro_batch_size": args["rows"], "lr": 1e-6, **settings}
        if name == "packed-budget":
            policy_cfg["max_tokens_per_microbatch"] = args["max_tokens"]
        cfg = from_dict({"policy": policy_cfg, "run": {"num_steps": 1000},
                         "task": {"prompts_per_step": args["samples"] // 4},
                         "rollout": {"max_new_tokens": 512, "max_model_len": 1024}})
        policy = MegatronPolicy.from_hf(source, params_dtype=args["dtype"])
        updates[name] = PolicyUpdate(cfg, groups, policy, None, pad_id=0)
        if rank == 0:
            packs = [mb.packed for mini in updates[name].cut(tensors, advantages) for mb in mini]
            tokens = sum(pack.total for pack in packs if pack is not None)
            print(f"[bench_update_phases] {name}: {tokens or 'padded'} packed tokens in {len(packs)} microbatches",
                  file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def no_timer(_phase: str) -> Any:
        yield

    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for index in range(args["updates"]):
        for name, update in updates.items():
            cpu, wall = time.thread_time(), time.perf_counter()
            update.run(update.cut(tensors, advantages), index, no_timer)
            if index > 0:  # the first is warm-up
                samples[f"{name}/update"].append((time.thread_time() - cpu, time.perf_counter() - wall))
        if rank == 0:
            print(f"[bench_update_phases] update {index + 1}/{args['updates']} done", file=sys.stderr, flush=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(samples))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_scale

    from nemo_rollout_correction.models import optimizer as policy_optimizer
    from nemo_rollout_correction.models.cpu_training import install_multi_tensor_scale
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches
    from nemo_rollout_correction.models.sources import resolve_model_source

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    patch_cuda_for_cpu()
    ps.initialize_model_parallel()
    source = resolve_model_source(args["model"])
    gen = torch.Generator().manual_seed(rank)
    batch = [torch.randint(0, 400, (args["rows"], args["width"]), generator=gen) for _ in range(2)]
    install_multi_tensor_scale()
    fast_scale = megatron_optimizer.multi_tensor_scale_impl

    def use_scale(impl: Any) -> None:  # module globals: switched per path before each update
        megatron_optimizer.multi_tensor_scale_impl = impl
        clip_grads.multi_tensor_scale_impl = impl

    updates: dict[str, Any] = {}
    for name in COMPARISONS[args["compare"]]:
        policy = MegatronPolicy.from_hf(source, params_dtype=args["dtype"])
        if name == "unfused":
            from nemo_rollout_correction.models.sdpa_attention import SdpaDotProductAttention

            for module in policy.model.modules():
                if isinstance(module, SdpaDotProductAttention):
                    module.fused = False

        start = args["prompt"] - 1 if args["compare"] == "lm-head" else 0  # the first position the loss reads
        starts = [start if name == "cut" else 0] * len(batch)

        def loss(index: int, logits: torch.Tensor, policy: Any = policy, starts: list[int] = starts,
                 start: int = start) -> torch.Tensor:
            logprobs = policy.logprobs_from_logits(logits, batch[index], start=starts[index])
            return -logprobs[:, start:].mean() / 2

        if name != "hand-written":
            plain = name == "megatron-plain"  # sdpa / unfused: the trainer's path, like megatron
            original = policy_optimizer.cpu_ddp_class
            if plain:  # Megatron's own DDP class instead of the CPU subclass
                policy_optimizer.cpu_ddp_class = lambda: DistributedDataParallel  # type: ignore[assignment]
            try:
                optim = policy_optimizer.build_policy_optimizer(policy.model, policy_optimizer.OptimizerSettings(
                    lr=1e-5, total_updates=100, fused_cpu_adam=not plain))
            finally:
                policy_optimizer.cpu_ddp_class = original  # type: ignore[assignment]

            def update(timed: Any, optim: Any = optim, loss: Any = loss, plain: bool = plain,
                       starts: list[int] = starts) -> None:
                use_scale(local_multi_tensor_scale if plain else fast_scale)
                timed("zero", optim.zero_grad)
                timed("fwdbwd", lambda: run_microbatches(optim.module, batch, loss, forward_only=False,
                                                         output_starts=starts))
                timed("step", optim.step)
        else:
            params = [p for p in policy.model.parameters() if p.requires_grad]
            adamw = torch.optim.AdamW(params, lr=1e-5)

            def hand_written_step(params: list[Any] = params, adamw: Any = adamw) -> None:
                if world > 1:  # 71062bd's all_reduce_gradients: one flat buffer
                    grads = [p.grad for p in params]
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    dist.all_reduce(flat)
                    offset = 0
                    for grad in grads:
                        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                        offset += grad.numel()
                squares = torch.zeros((), dtype=torch.float64)  # 71062bd's clip_grad_norm (TP = PP = 1)
                for param in params:
                    squares += param.grad.detach().double().pow(2).sum()
                norm = math.sqrt(float(squares))
                if norm > 1.0:
                    for param in params:
                        param.grad.mul_(1.0 / (norm + 1e-6))
                adamw.step()

            def update(timed: Any, policy: Any = policy, loss: Any = loss, adamw: Any = adamw,
                       step: Any = hand_written_step) -> None:
                timed("zero", lambda: adamw.zero_grad(set_to_none=True))
                timed("fwdbwd", lambda: run_microbatches(policy.model, batch, loss, forward_only=False))
                timed("step", step)
        updates[name] = update

    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for index in range(args["updates"]):
        for name, update in updates.items():
            phases: dict[str, tuple[float, float]] = {}

            def timed(phase: str, fn: Any, phases: dict[str, tuple[float, float]] = phases) -> None:
                cpu, wall = time.thread_time(), time.perf_counter()
                fn()
                phases[phase] = (time.thread_time() - cpu, time.perf_counter() - wall)

            update(timed)
            if index == 0:
                continue  # warm-up
            for phase, value in phases.items():
                samples[f"{name}/{phase}"].append(value)
            samples[f"{name}/update"].append((sum(v[0] for v in phases.values()), sum(v[1] for v in phases.values())))
        if rank == 0:
            print(f"[bench_update_phases] update {index + 1}/{args['updates']} done", file=sys.stderr, flush=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(samples))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _print_packing(args: argparse.Namespace, samples: dict[str, Any], paths: tuple[str, ...]) -> int:
    kind = 0 if args.threads == 1 else 1  # CPU time of this thread, or wall time with more threads
    print(f"{args.model} {args.dtype} DP={args.dp}, --lengths {args.lengths}, {args.samples} rows, "
          f"{args.rows} rows per padded/packed microbatch, packed-budget {args.max_tokens} tokens: update phase "
          f"(PolicyUpdate.cut + run), medians over {args.updates - 1} updates, rank 0, ms")
    base = paths[-1]
    print(f"{'path':<15}{'cpu':>10}{'wall':>10}{f'ratio to {base} (median of interleaved pairs)':>50}")
    for name in paths:
        if f"{name}/update" not in samples:
            continue
        values = samples[f"{name}/update"]
        ratios = [a[kind] / b[kind] for a, b in zip(values, samples[f"{base}/update"], strict=True)]
        print(f"{name:<15}{1000 * statistics.median(v[0] for v in values):>10.1f}"
              f"{1000 * statistics.median(v[1] for v in values):>10.1f}{statistics.median(ratios):>12.3f} "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="tiny-llama, smollm2-135m or a Hugging Face dir")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (gloo processes)")
    parser.add_argument("--updates", type=int, default=8, help="updates per path (the first is warm-up)")
    parser.add_argument("--rows", type=int, default=2, help="rows per microbatch (two microbatches per update)")
    parser.add_argument("--width", type=int, default=96, help="tokens per row")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (CPU time counts this thread only: compare wall times above 1)")
    parser.add_argument("--prompt", type=int, default=56, help="--compare lm-head: prompt tokens per row")
    parser.add_argument("--compare", default="paths", choices=tuple(COMPARISONS),
                        help="paths: the three update paths; attention: the fused vs the unfused core attention; "
                             "lm-head: cut vs full output layer; packing: packed vs padded microbatches; "
                             "prefix: packs with vs without shared prompts")
    parser.add_argument("--lengths", default="default", choices=("default", "long-tail"),
                        help="--compare packing: the row lengths (module docstring)")
    parser.add_argument("--samples", type=int, default=16, help="--compare packing: rows per step")
    parser.add_argument("--max-tokens", type=int, default=2048,
                        help="--compare packing: policy.max_tokens_per_microbatch of packed-budget (0: no such path)")
    args = parser.parse_args(argv)
    if args.updates < 2:
        parser.error("--updates must be >= 2 (the first is warm-up)")
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        entry = _packing_rank if args.compare in ("packing", "prefix") else _rank
        mp.start_processes(entry, args=(args.dp, port, vars(args), out), nprocs=args.dp, start_method="spawn")
        samples = json.loads(Path(out, "rank0.json").read_text())
    paths = COMPARISONS[args.compare]
    if args.compare in ("packing", "prefix"):
        return _print_packing(args, samples, paths)
    print(f"{args.model} {args.dtype} DP={args.dp}, {2 * args.rows} rows x {args.width} tokens: "
          f"medians over {args.updates - 1} updates, rank 0, ms")
    print(f"{'phase':<10}" + "".join(f"{name + ' cpu':>20}{'wall':>8}" for name in paths))
    for phase in ("fwdbwd", "step", "zero", "update"):
        row = f"{phase:<10}"
        for name in paths:
            values = samples[f"{name}/{phase}"]
            row += (f"{1000 * statistics.median(v[0] for v in values):>20.1f}"
                    f"{1000 * statistics.median(v[1] for v in values):>8.1f}")
        print(row)
    cpu = {name: statistics.median(v[0] for v in samples[f"{name}/update"]) for name in paths}
    if args.compare != "paths":
        new, old = paths
        kind = 0 if args.threads == 1 else 1  # CPU time of this thread, or wall time with more threads
        pairs = zip(samples[f"{new}/update"], samples[f"{old}/update"], strict=True)
        ratios = [a[kind] / b[kind] for a, b in pairs]
        print(f"update {('CPU', 'wall')[kind]} time {new} / {old}: median of interleaved pairs "
              f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.2f}' for r in ratios)})")
        return 0
    print(f"update CPU time megatron / hand-written = {cpu['megatron'] / cpu['hand-written']:.2f}; "
          f"megatron / megatron-plain = {cpu['megatron'] / cpu['megatron-plain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

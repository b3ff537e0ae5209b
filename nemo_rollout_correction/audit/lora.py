"""`nrc audit` with `policy.lora`: the engine's unmerged adapter against the trainer, next to the merged control.

A LoRA run adds one mismatch source: the engine applies the adapter with its own kernels (vLLM's punica LoRA
ops, `B (A x)` beside the base GEMM, unmerged) while the trainer computes `W x + alpha/r B (A x)` with Megatron.
The audit measures it on an adapter that matters: a fresh adapter is zero (B = 0, the base model), so B is set to
seeded noise of std `audit.lora_b_std` (one generator per linear, seeded by `run.seed` and its name; the
comparison runs in one process). Two engines of `rollout.dtype` in turn sample the same prompts with the
run's sampling:

- `adapter`: the engine serving the base checkpoint + the adapter (`LoraAdapterRefit`, what
  `rollout.lora_sync=adapter` trains with);
- `merged`: a plain engine refitted with `W + alpha/r B A` (the full refit, `rollout.lora_sync=merged`): the
  control, whose only mismatch is the engine's own.

The LoRA policy re-scores each engine's sampled tokens (the sampled-token logprobs: vLLM 0.32's prompt
logprobs fail on a LoRA engine on CPU, so the whole-distribution probes stay on the base audit). Each row:
max and mean |trainer - engine|, `rollout_corr/kl` and `rollout_corr/k3_kl` as in training, and
`mean_abs_adapter_effect`: mean |LoRA trainer - base trainer| on the same tokens (how far the seeded adapter moves
the logprobs: the scale the mismatch is read against).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nemo_rollout_correction.audit.data import AuditData, generate, logprob_diff, rescore
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.harness import metric_names as mn
from nemo_rollout_correction.harness.settings import engine_options, replay_options, sampling_options
from nemo_rollout_correction.models.lora import adapters
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

ROWS = ("adapter", "merged")
"""The compared engines, in order: the unmerged adapter, then the merged-weights control."""


def seed_adapter_b(policy: MegatronPolicy, std: float, seed: int) -> None:
    """Set every adapter's B (`[out / tp, r]` on a column-parallel linear) to N(0, std^2) noise from a generator
    seeded by (`seed`, the linear's name): a stand-in for a trained adapter. One-process policies only."""
    with torch.no_grad():
        for name, adapter in adapters(policy.model):
            digest = hashlib.sha256(f"{seed}:{name}:lora_b".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            noise = torch.randn(adapter.b.shape, generator=gen, dtype=torch.float32)
            adapter.b.copy_(std * noise)


def lora_comparison(cfg: TrainConfig, hf_dir: str, prompts: Sequence[Sequence[int]], *, pad_token_id: int,
                    log: Any = print) -> dict[str, dict[str, float]]:
    """`{"adapter": row, "merged": row}`, each row `max_abs_logprob_diff`, `mean_abs_logprob_diff`, `kl`,
    `k3_kl`, `mean_abs_adapter_effect`, `num_tokens` (module docstring). One process (world size 1): the caller
    checks."""
    policy = MegatronPolicy.from_hf(hf_dir, params_dtype=cfg.model.dtype, seed=cfg.run.seed, lora=cfg.policy.lora)
    seed_adapter_b(policy, cfg.audit.lora_b_std, cfg.run.seed)
    options = engine_options(cfg, hf_dir, cfg.rollout.dtype)
    payloads = {"adapter": (cfg.policy.lora.rank, policy.hf_adapter_state_dict()),
                "merged": (0, policy.hf_state_dict())}
    rows: dict[str, dict[str, float]] = {}
    for row in ROWS:
        lora_rank, payload = payloads[row]
        log(f"[nrc audit] LoRA: starting vLLM ({cfg.rollout.dtype}) with the {row} weights")
        engine = VllmRolloutEngine(dataclasses.replace(options, lora_rank=lora_rank, lora_alpha=cfg.policy.lora.alpha,
                                                       name=f"audit-lora-{row}"))
        try:
            engine.refit(payload.items())
            batch = generate(engine, prompts, sampling_options(cfg), seed=cfg.run.seed)
        finally:
            engine.shutdown()
        data: AuditData = rescore(policy, batch, replay_options(cfg), pad_token_id=pad_token_id,
                                  micro_batch_size=cfg.policy.micro_batch_size)
        max_diff, mean_diff = logprob_diff(data)
        metrics = compute_rollout_correction(data.old_logprobs, data.rollout_logprobs, data.loss_mask,
                                             RolloutCorrectionConfig.from_preset("disabled")).metrics
        with _zero_b(policy):  # the base model on the same tokens: how far the adapter moves them
            base = rescore(policy, batch, replay_options(cfg), pad_token_id=pad_token_id,
                           micro_batch_size=cfg.policy.micro_batch_size)
        effect = (data.old_logprobs - base.old_logprobs).abs()[data.loss_mask]
        rows[row] = {"max_abs_logprob_diff": max_diff, "mean_abs_logprob_diff": mean_diff,
                     "kl": float(metrics[mn.RC_KL]), "k3_kl": float(metrics[mn.RC_K3_KL]),
                     "mean_abs_adapter_effect": float(effect.mean()) if effect.numel() else 0.0,
                     "num_tokens": float(data.loss_mask.sum())}
    return rows


@contextlib.contextmanager
def _zero_b(policy: MegatronPolicy) -> Iterator[None]:
    """Every adapter's B set to zero (the base model) inside the block, restored after."""
    saved = [(adapter, adapter.b.detach().clone()) for _, adapter in adapters(policy.model)]
    with torch.no_grad():
        for adapter, _ in saved:
            adapter.b.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for adapter, b in saved:
                adapter.b.copy_(b)


def format_lora_rows(rows: dict[str, dict[str, float]], dtype: str) -> list[str]:
    """The report's LoRA section (empty without rows)."""
    if not rows:
        return []
    lines = ["", f"LoRA adapter ({dtype} engines; B seeded, audit.lora_b_std; the LoRA policy re-scores each "
                 "engine's tokens):",
             f"  {'engine':<28} {'max |diff|':>11} {'mean |diff|':>11} {'kl':>11} {'k3_kl':>11} {'tokens':>7} "
             f"{'adapter effect':>15}"]
    labels = {"adapter": "adapter, unmerged (punica)", "merged": "merged W + s B A (control)"}
    for row, v in rows.items():
        lines.append(f"  {labels.get(row, row):<28} {v['max_abs_logprob_diff']:>11.3e} "
                     f"{v['mean_abs_logprob_diff']:>11.3e} {v['kl']:>11.3e} {v['k3_kl']:>11.3e} "
                     f"{int(v['num_tokens']):>7} {v['mean_abs_adapter_effect']:>15.3e}")
    return lines


__all__ = ["ROWS", "format_lora_rows", "lora_comparison", "seed_adapter_b"]

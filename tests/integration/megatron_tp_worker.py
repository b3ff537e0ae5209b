"""Gloo worker of `test_megatron_tp`: a real Megatron-Core GPTModel at TP=1 and TP=2 through the loss.

Each of the 2 ranks runs, in one launch:
1. TP=1 (`initialize_model_parallel(1)`, i.e. DP=2 with the same data on both ranks): build the
   tiny GPT (local spec, CPU), forward, vocab-parallel logprobs (group of size 1), the
   rollout-corrected loss for every case, backward; keep the unsharded weights and gradients.
2. TP=2: rebuild the parallel state, build the same model sharded over the two ranks, load the
   TP=1 weights shard by shard (Megatron's partition layout) and gather them back to prove they
   are identical, then the same forward / logprobs / loss / backward with TP-sharded logits
   `[batch, seq, vocab / 2]`; gradients of TP-sharded parameters are all-gathered along their
   partition dimension so the test compares full tensors.
"""

from __future__ import annotations

import time
from typing import Any

import megatron_tiny  # tests/integration (on sys.path: test_megatron_tp.py puts it there)
import torch
import torch.distributed as dist
from torch import Tensor, nn

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs
from nemo_rollout_correction.losses.megatron import MegatronLossBatch, make_megatron_loss_func
from nemo_rollout_correction.losses.rollout_corrected_pg import RolloutCorrectedPolicyLoss
from nemo_rollout_correction.models import megatron_cpu

VOCAB = 64
"""Vocabulary: shards of 32 ids at TP=2."""
BATCH, SEQ = 3, 12
SEED = 1234
CASES: dict[str, dict[str, Any]] = {
    "decoupled_token_is": {},
    "decoupled_seq_is_rs": {},
    "decoupled_token_icepop": {},
}
"""Rollout-correction presets (decoupled mode) run through the loss, with config overrides."""


def make_batch() -> dict[str, Tensor]:
    """Token ids `[batch, seq + 1]`, rollout-logprob noise, advantages and a loss mask (prompt masked)."""
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    noise = 0.05 * torch.randn(BATCH, SEQ, generator=gen)
    noise[0, 5] = 1.5  # one token far out of any IS / icepop bound
    advantages = torch.randn(BATCH, generator=gen)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[:, :3] = 0.0  # prompt tokens
    loss_mask[2, 9:] = 0.0  # a shorter response
    return {"tokens": tokens, "noise": noise, "advantages": advantages, "loss_mask": loss_mask}


def _gather(value: Tensor, dim: int, group: Any, size: int) -> Tensor:
    parts = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _unsharded(model: nn.Module, values: dict[str, Tensor], group: Any, size: int) -> dict[str, Tensor]:
    """`values` (per parameter name) with TP-sharded entries all-gathered along their partition dim."""
    params = dict(model.named_parameters())
    out = {}
    for name, value in values.items():
        dim = megatron_tiny.tp_partition(params[name])
        out[name] = value.detach().clone() if dim is None or size == 1 else _gather(value.detach(), dim, group, size)
    return out


def _run(model: nn.Module, batch: dict[str, Tensor], groups: ParallelGroups) -> dict[str, Any]:
    """Every case: forward, logprobs, loss, backward; returns values and unsharded gradients.

    Each case runs twice: through `core.objective` on vocab-parallel logprobs, and through the
    Megatron `forward_step` loss function (`losses.megatron`) on the raw TP-sharded logits, with
    Megatron's per-token-loss semantics (backward of loss_sum / num_tokens for one microbatch).
    """
    tp_group, tp_size = groups.tp_group, groups.tp_size
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = megatron_cpu.causal_attention_mask(SEQ)
    results: dict[str, Any] = {}
    for case, overrides in CASES.items():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs, position_ids=position_ids, attention_mask=mask)
        logprobs = vocab_parallel_logprobs(logits, targets, tp_group if tp_size > 1 else None)
        rollout_logprobs = logprobs.detach() + batch["noise"]
        cfg = RolloutCorrectionConfig.from_preset(case, **overrides)
        out = rollout_corrected_policy_loss(logprobs, rollout_logprobs, batch["advantages"], batch["loss_mask"], cfg,
                                            old_logprobs=logprobs.detach())
        out.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        megatron_loss, megatron_grads = _megatron_loss_func_run(
            model, inputs, targets, position_ids, mask, batch, cfg, rollout_logprobs, logprobs.detach(), groups)
        results[case] = {
            "megatron_loss": megatron_loss,
            "megatron_grads": _unsharded(model, megatron_grads, tp_group, tp_size),
            "logits_shape": tuple(logits.shape),
            "logprobs": logprobs.detach().clone(),
            "loss": out.loss.detach().clone(),
            "is_weights": out.correction.is_weights.detach().clone(),
            "keep_mask": out.correction.keep_mask.detach().clone(),
            "grads": _unsharded(model, grads, tp_group, tp_size),
            "num_grads": len(grads),
        }
    return results


def _megatron_loss_func_run(model: nn.Module, inputs: Tensor, targets: Tensor, position_ids: Tensor, mask: Tensor,
                            batch: dict[str, Tensor], cfg: RolloutCorrectionConfig, rollout_logprobs: Tensor,
                            old_logprobs: Tensor, groups: ParallelGroups) -> tuple[Tensor, dict[str, Tensor]]:
    """One microbatch through `make_megatron_loss_func` as Megatron's schedule would call it."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=inputs, position_ids=position_ids, attention_mask=mask)
    loss_batch = MegatronLossBatch(rollout_logprobs=rollout_logprobs, advantages=batch["advantages"],
                                   loss_mask=batch["loss_mask"], old_logprobs=old_logprobs, target_ids=targets)
    loss_func = make_megatron_loss_func(loss_batch, RolloutCorrectedPolicyLoss(cfg), groups)
    loss_sum, num_tokens, _report = loss_func(logits)
    # calculate_per_token_loss: Megatron back-propagates loss_sum and divides the gradients by the
    # step's total num_tokens (all-reduced over dp x cp; the TP=1 layout's DP copies hold the same
    # data, so the local ratio is the step's).
    loss = loss_sum / num_tokens
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _layout(groups: ParallelGroups) -> dict[str, Any]:
    return {"tp_size": groups.tp_size, "tp_rank": groups.tp_rank, "cp_size": groups.cp_size, "dp_size": groups.dp_size,
            "dp_cp_size": groups.dp_cp_size, "last_stage": groups.is_last_pipeline_stage}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    assert world_size == 2
    megatron_cpu.patch_cuda_for_cpu()
    batch = make_batch()
    timings: dict[str, float] = {}
    layouts: dict[str, Any] = {}
    try:
        ParallelGroups.from_megatron()
        layouts["uninitialised_error"] = None
    except RuntimeError as err:
        layouts["uninitialised_error"] = str(err)

    # ---- TP=1 reference (both ranks compute it; DP=2 with identical data) ----------------------
    started = time.perf_counter()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    layouts["tp1"] = _layout(ParallelGroups.from_megatron())
    megatron_cpu.seed_model_parallel(SEED)
    cfg1 = megatron_tiny.tiny_gpt_config(tensor_model_parallel_size=1)
    model1 = megatron_tiny.build_tiny_gpt(cfg1, vocab_size=VOCAB, max_sequence_length=SEQ)
    full_weights = {name: p.detach().clone() for name, p in model1.named_parameters()}
    tp1 = _run(model1, batch, ParallelGroups.from_megatron())
    parallel_state.destroy_model_parallel()
    timings["tp1"] = time.perf_counter() - started

    # ---- TP=2: same weights, sharded ------------------------------------------------------------
    started = time.perf_counter()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    groups = ParallelGroups.from_megatron()  # our groups from Megatron's parallel state
    layouts["tp2"] = _layout(groups)
    tp_group, tp_rank = groups.tp_group, groups.tp_rank
    assert tp_rank == parallel_state.get_tensor_model_parallel_rank()
    megatron_cpu.seed_model_parallel(SEED + 1)  # a different init: the loaded weights must win
    cfg2 = megatron_tiny.tiny_gpt_config(tensor_model_parallel_size=2)
    model2 = megatron_tiny.build_tiny_gpt(cfg2, vocab_size=VOCAB, max_sequence_length=SEQ)
    sharded = [name for name, p in model2.named_parameters() if megatron_tiny.tp_partition(p) is not None]
    megatron_tiny.load_unsharded_parameters(model2, full_weights, tp_rank, 2)
    gathered_weights = _unsharded(model2, dict(model2.named_parameters()), tp_group, 2)
    tp2 = _run(model2, batch, groups)
    parallel_state.destroy_model_parallel()
    timings["tp2"] = time.perf_counter() - started

    return {
        "rank": rank,
        "tp_rank": tp_rank,
        "full_weights": full_weights,
        "gathered_weights": gathered_weights,
        "sharded_names": sharded,
        "tp1": tp1,
        "tp2": tp2,
        "layouts": layouts,
        "timings": timings,
    }

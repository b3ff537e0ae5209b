"""The rollout-corrected policy loss as a Megatron-Core `forward_step` loss function.

Megatron-Core's schedules call `loss_func(output_tensor)` on the last pipeline stage and accept a
3-tuple `(loss, num_tokens, report)`. With `config.calculate_per_token_loss=True` (what this
adapter is for) the schedule:

1. back-propagates `loss` of each microbatch unscaled (no division by `num_tokens`, nor by the
   number of microbatches), and adds `num_tokens` into a step total;
2. `finalize_model_grads` broadcasts that total from the last pipeline stage, all-reduces it over
   the data x context parallel group and scales every gradient by `1 / total`; DDP sums (does not
   average) gradients over dp x cp in this mode;
3. the training loop sums each 2-element `report` value `[sum, count]` over microbatches,
   all-reduces it over dp x cp and logs `sum / count`.

So the step's gradient is `sum over microbatches and dp x cp of d loss_sum / sum of num_tokens`.
Returning the un-normalised numerator of `RolloutCorrectedPolicyLoss` as `loss` and this
microbatch's share of the denominator (kept tokens after rejection, or kept sequences for the
sequence modes, each counted once over CP) as `num_tokens` makes that exactly the full-batch
rollout-corrected loss, with the denominator counted after rejection (docs/design.md decision 2) by
Megatron itself, after the step: no pre-pass is needed for the count, in bypass mode either.

A pre-pass is still needed for batch-normalised IS (global mean) and is the cheaper place for the
correction in decoupled mode: pass `MegatronLossBatch.correction` / `denominators`.

With `calculate_per_token_loss=False` Megatron divides each microbatch by its own `num_tokens` and
averages over microbatches and DP ranks: a mean of means, not this loss. The adapter cannot undo
that, so set `calculate_per_token_loss=True` (and `average_in_collective=False`, which Megatron
requires with it).

Megatron is not imported here: the loss function only needs tensors and this package's process
groups (`ParallelGroups.from_megatron()` builds them from Megatron's parallel state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from nemo_rollout_correction.distributed.correction import MicrobatchCorrection
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs
from nemo_rollout_correction.losses.rollout_corrected_pg import (
    MicrobatchLoss,
    RolloutCorrectedPolicyLoss,
    StepDenominators,
)

__all__ = ["REPORT_KEY", "MegatronLossBatch", "MegatronLossFunc", "make_megatron_loss_func", "output_to_logprobs"]

REPORT_KEY = "rollout corrected pg loss"
"""The report entry Megatron's training loop logs as `sum / count` over the step."""

MegatronLossFunc = Callable[[Tensor], tuple[Tensor, Tensor, dict[str, Tensor]]]
"""`loss_func(output_tensor) -> (loss_sum, num_tokens, report)`, Megatron's 3-tuple contract."""


@dataclass
class MegatronLossBatch:
    """The loss inputs of one microbatch on this rank (its CP shard, `[batch, local_seq]` each).

    rollout_logprobs: vLLM's logprobs of the sampled tokens (may be NaN/inf).
    advantages: `[batch, local_seq]` or `[batch]`.
    loss_mask: trainable response tokens (bool or 0/1).
    old_logprobs: pi_old (decoupled mode); None in bypass mode.
    target_ids: the sampled token ids, needed when the model returns vocab-parallel logits.
    correction: this microbatch's pre-pass correction (`RolloutCorrectedPolicyLoss.correct` then
        `prepare_step`); None computes it inside the loss function.
    temperature, top_k, top_p: vLLM's sampler, replayed on logits (see `vocab_parallel_logprobs`).
    vocab_size: the unpadded vocabulary size when Megatron pads the output layer.
    """

    rollout_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor | None = None
    target_ids: Tensor | None = None
    correction: MicrobatchCorrection | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    vocab_size: int | None = None


def output_to_logprobs(output_tensor: Tensor, batch: MegatronLossBatch, groups: ParallelGroups) -> Tensor:
    """pi_theta `[batch, local_seq]` from what the model's forward returned.

    - `[batch, local_seq, V / tp]` logits (GPTModel called without labels): the vocab-parallel
      logprob of `batch.target_ids` over the TP group (fp32, gradient to the logits);
    - `[batch, local_seq]` per-token cross-entropy (GPTModel called with `labels=target_ids`,
      Megatron's own vocab-parallel CE): the logprob is its negative. Sampler replay (temperature,
      top-k/p) is not possible on this path; call the model without labels for that.
    """
    if output_tensor.dim() == 3:
        if batch.target_ids is None:
            raise ValueError("the model returned logits: MegatronLossBatch.target_ids is needed to pick the "
                             "sampled tokens' logprobs")
        return vocab_parallel_logprobs(output_tensor, batch.target_ids, groups.tp_group if groups.tp_size > 1 else None,
                                       vocab_size=batch.vocab_size, temperature=batch.temperature,
                                       top_k=batch.top_k, top_p=batch.top_p)
    if output_tensor.dim() == 2:
        if batch.temperature != 1.0 or batch.top_k is not None or batch.top_p is not None:
            raise ValueError("sampler replay (temperature / top_k / top_p) needs logits; call the model without "
                             "labels so that it returns them")
        return -output_tensor.float()
    raise ValueError(f"output_tensor must be [batch, seq, vocab_shard] logits or [batch, seq] per-token CE, got "
                     f"shape {tuple(output_tensor.shape)}")


def make_megatron_loss_func(
    batch: MegatronLossBatch,
    loss: RolloutCorrectedPolicyLoss,
    groups: ParallelGroups,
    *,
    denominators: StepDenominators | None = None,
    sink: list[MicrobatchLoss] | None = None,
) -> MegatronLossFunc:
    """A `loss_func` for Megatron's `forward_step` (`return output_tensor, partial(...)` idiom).

    batch: this microbatch's inputs on this rank. loss: the configured loss module.
    groups: this rank's groups (`ParallelGroups.from_megatron()` under Megatron).
    denominators: only `is_weight_mean` is used (batch-normalised IS without a precomputed
        correction); the count is Megatron's `num_tokens` total.
    sink: when given, each call appends its `MicrobatchLoss` so the trainer can reduce the step's
        rollout-correction metrics afterwards (`distributed.reduce_step_metrics` on their
        partials: one fused all-reduce, exact step values).

    The returned function gives `(loss_sum, num_tokens, report)`: `loss_sum` 0-dim fp32 with
    gradient, `num_tokens` 0-dim int32 (this microbatch's share of the step denominator), and
    `report = {REPORT_KEY: tensor([loss_sum, num_tokens])}`. Requires Megatron's
    `calculate_per_token_loss=True` (module doc). `token-sum` aggregation is rejected: Megatron
    always divides by the summed `num_tokens` in this mode.
    """
    if loss.agg_mode == "token-sum":
        raise ValueError("loss_agg_mode='token-sum' has no denominator, but Megatron's per-token-loss mode "
                         "divides by the summed num_tokens; use 'token-mean' or a sequence mode")

    def loss_func(output_tensor: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        logprobs = output_to_logprobs(output_tensor, batch, groups)
        result = loss(logprobs, batch.rollout_logprobs, batch.advantages, batch.loss_mask, groups, denominators,
                      old_logprobs=batch.old_logprobs, correction=batch.correction)
        if sink is not None:
            sink.append(result)
        num_tokens = result.num_denominator.to(torch.int)
        loss_sum = result.loss_sum.float()
        report = {REPORT_KEY: torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])}
        return loss_sum, num_tokens, report

    return loss_func

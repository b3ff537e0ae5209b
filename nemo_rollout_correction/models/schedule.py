"""Run a list of microbatches through Megatron-Core's forward/backward schedule.

The trainer never calls the model directly: every pass (old-logprob re-scoring, the reference
policy, the loss pass with backward) goes through `megatron.core.pipeline_parallel.
get_forward_backward_func()`. With PP = 1 that is Megatron's no-pipelining schedule (forward, loss,
backward per microbatch); with PP > 1 it is the 1F1B pipeline schedule, which sends activations
between stages and calls the loss only on the last stage. One code path for every layout.

How the schedule is configured, and why:

- `calculate_per_token_loss=True` and a 3-tuple from the loss function: Megatron then leaves the
  returned loss unscaled (otherwise it divides by the number of microbatches and multiplies by the CP
  size); our loss is already divided by the step's global denominator.
- `variable_seq_lengths=True`: microbatches are trimmed to their longest row, so stage-to-stage
  activations change shape; Megatron then exchanges shapes first.
- `finalize_model_grads_func` is whatever the model's config holds: Megatron's `finalize_model_grads`
  once the model is wrapped for training (`models.optimizer`: DP x CP gradient reduction, tied-embedding
  sync, division by the loss hooks' summed token counts), nothing for a bare model (scoring, tests).
- on CPU, `distributed.cpu_compat.cuda_to_cpu` covers the schedule's hard-coded `device="cuda"`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from nemo_rollout_correction.distributed.cpu_compat import cuda_to_cpu, without_torch_function_modes
from nemo_rollout_correction.models.logit_positions import can_cut, from_position
from nemo_rollout_correction.models.megatron_cpu import causal_attention_mask
from nemo_rollout_correction.models.packing import PackedRows
from nemo_rollout_correction.models.prefix_sharing import installed

LossHook = Callable[[int, Tensor], "Tensor | tuple[Tensor, Tensor | None]"]
"""`(microbatch index, logits [batch, seq, vocab / tp]) -> scalar loss` or `(loss, num_tokens)`; runs on the
last stage only. A returned `num_tokens` (0-dim) is summed by Megatron over the microbatches and dp x cp, and
`finalize_model_grads` divides the gradients by that sum (when positive): the loss can then be a numerator
whose denominator is only known after the pass."""


def configure_schedule(model: nn.Module) -> None:
    """Set the schedule options this module relies on in the model's `TransformerConfig` (idempotent)."""
    config: Any = model.config
    config.calculate_per_token_loss = True
    config.variable_seq_lengths = True


def run_microbatches(model: nn.Module, input_ids: Sequence[Tensor], loss_hook: LossHook, *,
                     forward_only: bool, position_ids: Sequence[Tensor] | None = None,
                     outputs: Sequence[Tensor] | None = None, output_starts: Sequence[int] | None = None,
                     packed: Sequence[PackedRows] | None = None) -> None:
    """Forward (and unless `forward_only`, backward) every microbatch through Megatron's schedule.

    input_ids: one right-padded `[rows, width]` tensor per microbatch; every stage of a pipeline must
        pass the same list (the schedule sends activations by position). Widths may differ.
    position_ids: with context parallelism, each microbatch's `[width]` global positions of this CP
        rank's tokens (`distributed.context_parallel.cp_token_indices`); None means `0..width-1`.
        Under CP the attention builds its own causal mask (from Megatron's CP layout), so none is passed.
    loss_hook: called on the last pipeline stage with each microbatch's logits; its scalar is
        backpropagated as is (no rescaling, except fp16's loss scale). For `forward_only` passes return
        any scalar, e.g. zero.
    outputs: each microbatch's logits already computed with gradient by `forward_microbatches` (PP = 1 only):
        the schedule then runs no forward, and each microbatch's backward goes through the kept graph.
    output_starts: per microbatch, the first sequence position whose logits are computed
        (`models.logit_positions`, installed on the model): the loss hook then gets `[rows, width - start, ...]`.
    packed: per microbatch its rows packed (`models.packing.PackedRows`, no CP): the forward runs on the
        `[1, total]` pack with Megatron's THD `PackedSeqParams` instead of `input_ids`, and the loss hook gets
        the logits `[1, K, vocab / tp]` of the pack's `logit_index` positions (all `total` positions on a model
        whose output layer cannot cut); `output_starts` is ignored.
    Gradients accumulate into `.grad` for a bare model (the caller reduces them); for a model wrapped by
    `models.optimizer` into DDP's `main_grad` buffer, finalised (reduced, synced, divided) at the end.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    configure_schedule(model)
    if not input_ids:
        return
    if outputs is not None and len(outputs) != len(input_ids):
        raise ValueError(f"{len(outputs)} precomputed outputs for {len(input_ids)} microbatches")
    positions = list(position_ids) if position_ids is not None else None
    starts = list(output_starts) if output_starts is not None else [0] * len(input_ids)
    packs = _check_packed(packed, len(input_ids), positions)

    def loss_func(index: int, logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
        with _compute(model):
            out = loss_hook(index, logits)
        loss, count = out if isinstance(out, tuple) else (out, None)
        # Megatron sums these into its token counter; finalize_model_grads divides by a positive total.
        tokens = torch.zeros((), dtype=torch.int, device=loss.device) if count is None else \
            count.detach().to(device=loss.device, dtype=torch.int)
        return loss, tokens, {}

    def forward_step(data_iterator: Any, stage: nn.Module) -> tuple[Tensor, Callable[[Tensor], Any]]:
        index, ids = next(data_iterator)
        if outputs is not None:  # forwarded beforehand (`forward_microbatches`): its graph is backpropagated
            return outputs[index], partial(loss_func, index)
        # Non-first stages ignore input_ids and take the activations Megatron set as their input.
        return _stage_forward(stage, ids, positions[index] if positions is not None else None, starts[index],
                              packs[index] if packs is not None else None), partial(loss_func, index)

    schedule = get_forward_backward_func()
    first = input_ids[0] if packs is None else packs[0].input_ids
    with cuda_to_cpu():
        schedule(forward_step_func=forward_step, data_iterator=iter(enumerate(input_ids)), model=[model],
                 num_microbatches=len(input_ids), seq_length=int(first.shape[1]),
                 micro_batch_size=int(first.shape[0]), forward_only=forward_only)


def _compute(model: nn.Module) -> Any:
    """The context a forward or loss runs in under the schedule's CPU mode (`cuda_to_cpu`): the mode is needed
    by the schedule itself, and inside the model only for context parallelism (Megatron's CP rotary embedding
    pins and moves memory); elsewhere it is suspended, as its per-call Python overhead is measurable on every
    op of a forward."""
    context_parallel = int(getattr(model.config, "context_parallel_size", 1)) > 1
    return contextlib.nullcontext() if context_parallel else without_torch_function_modes()


def _check_packed(packed: Sequence[PackedRows] | None, num: int,
                  positions: Sequence[Tensor] | None) -> list[PackedRows] | None:
    if packed is None:
        return None
    if len(packed) != num:
        raise ValueError(f"{len(packed)} packs for {num} microbatches")
    if positions:
        raise ValueError("packed rows and context-parallel position_ids cannot be combined")
    return list(packed)


def _stage_forward(stage: nn.Module, ids: Tensor, position_ids: Tensor | None, output_start: int = 0,
                   packed: PackedRows | None = None) -> Tensor:
    """One microbatch's forward through `stage` (`[rows, width]` ids; CP: this rank's `[width]` positions), as the
    schedule runs it: positions `0..width-1` and a causal mask without CP, Megatron's CP layout with it; logits
    from sequence position `output_start` on (`models.logit_positions`). With `packed` the forward runs on the
    pack instead (`run_microbatches`)."""
    device = next(stage.parameters()).device
    if packed is not None:
        packed = packed.to(device)
        if packed.shares_prefixes and not installed(stage):
            raise RuntimeError("a shared-prefix pack needs models.prefix_sharing.install(model) (the local layer "
                               "spec's attention; MegatronPolicy.shares_prefixes)")
        index: Tensor | int = packed.logit_index if can_cut(stage) else 0
        with _compute(stage), from_position(stage, index):
            return stage(input_ids=packed.input_ids, position_ids=packed.position_ids,  # type: ignore[no-any-return]
                         attention_mask=None, packed_seq_params=packed.packed_seq_params())
    ids = ids.to(device)
    rows, width = ids.shape
    pos = position_ids.to(device) if position_ids is not None else torch.arange(width, device=device)
    context_parallel = int(getattr(stage.config, "context_parallel_size", 1)) > 1
    mask = None if context_parallel else causal_attention_mask(width, device=device)
    with _compute(stage), from_position(stage, output_start):
        return stage(input_ids=ids, position_ids=pos.unsqueeze(0).expand(rows, width),  # type: ignore[no-any-return]
                     attention_mask=mask)


def forward_microbatches(model: nn.Module, input_ids: Sequence[Tensor], *,
                         position_ids: Sequence[Tensor] | None = None,
                         output_starts: Sequence[int] | None = None,
                         packed: Sequence[PackedRows] | None = None) -> list[Tensor]:
    """Each microbatch's logits `[rows, width, vocab / tp]` with gradient, forwarded exactly as `run_microbatches`
    forwards them, for a later `run_microbatches(..., outputs=...)` to backpropagate (PP = 1 only: a pipeline
    stage's forward needs the schedule's activation exchange).

    Why not inside the schedule: Megatron's schedules run each microbatch's backward right after its forward,
    while a loss that needs statistics of every microbatch's logprobs (the decoupled plan's global
    denominators) needs all of the forwards first. The graphs of every microbatch are kept until the
    backward: the memory of one microbatch as large as all of them together.
    """
    if int(getattr(model.config, "pipeline_model_parallel_size", 1)) > 1:
        raise ValueError("forward_microbatches needs pipeline_model_parallel_size = 1")
    positions = list(position_ids) if position_ids is not None else None
    starts = list(output_starts) if output_starts is not None else [0] * len(input_ids)
    packs = _check_packed(packed, len(input_ids), positions)
    with cuda_to_cpu():
        return [_stage_forward(model, ids, positions[i] if positions is not None else None, starts[i],
                               packs[i] if packs is not None else None)
                for i, ids in enumerate(input_ids)]


__all__ = ["LossHook", "configure_schedule", "forward_microbatches", "run_microbatches"]

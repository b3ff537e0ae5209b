"""One training pass at any PP x CP layout, shared by the gloo workers that compare a layout with one rank.

`pipeline_worker` (a dense Llama) and `routing_replay_worker` (a MoE with routing replay) cut the same
microbatches for their CP rank, train them with the same logprob-weighted loss through Megatron's schedule,
and return gradients under global names so a one-rank run is the reference. Runs inside the spawned ranks
(import megatron lazily there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class LayoutShards:
    """This CP rank's share of every microbatch: `inputs[i]` `[rows, local]`, `labels[i]` (CP only),
    `positions[i]` (global token positions `[local]`) and `weights[i]` (loss weight per label position)."""

    inputs: list[torch.Tensor]
    labels: list[torch.Tensor] | None
    positions: list[torch.Tensor]
    weights: list[torch.Tensor]

    @property
    def cp_positions(self) -> list[torch.Tensor] | None:
        """The position ids the schedule needs under CP (None without CP: positions are implicit)."""
        return self.positions if self.labels is not None else None


def shard_microbatches(microbatches: list[torch.Tensor], cp: int, cp_rank: int) -> LayoutShards:
    """Without CP the microbatches as they are; with CP each is padded to a multiple of 2 * cp and cut in
    Megatron's load-balanced layout, its next-token labels cut from the full sequence with the same indices."""
    from nemo_rollout_correction.distributed.context_parallel import cp_token_indices

    inputs, labels, positions, weights = [], [], [], []
    for ids in microbatches:
        width = ids.shape[1]
        weight = torch.linspace(-1.0, 1.0, width - 1)  # a loss whose gradient is not trivial
        if cp == 1:
            inputs.append(ids)
            positions.append(torch.arange(width))
            weights.append(weight)
            continue
        padded = -(-width // (2 * cp)) * 2 * cp
        index = cp_token_indices(padded, cp, cp_rank)
        inputs.append(F.pad(ids, (0, padded - width))[:, index])
        labels.append(F.pad(ids[:, 1:], (0, padded - width + 1))[:, index])
        positions.append(index)
        weights.append(F.pad(weight, (0, padded - width + 1))[index])  # padding: weight 0
    return LayoutShards(inputs, labels if cp > 1 else None, positions, weights)


def train_pass(policy: Any, optim: Any, shards: LayoutShards) -> dict[str, torch.Tensor]:
    """One forward/backward of the logprob-weighted loss through Megatron's schedule on the DDP model.

    Returns DDP's fp32 gradient buffer, finalised (CP sum, tied-embedding sync) at the end of the schedule,
    under global names.
    """
    from nemo_rollout_correction.models.schedule import run_microbatches

    def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
        if shards.labels is None:
            logprobs = policy.logprobs_from_logits(logits, shards.inputs[index])
        else:
            logprobs = policy.label_logprobs(logits, shards.labels[index])
        return (logprobs * shards.weights[index]).sum() / 100.0

    optim.zero_grad()
    run_microbatches(optim.module, shards.inputs, loss, forward_only=False, position_ids=shards.cp_positions)
    return {global_name(policy.model, name): param.main_grad.detach().clone()
            for name, param in policy.model.named_parameters() if param.requires_grad}


def global_name(model: Any, name: str) -> str:
    """A parameter's name with its stage-local layer index replaced by the global one."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        return name
    layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{match.group(2)}"

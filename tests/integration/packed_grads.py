"""The gradient probe shared by the packed-attention and prefix-sharing exactness tests."""

from __future__ import annotations

import torch

from nemo_rollout_correction.models.packing import PackedRows
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import run_microbatches


def sequence_loss_grads(policy: MegatronPolicy, ids: torch.Tensor, packed: PackedRows | None,
                        mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs `[rows, width - 1]` and gradients of a loss with per-row sequence sums (a sequence-level IS-style
    weight per row, row r weighted r + 1), through the padded forward (`packed` None) or the packed one."""
    policy.model.zero_grad(set_to_none=True)
    kept: list[torch.Tensor] = []

    def hook(i: int, logits: torch.Tensor) -> torch.Tensor:
        logprobs = policy.logprobs_from_logits(logits, ids) if packed is None else \
            policy.packed_logprobs(logits, packed)
        kept.append(logprobs.detach())
        seq = (logprobs * mask).sum(-1)  # one sum per row, never per microbatch
        return -(torch.tanh(seq / 10.0) * torch.arange(1.0, ids.shape[0] + 1.0)).sum()

    run_microbatches(policy.model, [ids], hook, forward_only=False, packed=None if packed is None else [packed])
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return kept[0], grads

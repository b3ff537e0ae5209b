"""What the rollout engine returns: `RolloutSample` (one generated sample) and `RolloutBatch` (one `generate` call),
and the batch's training tensors (`RolloutBatch.to_tensors`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RolloutSample:
    """One generated sample."""

    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    routed_experts: Tensor | None = None
    """With routing capture: int16 `[len(prompt) + len(response) - 1, moe_layers, topk]`, the experts vLLM's
    router chose for the token fed at each position (the last sampled token is never fed forward)."""
    origin: tuple[int, int, int, int] | None = None
    """(engine, step, attempt, index in that engine's batch) when the trainer shares the sample without its
    logprobs and routing (`rollout.placement=per_dp_group`): where to fetch them for the rows a rank trains."""
    policy_version: int = 0
    """The trainer version (completed steps) of the weights that generated it; async rollouts set it
    (trainer/async_rollouts.py), the synchronous step leaves 0."""
    turn_ids: list[int] | None = None
    """Multi-turn (rollout/multi_turn.py): per response token, the turn index of a sampled token or -1 for an
    observation token (out of the loss); None for a single-turn sample (every response token is turn 0)."""
    token_versions: list[int] = field(default_factory=list)
    """Partial rollouts (rollout/partial.py): the version that sampled each response token; empty otherwise
    (every token then has `policy_version`)."""
    segments: list[tuple[int, list[int]]] | None = None
    """Multi-turn with a rewritten history (rollout/multi_turn.py): per exact-prefix segment after the first, its
    first response index and the context ids it was sampled from; `multi_turn.split_segments` makes one training
    row of each. None: the response is one segment after the prompt."""


@dataclass
class RolloutBatch:
    """All samples of one `generate` call, in prompt order then sample order (`n` per prompt)."""

    samples: list[RolloutSample]
    n: int
    seconds: float

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_generated_tokens(self) -> int:
        """Total sampled response tokens (multi-turn: observation tokens are not generated and not counted)."""
        return sum(len(s.token_ids) if s.turn_ids is None else sum(t >= 0 for t in s.turn_ids) for s in self.samples)

    def to_tensors(self, pad_token_id: int = 0) -> dict[str, Tensor]:
        """Right-padded training tensors over `[prompt; response]`, aligned to next-token positions.

        Returns (S = samples, L = longest prompt + response):
          input_ids `[S, L]` int64; position t of the `[S, L - 1]` tensors scores `input_ids[:, t + 1]`:
          rollout_logprobs `[S, L - 1]` float32 (0 outside responses, and in every row of a sample shared without
          its logprobs: `logprobs == []`), loss_mask `[S, L - 1]` bool (response tokens), token_versions
          `[S, L - 1]` int64 (the policy version that sampled each response token: `token_versions`, else
          `policy_version`; -1 outside responses),
          response_lengths `[S]`, prompt_lengths `[S]`;
          when any sample is multi-turn (`turn_ids`) also turn_index `[S, L - 1]` int64 (the turn of each sampled
          token, -1 elsewhere) and observation_mask `[S, L - 1]` bool (observation tokens: out of loss_mask);
          with routing capture also routed_experts `[S, L, moe_layers, topk]` int16 (expert ids of the token at
          input position t; -1 where none exists: the last sampled token, padding, and samples shared without
          their routing).
        """
        lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in self.samples]
        width = max(lengths, default=1)
        count = len(self.samples)
        input_ids = torch.full((count, width), pad_token_id, dtype=torch.int64)
        rollout_logprobs = torch.zeros(count, max(width - 1, 0), dtype=torch.float32)
        loss_mask = torch.zeros(count, max(width - 1, 0), dtype=torch.bool)
        token_versions = torch.full((count, max(width - 1, 0)), -1, dtype=torch.int64)
        for row, sample in enumerate(self.samples):
            p, r = len(sample.prompt_token_ids), len(sample.token_ids)
            input_ids[row, :p] = torch.tensor(sample.prompt_token_ids, dtype=torch.int64)
            if r:
                input_ids[row, p:p + r] = torch.tensor(sample.token_ids, dtype=torch.int64)
                if sample.token_versions and len(sample.token_versions) != r:
                    raise ValueError(f"sample {row}: {len(sample.token_versions)} token versions for {r} tokens")
                versions = sample.token_versions or [sample.policy_version] * r
                token_versions[row, p - 1:p - 1 + r] = torch.tensor(versions, dtype=torch.int64)
                if sample.logprobs:  # empty: shared without them (another data-parallel group trains this row)
                    rollout_logprobs[row, p - 1:p - 1 + r] = torch.tensor(sample.logprobs, dtype=torch.float32)
                loss_mask[row, p - 1:p - 1 + r] = True
                if sample.turn_ids is not None:  # multi-turn: observation tokens leave the loss
                    turns = torch.tensor(sample.turn_ids, dtype=torch.int64)
                    loss_mask[row, p - 1:p - 1 + r] = turns >= 0
                    rollout_logprobs[row, p - 1:p - 1 + r].masked_fill_(turns < 0, 0.0)
        out = {
            "input_ids": input_ids,
            "rollout_logprobs": rollout_logprobs,
            "loss_mask": loss_mask,
            "token_versions": token_versions,
            "response_lengths": torch.tensor([len(s.token_ids) for s in self.samples], dtype=torch.int64),
            "prompt_lengths": torch.tensor([len(s.prompt_token_ids) for s in self.samples], dtype=torch.int64),
        }
        if any(s.turn_ids is not None for s in self.samples):
            out["turn_index"], out["observation_mask"] = _turn_tensors(self.samples, loss_mask.shape)
        tables = [s.routed_experts for s in self.samples if s.routed_experts is not None]
        if tables:
            table = torch.full((count, width, *tables[0].shape[1:]), -1, dtype=torch.int16)
            for row, sample in enumerate(self.samples):
                if sample.routed_experts is not None:
                    table[row, : sample.routed_experts.shape[0]] = sample.routed_experts
            out["routed_experts"] = table
        return out


def _turn_tensors(samples: Sequence[RolloutSample], shape: torch.Size) -> tuple[Tensor, Tensor]:
    """`turn_index` `[S, L - 1]` int64 (turn of each sampled token, -1 elsewhere) and `observation_mask`."""
    turn_index = torch.full(shape, -1, dtype=torch.int64)
    observation = torch.zeros(shape, dtype=torch.bool)
    for row, sample in enumerate(samples):
        p, r = len(sample.prompt_token_ids), len(sample.token_ids)
        turns = torch.tensor(sample.turn_ids if sample.turn_ids is not None else [0] * r, dtype=torch.int64)
        turn_index[row, p - 1:p - 1 + r] = turns
        observation[row, p - 1:p - 1 + r] = turns < 0
    return turn_index, observation


__all__ = ["RolloutBatch", "RolloutSample"]

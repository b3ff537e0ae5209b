"""The rollout-corrected loss as a Megatron-Core loss function, on CPU with generated data.

Run in one process, or as data parallel ranks on gloo:

    python examples/rollout_corrected_loss_megatron.py --preset decoupled_seq_is_rs
    torchrun --nproc-per-node 2 examples/rollout_corrected_loss_megatron.py

Megatron-Core is not needed: this script plays the part of Megatron's schedule with
`calculate_per_token_loss=True` (backward of each microbatch's `loss_sum`, `num_tokens` summed,
all-reduced over dp x cp, gradients scaled by 1 / total). With Megatron-Core the same loss
function is what `forward_step` returns:

    def forward_step(data_iterator, model):
        batch = next(data_iterator)                   # this rank's CP shard
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)   # no labels
        return logits, make_megatron_loss_func(batch.loss_batch, loss, groups, sink=sink)

    groups = ParallelGroups.from_megatron()
    get_forward_backward_func()(forward_step_func=forward_step, ..., forward_only=False)
    metrics = reduce_step_metrics([m.partials for m in sink], loss.rc_cfg, groups)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed import ParallelGroups, build_parallel_groups, reduce_step_metrics
from nemo_rollout_correction.losses import MegatronLossBatch, MicrobatchLoss, RolloutCorrectedPolicyLoss
from nemo_rollout_correction.losses.megatron import REPORT_KEY, make_megatron_loss_func

VOCAB, HIDDEN, SEQ = 32, 16, 24


class TinyLM(torch.nn.Module):
    """A stand-in policy: embedding, one MLP, vocabulary head -> `[batch, seq, VOCAB]` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.mlp(self.embed(tokens)))
        return logits


def rollout_batch(rows: int, seed: int, model: TinyLM) -> dict[str, torch.Tensor]:
    """Generated rollouts: inputs, sampled next tokens, vLLM-like logprobs (noisy, one NaN), masks."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    with torch.no_grad():  # pi_old: the trainer's re-scoring pass before the update
        old = torch.log_softmax(model(tokens), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    rollout = old + 0.1 * torch.randn(rows, SEQ, generator=gen)  # vLLM disagrees a little
    rollout[0, 3] = float("nan")  # and sometimes returns garbage
    lengths = torch.randint(4, SEQ + 1, (rows,), generator=gen)
    mask = torch.arange(SEQ) < lengths[:, None]
    return {"tokens": tokens, "targets": targets, "old": old, "rollout": rollout, "mask": mask,
            "advantages": torch.randn(rows, generator=gen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="decoupled_token_is", help="rollout correction preset")
    parser.add_argument("--loss-agg-mode", default="token-mean")
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4, help="sequences per microbatch")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
        groups = build_parallel_groups(dp=dist.get_world_size())
        assert groups is not None
    else:
        groups = ParallelGroups.single()
    torch.manual_seed(0)
    model = TinyLM()  # same initial weights on every rank

    loss = RolloutCorrectedPolicyLoss(RolloutCorrectionConfig.from_preset(args.preset),
                                      PolicyLossConfig(loss_agg_mode=args.loss_agg_mode))
    data = [rollout_batch(args.rows, seed=1000 * groups.dp_rank + i, model=model) for i in range(args.microbatches)]

    # Decoupled mode: correct every microbatch first and reduce the step once (exact denominators,
    # the global IS mean for batch normalisation); the loss functions reuse these corrections.
    corrections = [loss.correct(mb["old"], mb["rollout"], mb["mask"], groups) for mb in data] \
        if not loss.rc_cfg.bypass_mode else [None] * len(data)
    if not loss.rc_cfg.bypass_mode:
        loss.prepare_step([c for c in corrections if c is not None], groups)

    # --- what Megatron's schedule does with calculate_per_token_loss=True ---
    sink: list[MicrobatchLoss] = []
    total_tokens = torch.zeros((), dtype=torch.int)
    report_sum = torch.zeros(2)
    for mb, correction in zip(data, corrections, strict=True):
        batch = MegatronLossBatch(rollout_logprobs=mb["rollout"], advantages=mb["advantages"], loss_mask=mb["mask"],
                                  old_logprobs=mb["old"], target_ids=mb["targets"], correction=correction)
        loss_func = make_megatron_loss_func(batch, loss, groups, sink=sink)
        output_tensor = model(mb["tokens"])  # forward_step
        loss_sum, num_tokens, report = loss_func(output_tensor)
        loss_sum.backward()  # backward_step: unscaled
        total_tokens += num_tokens
        report_sum += report[REPORT_KEY]
    # finalize_model_grads: DDP sums gradients over dp x cp, num_tokens is all-reduced, grads / total
    if groups.dp_cp_size > 1:
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad, group=groups.dp_cp_group)
        dist.all_reduce(total_tokens, group=groups.dp_cp_group)
        dist.all_reduce(report_sum, group=groups.dp_cp_group)
    for param in model.parameters():
        assert param.grad is not None
        param.grad /= total_tokens.clamp(min=1)

    metrics = reduce_step_metrics([m.partials for m in sink], loss.rc_cfg, groups)
    if groups.dp_cp_rank == 0:
        grad_norm = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).norm()
        print(f"preset={args.preset} ranks={groups.dp_cp_size} microbatches/rank={args.microbatches}")
        print(f"loss {float(report_sum[0] / report_sum[1].clamp(min=1)):.6f}  "
              f"num_tokens {int(total_tokens)}  grad_norm {float(grad_norm):.6f}")
        for name in sorted(metrics):
            if name.startswith("rollout_corr/"):
                print(f"{name} {metrics[name]:.6g}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

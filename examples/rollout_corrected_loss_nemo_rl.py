"""The rollout-corrected loss through the NeMo-RL loss-function interface, on CPU with generated data.

    python examples/rollout_corrected_loss_nemo_rl.py --preset decoupled_token_is

NeMo-RL is not needed: the microbatches are plain dicts with the keys of NeMo-RL's
`BatchedDataDict` (`input_ids`, `generation_logprobs`, `prev_logprobs`, `advantages`,
`token_mask`, `sample_mask`, each `[batch, seq]` with the prompt's first position included), and
the adapter is called the way NeMo-RL's policy worker calls a loss function. In NeMo-RL itself:

    loss_fn = NeMoRLRolloutCorrectedLoss(RolloutCorrectionConfig.from_preset("decoupled_token_is"))
    policy.train(train_data, loss_fn)      # in place of ClippedPGLossFn

The step pre-pass (`loss_fn.loss.correct` + `prepare_step`) is optional: without it the adapter
divides by NeMo-RL's `global_valid_toks` (rejected tokens stay in the denominator); with it, by the
kept-token count (docs/design.md decision 2). This script shows both.
"""

from __future__ import annotations

import argparse

import torch

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.losses import NeMoRLRolloutCorrectedLoss, StepDenominators, nemo_rl_inputs

VOCAB, SEQ, ROWS = 32, 20, 6


def microbatch(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A NeMo-RL-shaped microbatch and the model's logits `[ROWS, SEQ, VOCAB]` (with gradient)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, SEQ, VOCAB, generator=gen).requires_grad_(True)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    with torch.no_grad():  # pi_old at position t scores token t (predicted by the logits at t - 1)
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    prev = torch.cat([torch.zeros(ROWS, 1), lp + 0.02 * torch.randn(ROWS, SEQ - 1, generator=gen)], 1)
    generation = prev + 0.1 * torch.randn(ROWS, SEQ, generator=gen)
    prompt = torch.randint(2, 6, (ROWS,), generator=gen)
    token_mask = (torch.arange(SEQ) >= prompt[:, None]).float()  # response tokens
    data = {
        "input_ids": input_ids,
        "generation_logprobs": generation,
        "prev_logprobs": prev,
        "advantages": torch.randn(ROWS, 1, generator=gen).expand(ROWS, SEQ),
        "token_mask": token_mask,
        "sample_mask": torch.ones(ROWS),
    }
    return data, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="decoupled_seq_is_rs")
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()

    cfg = RolloutCorrectionConfig.from_preset(args.preset)
    loss_fn = NeMoRLRolloutCorrectedLoss(cfg)
    batches = [microbatch(seed) for seed in range(args.microbatches)]
    # NeMo-RL's global counts, computed from the masks before the loss (one process here).
    global_valid_toks = sum(float((d["token_mask"][:, 1:] * d["sample_mask"][:, None]).sum()) for d, _ in batches)
    global_valid_seqs = sum(float(d["sample_mask"].sum()) for d, _ in batches)

    for label, use_prepass in (("NeMo-RL denominators", False), ("kept-token denominators", True)):
        loss_fn.clear_step()
        if use_prepass:  # decoupled mode: pi_old exists before the update, so the pre-pass is cheap
            corrections = []
            for data, logits in batches:
                inputs = nemo_rl_inputs(data, bypass_mode=cfg.bypass_mode)
                with torch.no_grad():
                    current = torch.log_softmax(logits[:, :-1], -1).gather(
                        -1, inputs["target_ids"].unsqueeze(-1)).squeeze(-1)
                reference = current if cfg.bypass_mode else inputs["old_logprobs"]
                corrections.append(loss_fn.loss.correct(reference, inputs["rollout_logprobs"], inputs["loss_mask"],
                                                        loss_fn.groups))
            step = loss_fn.loss.prepare_step(corrections, loss_fn.groups)
            loss_fn.set_step_denominators(StepDenominators.from_step(step))
        total = 0.0
        for data, logits in batches:
            logits.grad = None
            loss, metrics = loss_fn(data=data, global_valid_seqs=torch.tensor(global_valid_seqs),
                                    global_valid_toks=torch.tensor(global_valid_toks), logits=logits)
            loss.backward()
            total += metrics["loss"]
        override = loss_fn.step_denominators
        denominator = global_valid_toks if override is None else override.num_global_tokens
        print(f"[{label}] preset={args.preset} loss {total:.6f} (denominator {denominator:g})")
    metrics = loss_fn.reduce_metrics()
    for name in sorted(metrics):
        if name.startswith("rollout_corr/"):
            print(f"{name} {metrics[name]:.6g}")


if __name__ == "__main__":
    main()

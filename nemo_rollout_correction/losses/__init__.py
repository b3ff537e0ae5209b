"""Loss modules: the rollout-corrected policy loss of a microbatch shard and its two adapters.

- `rollout_corrected_pg`: `RolloutCorrectedPolicyLoss` (correction + policy loss + global
  normalisation on this rank's TP/CP shard) and the step pre-pass that yields the denominators;
- `megatron`: a Megatron-Core `forward_step` loss function returning `(loss_sum, num_tokens,
  report)` with per-token-loss semantics (megatron is never imported);
- `nemo_rl`: an adapter with NeMo-RL's loss-function call signature.

See docs/losses.md for how the loss denominator is obtained before the first backward.
"""

from nemo_rollout_correction.losses.megatron import (
    MegatronLossBatch,
    MegatronLossFunc,
    make_megatron_loss_func,
    output_to_logprobs,
)
from nemo_rollout_correction.losses.nemo_rl import NeMoRLRolloutCorrectedLoss, nemo_rl_inputs
from nemo_rollout_correction.losses.rollout_corrected_pg import (
    MicrobatchLoss,
    RolloutCorrectedPolicyLoss,
    StepDenominators,
    rejection_is_predictable,
)

__all__ = [
    "MegatronLossBatch",
    "MegatronLossFunc",
    "MicrobatchLoss",
    "NeMoRLRolloutCorrectedLoss",
    "RolloutCorrectedPolicyLoss",
    "StepDenominators",
    "make_megatron_loss_func",
    "nemo_rl_inputs",
    "output_to_logprobs",
    "rejection_is_predictable",
]

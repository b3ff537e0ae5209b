"""The distributed layer: the only package that uses torch.distributed (docs/design.md, "Layers").

- `groups`: the TP / CP / DP / DP x CP process groups (from Megatron-Core or built directly);
- `context_parallel`: Megatron's CP token layouts (also packed THD) and the per-sequence reduction
  over CP;
- `reduce`: fused all-reduce of metric partials over dp x cp;
- `correction`: rollout correction of a microbatch on a CP shard, and the step reduction
  (loss denominators, global IS mean, non-finite checks, metrics);
- `vocab_parallel`: logprobs of the sampled tokens from TP-sharded logits (temperature / top-k / top-p
  replayed across shards), with autograd;
- `pipeline`: step-level exchanges between pipeline stages;
- `tensor_gather`: TP parameter shards gathered into full tensors (weight refit);
- `runtime`: process-group set-up (torchrun or one process) and the few step-level collectives the
  trainer needs;
- `cpu_compat`: Megatron-Core's CPU-capable code paths on machines without CUDA;
- `dcp_metadata`: torch.distributed.checkpoint's metadata types, for the trainer's data-only checkpoint checks.

See docs/reduction_contract.md for what is reduced over which group and what it costs.
"""

from nemo_rollout_correction.distributed.context_parallel import (
    CP_LAYOUTS,
    CpLayout,
    GatheredSequences,
    PackedSequences,
    cp_token_indices,
    gather_sequence_partials,
    shard_sequence,
    thd_token_indices,
    unshard_sequence,
)
from nemo_rollout_correction.distributed.correction import (
    MicrobatchCorrection,
    StepReduction,
    distributed_rollout_correction,
    metric_schema,
    reduce_step,
    reduce_step_metrics,
    reduce_step_partials,
)
from nemo_rollout_correction.distributed.groups import ParallelGroups, build_parallel_groups
from nemo_rollout_correction.distributed.reduce import PartialsSchema, all_gather_flat, all_reduce_partials
from nemo_rollout_correction.distributed.vocab_parallel import SamplingReplay, support_counts, vocab_parallel_logprobs

__all__ = [
    "CP_LAYOUTS",
    "CpLayout",
    "GatheredSequences",
    "MicrobatchCorrection",
    "PackedSequences",
    "ParallelGroups",
    "PartialsSchema",
    "SamplingReplay",
    "StepReduction",
    "all_gather_flat",
    "all_reduce_partials",
    "build_parallel_groups",
    "cp_token_indices",
    "distributed_rollout_correction",
    "gather_sequence_partials",
    "metric_schema",
    "reduce_step",
    "reduce_step_metrics",
    "reduce_step_partials",
    "shard_sequence",
    "support_counts",
    "thd_token_indices",
    "unshard_sequence",
    "vocab_parallel_logprobs",
]

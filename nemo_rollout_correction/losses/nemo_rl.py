"""An adapter that plugs the rollout-corrected policy loss into NeMo-RL's loss-function interface.

NeMo-RL (`nemo_rl/algorithms/loss/interfaces.py`) calls a loss function once per microbatch as
`loss_fn(..., data, global_valid_seqs, global_valid_toks, ...)` and expects `(loss, metrics)`;
`loss` is already divided by the global count (NeMo-RL sums the microbatch losses). Two call
conventions exist across NeMo-RL versions, and `NeMoRLRolloutCorrectedLoss.__call__` accepts both
(duck-typed: NeMo-RL is not a dependency):

- older workers: `loss_fn(next_token_logits, data, global_valid_seqs, global_valid_toks,
  vocab_parallel_rank=..., vocab_parallel_group=..., context_parallel_group=...)`;
- newer ones dispatch on `loss_fn.input_type`: with `LossInputType.LOGIT` (this adapter's) they
  call `loss_fn(data=..., global_valid_seqs=..., global_valid_toks=..., logits=...)`; a
  precomputed `next_token_logprobs=` is accepted as well.

Logits may be TP-sharded over the vocabulary (`[batch, seq, V / tp]`); the logprobs of the sampled
tokens come from `distributed.vocab_parallel_logprobs` over the TP group (fp32, exact gradient).

Field mapping (NeMo-RL's `BatchedDataDict` keys are `[batch, seq]` over the whole token sequence;
position t of the logits predicts token t + 1, so every per-token key is read from position 1 on):

| NeMo-RL key | here |
|---|---|
| `input_ids[:, 1:]` | target ids of the logprobs |
| `generation_logprobs[:, 1:]` | `rollout_logprobs` (pi_rollout, vLLM) |
| `prev_logprobs[:, 1:]` | `old_logprobs` (pi_old; unused in bypass mode) |
| `advantages[:, 1:]` | `advantages` |
| `token_mask[:, 1:] & sample_mask[:, None]` | `loss_mask` |

Denominators: NeMo-RL computes `global_valid_toks` / `global_valid_seqs` before the loss from the
masks alone (summed over the step's microbatches and DP ranks). Used as given, tokens and
sequences that rollout correction rejects stay in the denominator: NeMo-RL's convention, equal to
`rejected_tokens_in_denominator=True`. For docs/design.md decision 2 (rejected tokens leave the
denominator) run the pre-pass of `RolloutCorrectedPolicyLoss` (`correct` + `prepare_step`) and
hand the result to `set_step_denominators`; it then overrides NeMo-RL's counts until cleared.

Context parallelism is not handled by this adapter (NeMo-RL gathers CP logits itself in its
LOGPROB path); use `RolloutCorrectedPolicyLoss` or the Megatron adapter for CP shards.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed.correction import reduce_step_metrics
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs
from nemo_rollout_correction.losses.rollout_corrected_pg import (
    MicrobatchLoss,
    RolloutCorrectedPolicyLoss,
    StepDenominators,
)

if TYPE_CHECKING:  # the distributed layer owns torch.distributed; only the type is named here
    from torch.distributed import ProcessGroup

__all__ = ["NEMO_RL_KEYS", "LossInputType", "LossType", "NeMoRLRolloutCorrectedLoss", "nemo_rl_inputs"]


class LossType(enum.Enum):
    """Mirror of NeMo-RL's `LossType` (same values); NeMo-RL's own enum is used when importable."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(enum.Enum):
    """Mirror of NeMo-RL's `LossInputType` (the values this adapter needs)."""

    LOGIT = "logit"
    LOGPROB = "logprob"


NEMO_RL_KEYS: dict[str, str] = {
    "generation_logprobs": "rollout_logprobs",
    "prev_logprobs": "old_logprobs",
    "advantages": "advantages",
    "token_mask": "loss_mask (with sample_mask)",
    "sample_mask": "loss_mask (per sequence)",
    "input_ids": "target ids",
}
"""NeMo-RL data keys and the names they map to here."""


def _nemo_rl_enums() -> tuple[Any, Any]:
    """NeMo-RL's (LossType, LossInputType) when installed (so its `==` checks pass), else mirrors."""
    for module in ("nemo_rl.algorithms.loss.interfaces", "nemo_rl.algorithms.interfaces"):
        try:
            imported = __import__(module, fromlist=["LossType"])
        except ImportError:
            continue
        loss_type = getattr(imported, "LossType", LossType)
        input_type = getattr(imported, "LossInputType", LossInputType)
        return loss_type, input_type
    return LossType, LossInputType


def nemo_rl_inputs(data: Mapping[str, Tensor], *, bypass_mode: bool) -> dict[str, Tensor]:
    """Our named `[batch, seq - 1]` inputs from a NeMo-RL microbatch `[batch, seq]` (see the table).

    Returns `target_ids`, `rollout_logprobs`, `advantages`, `loss_mask` (bool) and, unless
    `bypass_mode`, `old_logprobs`. Raises KeyError naming a missing key.
    """
    def need(key: str) -> Tensor:
        if key not in data:
            raise KeyError(f"NeMo-RL microbatch has no {key!r} (maps to {NEMO_RL_KEYS.get(key, key)}); "
                           f"keys present: {sorted(data)}")
        return data[key]

    token_mask = need("token_mask")[:, 1:] != 0
    sample_mask = need("sample_mask").reshape(-1, 1) != 0
    out = {
        "target_ids": need("input_ids")[:, 1:],
        "rollout_logprobs": need("generation_logprobs")[:, 1:].float(),
        "advantages": need("advantages")[:, 1:].float(),
        "loss_mask": token_mask & sample_mask,
    }
    if not bypass_mode:
        out["old_logprobs"] = need("prev_logprobs")[:, 1:].float()
    return out


class NeMoRLRolloutCorrectedLoss:
    """Rollout-corrected policy loss with NeMo-RL's loss-function interface (duck-typed).

    rc_cfg, loss_cfg: as `RolloutCorrectedPolicyLoss`; `loss_cfg.loss_agg_mode` must be
        `token-mean` (NeMo-RL `TOKEN_LEVEL`) or `seq-mean-token-mean` (`SEQUENCE_LEVEL`), the two
        reductions NeMo-RL's denominators describe.
    groups: this rank's groups (TP for the vocab-parallel logprob, CP must be 1, dp x cp for
        `reduce_metrics`); default one process. A `vocab_parallel_group` passed by NeMo-RL at call
        time takes precedence for the logprob.
    temperature, top_k, top_p, vocab_size: vLLM's sampler to replay on the logits.

    Attributes NeMo-RL reads: `loss_type`, `input_type`. After each call the microbatch's
    `MicrobatchLoss` is kept in `step_losses` for `reduce_metrics` (call `clear_step` per step).
    """

    def __init__(self, rc_cfg: RolloutCorrectionConfig, loss_cfg: PolicyLossConfig | None = None, *,
                 groups: ParallelGroups | None = None, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, vocab_size: int | None = None) -> None:
        self.loss = RolloutCorrectedPolicyLoss(rc_cfg, loss_cfg)
        if self.loss.agg_mode not in ("token-mean", "seq-mean-token-mean"):
            raise ValueError(f"loss_agg_mode {self.loss.agg_mode!r} has no NeMo-RL equivalent: use 'token-mean' "
                             "(TOKEN_LEVEL) or 'seq-mean-token-mean' (SEQUENCE_LEVEL)")
        self.groups = groups or ParallelGroups.single()
        if self.groups.cp_size > 1:
            raise ValueError("the NeMo-RL adapter does not take CP shards; use RolloutCorrectedPolicyLoss or the "
                             "Megatron adapter under context parallelism")
        loss_type_enum, input_type_enum = _nemo_rl_enums()
        self.loss_type = (loss_type_enum.TOKEN_LEVEL if self.loss.counts_tokens
                          else loss_type_enum.SEQUENCE_LEVEL)
        self.input_type = input_type_enum.LOGIT
        self.temperature, self.top_k, self.top_p, self.vocab_size = temperature, top_k, top_p, vocab_size
        self.step_denominators: StepDenominators | None = None
        self.step_losses: list[MicrobatchLoss] = []

    def set_step_denominators(self, denominators: StepDenominators | None) -> None:
        """Use these post-rejection counts instead of NeMo-RL's `global_valid_*` (None: back to NeMo-RL's)."""
        self.step_denominators = denominators

    def clear_step(self) -> None:
        """Forget the kept microbatch results and the denominator override (start of a step)."""
        self.step_losses = []
        self.step_denominators = None

    def reduce_metrics(self) -> dict[str, float]:
        """The step's `rollout_corr/<name>` metrics over dp x cp (one fused all-reduce; every rank calls)."""
        return reduce_step_metrics([m.partials for m in self.step_losses], self.loss.rc_cfg, self.groups)

    def __call__(
        self,
        next_token_logits: Tensor | None = None,
        data: Mapping[str, Tensor] | None = None,
        global_valid_seqs: Tensor | float | None = None,
        global_valid_toks: Tensor | float | None = None,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: ProcessGroup | None = None,
        context_parallel_group: ProcessGroup | None = None,
        *,
        logits: Tensor | None = None,
        next_token_logprobs: Tensor | None = None,
        **_: Any,
    ) -> tuple[Tensor, dict[str, Any]]:
        """Loss and metrics of one NeMo-RL microbatch.

        next_token_logits / logits: `[batch, seq, V / tp]` (this TP rank's vocabulary shard;
            position t predicts token t + 1). Or next_token_logprobs: `[batch, seq - 1]`.
        data: the microbatch (`[batch, seq]` keys of the mapping table; `sample_mask` `[batch]`).
        global_valid_seqs, global_valid_toks: NeMo-RL's step denominators (see the module doc).
        vocab_parallel_rank: unused (the rank in `vocab_parallel_group` gives the vocab offset).
        context_parallel_group: must be None or of size 1.

        Returns `(loss, metrics)`: `loss` 0-dim, divided by the global count; `metrics` holds
        `loss` and local counts as floats (`reduce_metrics` gives the exact step metrics).
        """
        del vocab_parallel_rank
        if data is None:
            raise ValueError("data (the NeMo-RL microbatch) is required")
        if context_parallel_group is not None and context_parallel_group.size() > 1:
            raise ValueError("the NeMo-RL adapter does not take CP shards (context_parallel_group of size > 1)")
        cfg = self.loss.rc_cfg
        inputs = nemo_rl_inputs(data, bypass_mode=cfg.bypass_mode)
        logits = next_token_logits if next_token_logits is not None else logits
        if next_token_logprobs is not None:
            logprobs = next_token_logprobs.float()
        elif logits is not None:
            tp_group = vocab_parallel_group if vocab_parallel_group is not None else self.groups.tp_group
            logprobs = vocab_parallel_logprobs(logits[:, :-1], inputs["target_ids"], tp_group,
                                               vocab_size=self.vocab_size, temperature=self.temperature,
                                               top_k=self.top_k, top_p=self.top_p)
        else:
            raise ValueError("pass next_token_logits / logits ([batch, seq, V / tp]) or next_token_logprobs")

        denominators = self.step_denominators
        if denominators is None:
            denominators = StepDenominators(
                num_global_tokens=_as_float(global_valid_toks, "global_valid_toks"),
                num_global_seqs=_as_float(global_valid_seqs, "global_valid_seqs"),
            )
        result = self.loss(logprobs, inputs["rollout_logprobs"], inputs["advantages"], inputs["loss_mask"],
                           self.groups, denominators, old_logprobs=inputs.get("old_logprobs"))
        self.step_losses.append(result)
        metrics: dict[str, Any] = {
            "loss": float(result.loss.detach()),
            "num_valid_tokens": float(inputs["loss_mask"].sum()),
            "num_kept_tokens": float(result.correction.keep_mask.sum()),
            "num_valid_samples": float(inputs["loss_mask"].any(dim=-1).sum()),
        }
        return result.loss, metrics


def _as_float(value: Tensor | float | None, name: str) -> float:
    if value is None:
        raise ValueError(f"{name} is required unless set_step_denominators() was called")
    return float(value.detach().reshape(()) if isinstance(value, Tensor) else value)

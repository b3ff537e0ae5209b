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

Process groups are taken at construction (`groups=`): NeMo-RL's current dispatch passes only
`logits=`, no TP group, so a TP > 1 worker must construct the adapter with its TP group. DTensor
logits (NeMo-RL's DTensor worker at TP > 1) carry their own mesh: a vocabulary-sharded DTensor is
computed on its local shard over the mesh dimension's group (`distributed.dtensor`); any other
placement raises a ValueError naming it. Plain-tensor logits narrower than `vocab_size` with no TP
group raise instead of silently normalising over a vocabulary shard.

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

NeMo-RL's split train path (Megatron worker `train_step` / `finish_train_step`) calls the loss with
placeholder `global_valid_* = 1` and divides the summed gradient by its own global mask counts N
after the step. With `set_step_denominators` our loss already divides by our counts, so construct
the adapter with `split_train_path=True` and pass NeMo-RL's step counts as `worker_denominators`:
the returned loss is then `loss_sum / N_ours * N_worker`, and after NeMo-RL's division the gradient
is divided exactly once, by N_ours. A placeholder call while an override is set and the flag is off
raises instead of normalising twice.

Exact NeMo-RL parity (`rejected_tokens_in_denominator=True`): NeMo-RL's `SEQUENCE_LEVEL` loss averages
each sequence over all its `token_mask` tokens, including those a mask rejects
(`loss_functions.py`, masked_mean over token_mask per sequence). The adapter then divides each
sequence by its denominator tokens (finite loss tokens of a usable sequence) instead of its kept
tokens, which reproduces NeMo-RL's loss and gradient (up to NeMo-RL's `+ 1e-8` in masked_mean).
`RolloutCorrectedPolicyLoss` itself keeps dividing by kept tokens.

Context parallelism is not handled by this adapter (NeMo-RL gathers CP logits itself in its
LOGPROB path); use `RolloutCorrectedPolicyLoss` or the Megatron adapter for CP shards.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed.correction import MicrobatchCorrection, reduce_step_metrics
from nemo_rollout_correction.distributed.dtensor import vocab_shard_of
from nemo_rollout_correction.distributed.groups import ParallelGroups, ProcessGroup
from nemo_rollout_correction.distributed.vocab_parallel import vocab_parallel_logprobs
from nemo_rollout_correction.losses.rollout_corrected_pg import (
    MicrobatchLoss,
    RolloutCorrectedPolicyLoss,
    StepDenominators,
)

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
    groups: this rank's groups, taken here because NeMo-RL's current dispatch passes none (TP for
        the vocab-parallel logprob, CP must be 1, dp x cp for `reduce_metrics`); default one
        process. A `vocab_parallel_group` passed by an older NeMo-RL worker at call time, or the
        mesh group of DTensor logits, takes precedence for the logprob.
    temperature, top_k, top_p, vocab_size: vLLM's sampler to replay on the logits.
    split_train_path: NeMo-RL's split train API divides the gradient by its own global count after
        the step (see the module doc); needs `worker_denominators` with `set_step_denominators`.

    Attributes NeMo-RL reads: `loss_type`, `input_type`. After each call the microbatch's
    `MicrobatchLoss` is kept in `step_losses` for `reduce_metrics` (call `clear_step` per step).
    """

    def __init__(self, rc_cfg: RolloutCorrectionConfig, loss_cfg: PolicyLossConfig | None = None, *,
                 groups: ParallelGroups | None = None, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, vocab_size: int | None = None, split_train_path: bool = False) -> None:
        if rc_cfg.needs_step_thresholds:  # NeMo-RL calls the loss per microbatch, with no step pre-pass to resolve it
            raise ValueError("m2po_threshold / rollout_is_target_ess choose a threshold from the whole step, which the "
                             "NeMo-RL adapter never sees; use RolloutCorrectedPolicyLoss (for_step) or set them null")
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
        self.split_train_path = split_train_path
        self.step_denominators: StepDenominators | None = None
        self.worker_denominators: StepDenominators | None = None
        self.step_losses: list[MicrobatchLoss] = []

    def set_step_denominators(self, denominators: StepDenominators | None, *,
                              worker_denominators: StepDenominators | None = None) -> None:
        """Use these post-rejection counts instead of NeMo-RL's `global_valid_*` (None: back to NeMo-RL's).

        worker_denominators: with `split_train_path`, NeMo-RL's own global counts of the step
        (`global_valid_toks` / `global_valid_seqs`, the N it divides the gradient by afterwards).
        """
        if denominators is not None and self.split_train_path and worker_denominators is None:
            raise ValueError("split_train_path=True: NeMo-RL divides the gradient by its own global count after the "
                             "step, so pass worker_denominators= (its global_valid_toks / global_valid_seqs) to "
                             "cancel it, or construct the adapter with split_train_path=False")
        self.step_denominators = denominators
        self.worker_denominators = worker_denominators if denominators is not None else None

    def clear_step(self) -> None:
        """Forget the kept microbatch results and the denominator override (start of a step)."""
        self.step_losses = []
        self.step_denominators = None
        self.worker_denominators = None

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
            logprobs = self._logprobs(logits, inputs["target_ids"], vocab_parallel_group)
        else:
            raise ValueError("pass next_token_logits / logits ([batch, seq, V / tp]) or next_token_logprobs")

        denominators = self.step_denominators
        scale = 1.0
        if denominators is None:
            denominators = StepDenominators(
                num_global_tokens=_as_float(global_valid_toks, "global_valid_toks"),
                num_global_seqs=_as_float(global_valid_seqs, "global_valid_seqs"),
            )
        elif self.split_train_path:
            assert self.worker_denominators is not None  # set_step_denominators enforces it
            worker = self.worker_denominators
            scale = worker.num_global_tokens if self.loss.counts_tokens else worker.num_global_seqs
        elif _is_placeholder(global_valid_toks) and _is_placeholder(global_valid_seqs):
            ours = denominators.num_global_tokens if self.loss.counts_tokens else denominators.num_global_seqs
            if ours > 1:
                raise ValueError("called with placeholder global_valid_* = 1 (NeMo-RL's split train path, which "
                                 "divides the gradient by its own count after the step) while set_step_denominators "
                                 "is active: that would normalise twice; construct the adapter with "
                                 "split_train_path=True and pass worker_denominators")
        correction = self._nemo_rl_correction(logprobs, inputs, denominators)
        result = self.loss(logprobs, inputs["rollout_logprobs"], inputs["advantages"], inputs["loss_mask"],
                           self.groups, denominators, old_logprobs=inputs.get("old_logprobs"), correction=correction)
        if scale != 1.0:
            result.loss = result.loss * scale
        self.step_losses.append(result)
        metrics: dict[str, Any] = {
            "loss": float(result.loss.detach()),
            "num_valid_tokens": float(inputs["loss_mask"].sum()),
            "num_kept_tokens": float(result.correction.keep_mask.sum()),
            "num_valid_samples": float(inputs["loss_mask"].any(dim=-1).sum()),
        }
        return result.loss, metrics


    def _logprobs(self, logits: Tensor, target_ids: Tensor, vocab_parallel_group: ProcessGroup | None) -> Tensor:
        """Sampled-token logprobs `[batch, seq - 1]` from plain or DTensor logits `[batch, seq, V / tp]`."""
        shard = vocab_shard_of(logits)
        tp_group = shard.group
        if tp_group is None:
            tp_group = vocab_parallel_group if vocab_parallel_group is not None else self.groups.tp_group
        local = shard.logits
        if (shard.group is None and vocab_parallel_group is None and self.groups.tp_size == 1
                and self.vocab_size is not None and local.shape[-1] < self.vocab_size):
            raise ValueError(f"logits hold {local.shape[-1]} vocabulary columns, fewer than vocab_size="
                             f"{self.vocab_size}, but the adapter has no TP group: NeMo-RL passes none at call "
                             "time, so construct it with groups= carrying the worker's TP group")
        return vocab_parallel_logprobs(local[:, :-1], target_ids, tp_group, vocab_start=shard.vocab_start,
                                       vocab_size=self.vocab_size, temperature=self.temperature, top_k=self.top_k,
                                       top_p=self.top_p)

    def _nemo_rl_correction(self, logprobs: Tensor, inputs: dict[str, Tensor],
                            denominators: StepDenominators) -> MicrobatchCorrection | None:
        """The correction, with NeMo-RL's per-sequence divisor where it differs from ours (else None).

        With `rejected_tokens_in_denominator` and `seq-mean-token-mean`, NeMo-RL divides each sequence by
        all its mask tokens, rejected ones included: here the denominator tokens of the sequence (this
        adapter holds whole sequences, cp = 1).
        """
        cfg = self.loss.rc_cfg
        if not (cfg.rejected_tokens_in_denominator and self.loss.agg_mode == "seq-mean-token-mean"):
            return None
        if cfg.rollout_is_batch_normalize and denominators.is_weight_mean is None:
            return None  # the loss raises its own error about the missing global mean
        judged = logprobs.detach() if cfg.bypass_mode else inputs["old_logprobs"]
        correction = self.loss.correct(judged, inputs["rollout_logprobs"], inputs["loss_mask"], self.groups,
                                       is_weight_mean=denominators.is_weight_mean, advantages=inputs["advantages"])
        per_seq = correction.denominator_mask.sum(dim=-1).to(correction.seq_kept_tokens.dtype)
        return dataclasses.replace(correction, seq_kept_tokens=per_seq)


def _is_placeholder(value: Tensor | float | None) -> bool:
    """NeMo-RL's split train path passes global_valid_* = 1.0 placeholders."""
    return value is not None and _as_float(value, "global_valid_*") == 1.0


def _as_float(value: Tensor | float | None, name: str) -> float:
    if value is None:
        raise ValueError(f"{name} is required unless set_step_denominators() was called")
    return float(value.detach().reshape(()) if isinstance(value, Tensor) else value)

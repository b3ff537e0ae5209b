"""The loss modules on one process equal `core.objective` on the same data.

`RolloutCorrectedPolicyLoss`, the Megatron loss function (with Megatron's per-token-loss schedule
emulated over microbatches) and the NeMo-RL adapter, for every preset and aggregation mode; the
denominator helpers; the all-rejected batch; the runnable examples.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.core.presets import preset_names
from nemo_rollout_correction.distributed import MicrobatchCorrection, ParallelGroups
from nemo_rollout_correction.losses import (
    MegatronLossBatch,
    MicrobatchLoss,
    NeMoRLRolloutCorrectedLoss,
    RolloutCorrectedPolicyLoss,
    StepDenominators,
    make_megatron_loss_func,
    nemo_rl_inputs,
    rejection_is_predictable,
)
from nemo_rollout_correction.losses.megatron import REPORT_KEY

ROWS, COLS, VOCAB = 10, 12, 9
SINGLE = ParallelGroups.single()
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SPLITS = ((0, 3), (3, 4), (4, 10))  # uneven microbatches, one of a single row


def make_data(seed: int = 0) -> dict[str, Tensor]:
    """Logits `[ROWS, COLS, VOCAB]`, sampled ids, three policies' logprobs, mask, advantages `[ROWS]`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, COLS, VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS, COLS), generator=gen)
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = logprobs + 0.05 * torch.randn(ROWS, COLS, generator=gen)
    rollout = old + 0.15 * torch.randn(ROWS, COLS, generator=gen)
    lengths = torch.randint(2, COLS + 1, (ROWS,), generator=gen)
    lengths[2] = 0
    mask = torch.arange(COLS) < lengths[:, None]
    rollout[4, 0] = float("nan")
    old[6, 1] -= 10.0
    return {"logits": logits, "targets": targets, "old": old, "rollout": rollout, "mask": mask,
            "advantages": torch.randn(ROWS, generator=gen)}


def configs() -> dict[str, RolloutCorrectionConfig]:
    """Every preset plus a few non-preset corners (batch norm, masking IS with RS, kept rejected)."""
    out = {name: RolloutCorrectionConfig.from_preset(name) for name in preset_names()}
    out["token_tis_bn"] = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.2,
                                                  rollout_is_batch_normalize=True)
    out["mis_rs_kept"] = RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.2,
                                                 rollout_rs="token_k2", rollout_rs_threshold=0.02,
                                                 rejected_tokens_in_denominator=True)
    return out


CONFIGS = configs()


def loss_cfg(mode: str) -> PolicyLossConfig:
    return PolicyLossConfig(loss_agg_mode=mode)  # type: ignore[arg-type]


def reference(cfg: RolloutCorrectionConfig, mode: str, data: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """core.objective on the whole batch: loss and gradient w.r.t. the logits."""
    logits = data["logits"].clone().requires_grad_(True)
    logprobs = torch.log_softmax(logits, -1).gather(-1, data["targets"].unsqueeze(-1)).squeeze(-1)
    loss = rollout_corrected_policy_loss(logprobs, data["rollout"], data["advantages"], data["mask"], cfg,
                                         loss_cfg(mode), old_logprobs=data["old"]).loss
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def logprobs_of(logits: Tensor, targets: Tensor) -> Tensor:
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def prepass(module: RolloutCorrectedPolicyLoss, data: dict[str, Tensor]
            ) -> tuple[list[MicrobatchCorrection], StepDenominators]:
    """The step pre-pass over SPLITS: corrections, then the step reduction."""
    references = [logprobs_of(data["logits"][start:stop], data["targets"][start:stop]) if module.rc_cfg.bypass_mode
                  else data["old"][start:stop] for start, stop in SPLITS]
    # Step-level thresholds (M2PO) first, from every microbatch of the step.
    spans = list(zip(references, SPLITS, strict=True))
    module = module.for_step([(ref, data["rollout"][a:b], data["mask"][a:b]) for ref, (a, b) in spans], SINGLE)
    corrections = [module.correct(ref, data["rollout"][a:b], data["mask"][a:b], SINGLE,
                                  advantages=data["advantages"][a:b]) for ref, (a, b) in spans]
    step = module.prepare_step(corrections, SINGLE)
    return corrections, StepDenominators.from_step(step)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_module_whole_batch_equals_core(name: str, mode: str) -> None:
    cfg, data = CONFIGS[name], make_data()
    ref_loss, ref_grad = reference(cfg, mode, data)
    module = RolloutCorrectedPolicyLoss(cfg, loss_cfg(mode))
    logits = data["logits"].clone().requires_grad_(True)
    denominators = None
    if cfg.rollout_is_batch_normalize:  # the global mean must exist before the loss
        _, denominators = prepass(module, data)
    out = module(logprobs_of(logits, data["targets"]), data["rollout"], data["advantages"], data["mask"], SINGLE,
                 denominators, old_logprobs=data["old"])
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss.detach(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-6)
    assert out.loss.requires_grad and not out.correction.is_weights.requires_grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_microbatches_with_prepass_sum_to_core(name: str, mode: str) -> None:
    cfg, data = CONFIGS[name], make_data()
    ref_loss, ref_grad = reference(cfg, mode, data)
    module = RolloutCorrectedPolicyLoss(cfg, loss_cfg(mode))
    corrections, denominators = prepass(module, data)
    logits = data["logits"].clone().requires_grad_(True)
    total = torch.zeros(())
    for (start, stop), corr in zip(SPLITS, corrections, strict=True):
        out = module(logprobs_of(logits[start:stop], data["targets"][start:stop]), data["rollout"][start:stop],
                     data["advantages"][start:stop], data["mask"][start:stop], SINGLE, denominators,
                     old_logprobs=data["old"][start:stop], correction=corr)
        total = total + out.loss
    (grad,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(total.detach(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("output", ["logits", "token_ce"])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "token-sum"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_per_token_loss_schedule_equals_core(name: str, mode: str, output: str) -> None:
    """Megatron with calculate_per_token_loss: sum of loss_sum grads over microbatches / summed num_tokens."""
    cfg, data = CONFIGS[name], make_data()
    ref_loss, ref_grad = reference(cfg, mode, data)
    module = RolloutCorrectedPolicyLoss(cfg, loss_cfg(mode))
    # Batch normalisation needs the pre-pass; the other configs correct inside the loss function.
    corrections: list[MicrobatchCorrection | None] = (
        list(prepass(module, data)[0]) if cfg.rollout_is_batch_normalize or cfg.needs_step_thresholds
        else [None] * len(SPLITS))
    logits = data["logits"].clone().requires_grad_(True)
    total_loss, total_tokens, reports = torch.zeros(()), torch.zeros((), dtype=torch.int), []
    sink: list[MicrobatchLoss] = []
    for (start, stop), corr in zip(SPLITS, corrections, strict=True):
        batch = MegatronLossBatch(rollout_logprobs=data["rollout"][start:stop],
                                  advantages=data["advantages"][start:stop], loss_mask=data["mask"][start:stop],
                                  old_logprobs=data["old"][start:stop], target_ids=data["targets"][start:stop],
                                  correction=corr)
        func = make_megatron_loss_func(batch, module, SINGLE, sink=sink)
        if output == "logits":
            output_tensor = logits[start:stop]
        else:  # GPTModel with labels returns the per-token cross-entropy
            output_tensor = -logprobs_of(logits[start:stop], data["targets"][start:stop])
        loss_sum, num_tokens, report = func(output_tensor)
        assert num_tokens.dtype == torch.int and num_tokens.dim() == 0 and loss_sum.dim() == 0
        total_loss = total_loss + loss_sum
        total_tokens += num_tokens
        reports.append(report[REPORT_KEY])
    scale = 1.0 / total_tokens.clamp(min=1)  # finalize_model_grads
    (grad,) = torch.autograd.grad(total_loss, logits)
    torch.testing.assert_close((total_loss * scale).detach(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad * scale, ref_grad, atol=1e-7, rtol=1e-6)
    summed = torch.stack(reports).sum(dim=0)  # what Megatron's training loop logs: sum / count
    torch.testing.assert_close(summed[0] / summed[1].clamp(min=1), ref_loss, atol=1e-6, rtol=1e-6)
    assert len(sink) == len(SPLITS)


def test_megatron_rejects_token_sum_and_bad_outputs() -> None:
    module = RolloutCorrectedPolicyLoss(RolloutCorrectionConfig(), loss_cfg("token-sum"))
    data = make_data()
    batch = MegatronLossBatch(rollout_logprobs=data["rollout"], advantages=data["advantages"], loss_mask=data["mask"],
                              old_logprobs=data["old"])
    with pytest.raises(ValueError, match="token-sum"):
        make_megatron_loss_func(batch, module, SINGLE)
    func = make_megatron_loss_func(batch, RolloutCorrectedPolicyLoss(RolloutCorrectionConfig()), SINGLE)
    with pytest.raises(ValueError, match="target_ids"):
        func(data["logits"])
    with pytest.raises(ValueError, match="output_tensor"):
        func(data["logits"][0, 0])


def nemo_batch(data: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
    """NeMo-RL's layout: `[ROWS, COLS + 1]` keys with a leading prompt position, and its logits."""
    pad = torch.zeros(ROWS, 1)
    batch = {
        "input_ids": torch.cat([torch.zeros(ROWS, 1, dtype=torch.int64), data["targets"]], 1),
        "generation_logprobs": torch.cat([pad, data["rollout"]], 1),
        "prev_logprobs": torch.cat([pad, data["old"]], 1),
        "advantages": data["advantages"][:, None].expand(ROWS, COLS + 1),
        "token_mask": torch.cat([pad, data["mask"].float()], 1),
        "sample_mask": torch.ones(ROWS),
    }
    logits = torch.cat([data["logits"], torch.zeros(ROWS, 1, VOCAB)], 1)
    return batch, logits


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nemo_rl_adapter_equals_core(name: str, mode: str) -> None:
    cfg, data = CONFIGS[name], make_data()
    if cfg.needs_step_thresholds:  # NeMo-RL calls its loss per microbatch: no step to choose M2PO's cutoff from
        with pytest.raises(ValueError, match="m2po_threshold"):
            NeMoRLRolloutCorrectedLoss(cfg, loss_cfg(mode))
        return
    if cfg.rejected_tokens_in_denominator and mode == "seq-mean-token-mean":
        pytest.skip("NeMo-RL divides each sequence by all its mask tokens here: tests/unit/test_nemo_rl_parity.py")
    ref_loss, ref_grad = reference(cfg, mode, data)
    batch, full_logits = nemo_batch(data)
    adapter = NeMoRLRolloutCorrectedLoss(cfg, loss_cfg(mode))
    assert adapter.loss_type.value == ("token_level" if mode == "token-mean" else "sequence_level")
    assert adapter.input_type.value == "logit"
    _, denominators = prepass(adapter.loss, data)
    adapter.set_step_denominators(denominators)
    logits = full_logits.clone().requires_grad_(True)
    # The older positional convention and the newer keyword one give the same loss.
    # NeMo-RL's sync path passes its own mask counts; the override replaces them.
    nemo_seqs, nemo_toks = float(ROWS), float(data["mask"].sum())
    loss, metrics = adapter(logits, batch, torch.tensor(nemo_seqs), torch.tensor(nemo_toks))
    loss_kw, _ = adapter(data=batch, global_valid_seqs=nemo_seqs, global_valid_toks=nemo_toks, logits=logits)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss_kw.detach(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad[:, :-1], ref_grad, atol=1e-7, rtol=1e-6)
    assert metrics["num_valid_tokens"] == float(data["mask"].sum())
    assert set(adapter.reduce_metrics()) and len(adapter.step_losses) == 2


def test_nemo_rl_default_denominators_keep_rejected_tokens() -> None:
    """Without an override, NeMo-RL's mask counts are the denominator (rejected tokens stay in it)."""
    cfg = RolloutCorrectionConfig.from_preset("decoupled_token_is")
    data = make_data()
    batch, logits = nemo_batch(data)
    adapter = NeMoRLRolloutCorrectedLoss(cfg)
    num_valid = data["mask"].sum()
    loss, _ = adapter(data=batch, global_valid_seqs=torch.tensor(float(ROWS)), global_valid_toks=num_valid,
                      logits=logits)
    expected = rollout_corrected_policy_loss(logprobs_of(data["logits"], data["targets"]), data["rollout"],
                                             data["advantages"], data["mask"], cfg, old_logprobs=data["old"],
                                             num_global_tokens=num_valid).loss
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    adapter.clear_step()
    assert adapter.step_losses == [] and adapter.step_denominators is None


def test_nemo_rl_field_mapping_and_errors() -> None:
    data = make_data()
    batch, _ = nemo_batch(data)
    batch["sample_mask"] = torch.ones(ROWS)
    batch["sample_mask"][0] = 0.0
    inputs = nemo_rl_inputs(batch, bypass_mode=False)
    assert torch.equal(inputs["rollout_logprobs"].nan_to_num(), data["rollout"].nan_to_num())
    assert torch.equal(inputs["old_logprobs"], data["old"]) and torch.equal(inputs["target_ids"], data["targets"])
    assert not inputs["loss_mask"][0].any() and torch.equal(inputs["loss_mask"][1:], data["mask"][1:])
    assert "old_logprobs" not in nemo_rl_inputs({k: v for k, v in batch.items() if k != "prev_logprobs"},
                                                bypass_mode=True)
    with pytest.raises(KeyError, match="generation_logprobs"):
        nemo_rl_inputs({k: v for k, v in batch.items() if k != "generation_logprobs"}, bypass_mode=False)
    with pytest.raises(ValueError, match="no NeMo-RL equivalent"):
        NeMoRLRolloutCorrectedLoss(RolloutCorrectionConfig(), loss_cfg("token-sum"))
    with pytest.raises(ValueError, match="required"):
        NeMoRLRolloutCorrectedLoss(RolloutCorrectionConfig())(data=batch, logits=torch.zeros(ROWS, COLS + 1, VOCAB))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollout_only_denominators(name: str) -> None:
    """Exact where rejection is predictable from the rollout alone, else an upper bound."""
    cfg = CONFIGS[name]
    data = make_data()
    module = RolloutCorrectedPolicyLoss(cfg)
    if cfg.rollout_is_batch_normalize:
        with pytest.raises(ValueError, match="batch_normalize"):
            module.rollout_only_denominators([(data["rollout"], data["mask"])], SINGLE)
        return
    cheap = module.rollout_only_denominators([(data["rollout"][a:b], data["mask"][a:b]) for a, b in SPLITS], SINGLE)
    _, exact = prepass(module, data)
    if rejection_is_predictable(cfg):
        assert cheap.num_global_tokens == exact.num_global_tokens
        assert cheap.num_global_seqs == exact.num_global_seqs
    else:
        assert cheap.num_global_tokens >= exact.num_global_tokens
        assert cheap.num_global_seqs >= exact.num_global_seqs


def test_all_rejected_gives_zero_loss_and_zero_grad() -> None:
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.0001)
    data = make_data()
    module = RolloutCorrectedPolicyLoss(cfg)
    logits = data["logits"].clone().requires_grad_(True)
    far = data["old"] + 1.0  # every ratio is e: outside the mask bounds
    out = module(logprobs_of(logits, data["targets"]), far, data["advantages"], data["mask"], SINGLE,
                 old_logprobs=data["old"])
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert float(out.loss.detach()) == 0.0 and int(out.num_denominator) == 0 and bool((grad == 0).all())


def test_errors_name_the_fix() -> None:
    data = make_data()
    with pytest.raises(ValueError, match="old_logprobs"):
        RolloutCorrectedPolicyLoss(RolloutCorrectionConfig())(data["old"], data["rollout"], data["advantages"],
                                                              data["mask"], SINGLE)
    bn = RolloutCorrectedPolicyLoss(CONFIGS["token_tis_bn"])
    with pytest.raises(ValueError, match="prepare_step"):
        bn(data["old"], data["rollout"], data["advantages"], data["mask"], SINGLE, old_logprobs=data["old"])
    pending = bn.correct(data["old"], data["rollout"], data["mask"], SINGLE)
    with pytest.raises(ValueError, match="prepare_step"):
        bn(data["old"], data["rollout"], data["advantages"], data["mask"], SINGLE, old_logprobs=data["old"],
           correction=pending)
    with pytest.raises(ValueError, match="norm_length"):
        RolloutCorrectedPolicyLoss(RolloutCorrectionConfig(), norm_length=0)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["rollout_corrected_loss_megatron.py", "rollout_corrected_loss_nemo_rl.py"])
def test_example_runs(script: str) -> None:
    """The examples run on CPU in one process and print the loss and rollout_corr metrics."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=120,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss" in proc.stdout and "rollout_corr/" in proc.stdout, proc.stdout

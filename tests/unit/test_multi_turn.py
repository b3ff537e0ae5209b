"""Multi-turn bookkeeping (rollout/multi_turn.py), the masks of `RolloutBatch.to_tensors`, the built-in
environments and tasks (tasks/environments.py, tasks/builtin.py) and their configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from default_lane import require

from nemo_rollout_correction.rollout.multi_turn import (
    OBSERVATION,
    EnvState,
    EnvStep,
    Trajectory,
    parse_env_step,
    turn_segments,
)
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.builtin import build_task
from nemo_rollout_correction.tasks.environments import (
    FEEDBACK_OBSERVATION,
    arithmetic_feedback_env,
    calculator_env,
    environment_reward,
    evaluate_expression,
    length_feedback_env,
    length_score,
)
from nemo_rollout_correction.tasks.prompts import PromptRecord


def test_trajectory_records_turns_and_observations_in_order() -> None:
    t = Trajectory(prompt_ids=[1, 2])
    t.add_turn([10, 11], [-0.5, -0.25], "stop")
    t.add_observation([20, 21, 22])
    t.add_turn([12], [-1.0], "length")
    assert t.context == [1, 2, 10, 11, 20, 21, 22, 12]
    assert t.turn_ids == [0, 0, OBSERVATION, OBSERVATION, OBSERVATION, 1]
    assert t.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert t.num_turns == 2 and t.num_generated_tokens == 3 and t.finish_reason == "length"
    with pytest.raises(ValueError, match="turn 2: 2 tokens but 1 logprobs"):
        t.add_turn([1, 2], [0.0], "stop")


def test_turn_segments() -> None:
    assert turn_segments([0, 0, -1, 1]) == [(0, 0, 2), (-1, 2, 3), (1, 3, 4)]
    assert turn_segments([]) == []
    assert turn_segments([0]) == [(0, 0, 1)]


def test_parse_env_step_accepts_tuples_and_names_bad_answers() -> None:
    assert parse_env_step(("obs", False), "w") == EnvStep("obs", False, None)
    assert parse_env_step(([1, 2], True, 0.5), "w") == EnvStep([1, 2], True, 0.5)
    with pytest.raises(TypeError, match="env on prompt 3: an environment must return"):
        parse_env_step("text", "env on prompt 3")
    with pytest.raises(TypeError, match="observation must be token ids"):
        parse_env_step(([1.5], False), "w")
    with pytest.raises(TypeError, match="done must be a bool"):
        parse_env_step(("x", 1), "w")
    with pytest.raises(ValueError, match="reward must be finite"):
        parse_env_step(("x", True, float("nan")), "w")


def test_to_tensors_masks_observations_token_by_token() -> None:
    multi = RolloutSample(prompt_index=0, prompt_token_ids=[1, 2, 3], token_ids=[10, 11, 20, 21, 12],
                          logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], finish_reason="stop", turn_ids=[0, 0, -1, -1, 1])
    single = RolloutSample(prompt_index=0, prompt_token_ids=[1, 2], token_ids=[10, 11],
                           logprobs=[-0.4, -0.5], finish_reason="stop")
    shared = RolloutSample(prompt_index=1, prompt_token_ids=[4, 5], token_ids=[7, 8, 9], logprobs=[],
                           finish_reason="stop", turn_ids=[0, -1, 1])  # shared without its logprobs
    t = RolloutBatch([multi, single, shared], n=1, seconds=0.0).to_tensors()
    assert t["input_ids"][0].tolist() == [1, 2, 3, 10, 11, 20, 21, 12]
    # position j scores input j + 1: the response of row 0 starts at position 2
    assert t["loss_mask"].tolist() == [[False, False, True, True, False, False, True],
                                       [False, True, True, False, False, False, False],
                                       [False, True, False, True, False, False, False]]
    assert t["observation_mask"].tolist() == [[False, False, False, False, True, True, False],
                                              [False] * 7,
                                              [False, False, True, False, False, False, False]]
    assert t["turn_index"].tolist() == [[-1, -1, 0, 0, -1, -1, 1], [-1, 0, 0, -1, -1, -1, -1],
                                        [-1, 0, -1, 1, -1, -1, -1]]
    assert torch.equal(t["rollout_logprobs"][0], torch.tensor([0, 0, -0.1, -0.2, 0, 0, -0.3]))
    assert not (t["loss_mask"] & t["observation_mask"]).any()
    # single-turn batches are unchanged: no multi-turn keys
    assert "turn_index" not in RolloutBatch([single], n=1, seconds=0.0).to_tensors()


def test_evaluate_expression_is_arithmetic_only() -> None:
    assert evaluate_expression("3 * (4 + 5) - 2") == 25.0
    assert evaluate_expression("7 / 2") == 3.5
    assert evaluate_expression("-3 + 1") == -2.0
    for bad in ("__import__('os')", "2 ** 100", "1 / 0", "x + 1", "1" * 70, "(1"):
        assert evaluate_expression(bad) is None


def _state(text: str, answer: str = "15", turn: int = 0) -> EnvState:
    return EnvState(record=PromptRecord("What is 6 + 9?", answer), turn=turn, turn_texts=[text])


def test_calculator_env() -> None:
    step = calculator_env(_state("Let me compute. CALC: 6 + 9"), [1])
    assert step == EnvStep(observation="RESULT: 15", done=False, reward=None)
    assert calculator_env(_state("CALC(2*)"), [1]).observation == "RESULT: error"
    assert calculator_env(_state("The result is 15. ANSWER: 15"), [1]) == EnvStep(None, True, 1.0)
    assert calculator_env(_state("CALC: 6+9 ANSWER: 14"), [1]) == EnvStep(None, True, 0.0)
    assert calculator_env(_state("15 it is"), [1]) == EnvStep(None, True, 1.0)  # no tool call: first number
    assert calculator_env(_state("no idea"), [1]) == EnvStep(None, True, 0.0)


def test_arithmetic_feedback_env() -> None:
    assert arithmetic_feedback_env(_state("14"), [1]) == EnvStep(FEEDBACK_OBSERVATION, False, None)
    assert arithmetic_feedback_env(_state("15", turn=0), [1]) == EnvStep(None, True, 1.0)
    assert arithmetic_feedback_env(_state("It is 15", turn=2), [1]) == EnvStep(None, True, pytest.approx(1 / 3))


def test_environment_reward_reads_the_records() -> None:
    records = [PromptRecord("p", metadata={"env_reward": 0.5}), PromptRecord("p", metadata={"env_reward": 0})]
    assert environment_reward(records=records, completions=["a", "b"]) == [0.5, 0.0]
    with pytest.raises(ValueError, match="record 1 has no metadata\\['env_reward'\\]"):
        environment_reward(records=[records[0], PromptRecord("p")])


def test_multi_turn_tasks() -> None:
    calc = build_task("calculator", num_prompts=5, max_operand=10, seed=3, num_eval_prompts=2)
    plain = build_task("arithmetic", num_prompts=5, max_operand=10, seed=3, num_eval_prompts=2)
    assert calc.environment is calculator_env and calc.reward_fn is environment_reward
    assert [r.answer for r in calc.records] == [r.answer for r in plain.records]
    pairs = zip(calc.records, plain.records, strict=True)
    assert all(r.prompt.startswith(p.prompt) and "CALC:" in r.prompt for r, p in pairs)
    assert len(calc.eval_records) == 2
    feedback = build_task("arithmetic_feedback", num_prompts=5, seed=3)
    assert feedback.environment is arithmetic_feedback_env
    assert [r.prompt for r in feedback.records] == [r.prompt for r in build_task("arithmetic", num_prompts=5,
                                                                                 seed=3).records]

    def my_env(state: EnvState, turn: list[int]) -> EnvStep:
        return EnvStep(done=True, reward=1.0)

    custom = build_task("arithmetic", num_prompts=5, environment=my_env)
    assert custom.environment is my_env
    assert build_task("arithmetic", num_prompts=5).environment is None


def test_config_groups_set_max_turns(tmp_path: Path) -> None:
    require("hydra", "config")
    from nemo_rollout_correction.config.loader import load_config

    cfg = load_config(["task=calculator"], tmp_path)
    assert cfg.task.name == "calculator" and cfg.rollout.max_turns == 3
    assert load_config(["task=arithmetic_feedback", "rollout.max_turns=2"], tmp_path).rollout.max_turns == 2
    assert load_config([], tmp_path).rollout.max_turns == 1
    with pytest.raises(ValueError, match=r"rollout\.max_turns"):
        load_config(["rollout.max_turns=0"], tmp_path)


def test_multi_turn_refuses_what_it_does_not_support(tmp_path: Path) -> None:
    require("hydra", "config")
    from nemo_rollout_correction.config.loader import load_config
    from nemo_rollout_correction.tasks.environments import check_multi_turn_supported

    check_multi_turn_supported(load_config(["task=calculator"], tmp_path))
    with pytest.raises(ValueError, match=r"set eval\.every_n_steps=0 and eval\.before_train=false"):
        check_multi_turn_supported(load_config(["task=calculator", "eval.num_prompts=4", "eval.every_n_steps=1"],
                                               tmp_path))
    with pytest.raises(ValueError, match=r"set grpo\.overlong_penalty=false"):
        check_multi_turn_supported(load_config(["task=calculator", "grpo.overlong_penalty=true"], tmp_path))
    with pytest.raises(ValueError, match=r"rollout\.routing_replay=r3 is not supported"):
        check_multi_turn_supported(load_config(["task=calculator", "rollout.routing_replay=r3"], tmp_path))
    with pytest.raises(ValueError, match=r"set rollout\.partial_max_tokens_per_step=0"):
        check_multi_turn_supported(load_config(["task=calculator", "rollout.partial_max_tokens_per_step=4"],
                                               tmp_path))


def test_retokenization_drift_counts_unmatched_ids() -> None:
    from nemo_rollout_correction.rollout.multi_turn import retokenization_drift

    assert retokenization_drift([1, 2, 3, 4], [1, 2, 3, 4]) == (0, 4)
    assert retokenization_drift([1, 2, 3, 4], [1, 23, 4]) == (2, 4)  # 2 and 3 merged into one id
    assert retokenization_drift([1, 2, 3], [1, 2, 3, 9]) == (0, 3)  # an extra id does not hide a token
    assert retokenization_drift([], [5]) == (0, 0)


def test_retokenized_chat_ids_renders_the_conversation() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.tasks.environments import retokenized_chat_ids

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_source("tiny-llama")))
    ids = retokenized_chat_ids(tokenizer, "What is 1 + 1?", ["3", "2"], ["Try again."])
    text = tokenizer.decode(ids)
    assert text.index("What is 1 + 1?") < text.index("3") < text.index("Try again.") < text.rindex("2")
    assert text.count("<|im_start|>assistant") == 2 and text.count("<|im_start|>user") == 2


def test_length_feedback_env_rewards_sum_to_the_last_turns_score() -> None:
    record = PromptRecord("Describe a river.", None, metadata={"task": "length_target", "target_length": 16})

    def play(lengths: list[int]) -> tuple[list[EnvStep], float]:
        state, steps = EnvState(record=record), []
        for turn, n in enumerate(lengths):  # what run_multi_turn does with the answers
            state.turn = turn
            step = length_feedback_env(state, list(range(n)))
            steps.append(step)
            if step.reward is not None:
                state.rewards.append(step.reward)
            if step.done:
                break
        return steps, sum(state.rewards)

    steps, total = play([40, 24, 18])  # too long, still too long (24 > 16 + 4), then within a quarter: done
    assert [s.done for s in steps] == [False, False, True]
    assert steps[0].observation == "That was 40 tokens; write about 16 tokens."
    assert total == pytest.approx(length_score(18, 16)) == pytest.approx(-2 / 16)
    steps, total = play([12])  # within a quarter at once
    assert steps[0].done and total == pytest.approx(-4 / 16)
    steps, total = play([2, 64, 30])  # never within: the score of the last turn generated
    assert not any(s.done for s in steps) and total == pytest.approx(-14 / 16)
    assert length_score(64, 16) == -1.0


def test_length_feedback_task() -> None:
    task = build_task("length_feedback", num_prompts=6, target_length=16, seed=3, num_eval_prompts=2)
    plain = build_task("length_target", num_prompts=6, target_length=16, seed=3, num_eval_prompts=2)
    assert task.environment is length_feedback_env and task.reward_fn is environment_reward
    assert task.records == plain.records and task.eval_records == plain.eval_records

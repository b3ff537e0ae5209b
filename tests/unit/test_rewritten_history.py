"""Rewritten histories (rollout/multi_turn.py, tasks/environments.py): the rewrite answer of an environment, the
split of a trajectory into exact-prefix segments token by token, the compaction environment, and what the
trainer refuses with them. The real engine and trainer: tests/integration/test_rewritten_history_engine.py."""

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
    split_segments,
)
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.environments import arithmetic_compaction_env, split_rewritten
from nemo_rollout_correction.tasks.prompts import PromptRecord

OBS = OBSERVATION


def _rewritten() -> RolloutSample:
    """Prompt [1, 2]; turn 0 = [10, 11], observation [90], turn 1 = [12]; then the history is rewritten to
    [7, 8, 9] and turn 2 = [13, 14] is sampled from it."""
    trajectory = Trajectory(prompt_ids=[1, 2])
    trajectory.add_turn([10, 11], [-0.1, -0.2], "stop")
    trajectory.add_observation([90])
    trajectory.add_turn([12], [-0.3], "stop")
    assert trajectory.context == [1, 2, 10, 11, 90, 12]
    trajectory.rewrite([7, 8, 9])
    assert trajectory.context == [7, 8, 9]  # the next turn sees the rewritten context only
    trajectory.add_turn([13, 14], [-0.4, -0.5], "length")
    assert trajectory.context == [7, 8, 9, 13, 14]
    return RolloutSample(prompt_index=3, prompt_token_ids=trajectory.prompt_ids, token_ids=trajectory.response_ids,
                         logprobs=trajectory.logprobs, finish_reason="length", text="t",
                         turn_ids=trajectory.turn_ids, segments=trajectory.segments)


def test_split_segments_token_by_token() -> None:
    sample = _rewritten()
    assert sample.segments == [(4, [7, 8, 9])]
    plain = RolloutSample(prompt_index=0, prompt_token_ids=[5], token_ids=[6, 7], logprobs=[-1.0, -2.0],
                          finish_reason="stop", text="x", turn_ids=[0, 0])
    rows, owner = split_segments([plain, sample])
    assert owner == [0, 1, 1] and rows[0] is plain
    first, second = rows[1], rows[2]
    assert (first.prompt_token_ids, first.token_ids, first.logprobs, first.turn_ids) == (
        [1, 2], [10, 11, 90, 12], [-0.1, -0.2, 0.0, -0.3], [0, 0, OBS, 1])
    assert (second.prompt_token_ids, second.token_ids, second.logprobs, second.turn_ids) == (
        [7, 8, 9], [13, 14], [-0.4, -0.5], [2, 2])
    assert all(r.segments is None and r.prompt_index == 3 for r in rows[1:])
    tensors = RolloutBatch(rows, n=1, seconds=0.0).to_tensors(pad_token_id=0)
    # row 2 is trained under [7, 8, 9]: its two tokens sit at next-token positions 2 and 3
    assert tensors["input_ids"][2].tolist() == [7, 8, 9, 13, 14, 0]
    assert tensors["loss_mask"][2].tolist() == [False, False, True, True, False]
    assert torch.allclose(tensors["rollout_logprobs"][2], torch.tensor([0, 0, -0.4, -0.5, 0]))
    assert tensors["turn_index"][2].tolist() == [-1, -1, 2, 2, -1]
    assert tensors["loss_mask"][1].tolist() == [False, True, True, False, True]  # the observation is out
    # every sampled token lands in exactly one row: the token denominators count it once
    assert int(tensors["loss_mask"].sum()) == 2 + 3 + 2


def test_split_segments_names_bad_bounds() -> None:
    sample = _rewritten()
    sample.segments = [(9, [7])]
    with pytest.raises(ValueError, match=r"sample 0: segment bounds 0\.\.9 outside its 6 response tokens"):
        split_segments([sample])


def test_parse_env_step_context() -> None:
    step = parse_env_step(EnvStep(context=[{"role": "user", "content": "summary"}]), "env")
    assert step.context == [{"role": "user", "content": "summary"}]
    assert parse_env_step(EnvStep(context=[4, 5]), "env").context == [4, 5]
    with pytest.raises(TypeError, match="env: context must be non-empty token ids"):
        parse_env_step(EnvStep(context=[{"role": "user"}]), "env")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="context must be non-empty"):
        parse_env_step(EnvStep(context=[]), "env")
    with pytest.raises(ValueError, match="must have observation=None"):
        parse_env_step(EnvStep(observation="x", context=[4]), "env")


def test_arithmetic_compaction_env_summarises_the_wrong_answers() -> None:
    state = EnvState(record=PromptRecord("What is 6 + 9?", "15"), turn=0, turn_texts=["It is 14."])
    step = arithmetic_compaction_env(state, [1])
    assert step.observation is None and not step.done
    assert step.context == [{"role": "user", "content": "What is 6 + 9? (Earlier answers, all wrong: 14. Try again.)"}]
    state.turn, state.turn_texts = 1, ["It is 14.", "no idea"]
    assert "all wrong: 14, no number." in arithmetic_compaction_env(state, [1]).context[0]["content"]  # type: ignore
    state.turn, state.turn_texts = 2, ["14", "x", "15"]
    assert arithmetic_compaction_env(state, [1]) == EnvStep(None, True, pytest.approx(1 / 3))


def test_split_rewritten_refuses_what_acts_per_sequence(tmp_path: Path) -> None:
    require("hydra", "config")
    from nemo_rollout_correction.config.loader import load_config

    batch = RolloutBatch([_rewritten()], n=1, seconds=0.0)
    turn = ["rollout_correction.sequence_unit=turn"]
    out = split_rewritten(load_config(turn, tmp_path), batch)
    assert out is not None and out[1] == [0, 0] and len(out[0]) == 2
    unsplit = RolloutBatch([RolloutSample(0, [1], [2], [-1.0], "stop", "x", turn_ids=[0])], n=1, seconds=0.0)
    assert split_rewritten(load_config([], tmp_path), unsplit) is None
    with pytest.raises(ValueError, match=r"sequence_unit=trajectory with sequence-level decisions "
                                         r"\(rollout_token_veto_threshold=0.0001, nonfinite_policy=reject_sequence\)"):
        split_rewritten(load_config([], tmp_path), batch)
    with pytest.raises(ValueError, match=r"grpo.loss_agg_mode=seq-mean-token-mean would count each segment"):
        split_rewritten(load_config([*turn, "grpo.loss_agg_mode=seq-mean-token-mean"], tmp_path), batch)


def test_the_compaction_task_is_refused_at_start_without_the_turn_unit(tmp_path: Path) -> None:
    require("hydra", "config")
    from nemo_rollout_correction.config.loader import load_config
    from nemo_rollout_correction.tasks.environments import check_multi_turn_supported

    with pytest.raises(ValueError, match=r"task.name=arithmetic_compaction rewrites histories .* set "
                                         r"rollout_correction.sequence_unit=turn"):
        check_multi_turn_supported(load_config(["task=arithmetic_compaction"], tmp_path))
    cfg = load_config(["task=arithmetic_compaction", "rollout_correction.sequence_unit=turn"], tmp_path)
    check_multi_turn_supported(cfg)
    assert cfg.rollout.max_turns == 3 and cfg.task.name == "arithmetic_compaction"

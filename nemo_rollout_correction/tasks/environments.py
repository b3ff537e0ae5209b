"""Environments of the built-in multi-turn tasks, the reward that reads their rewards, and the fleet's seam.

- ``calculator`` (tool use): "What is a <op> b?"; the policy may call a calculator by writing
  ``CALC: <expression>`` and gets ``RESULT: <value>`` back as an observation; reward 1.0 when its final answer
  (the number after ``ANSWER:``, else the first number of the final turn) is right, else 0.0.
- ``arithmetic_feedback`` (feedback between turns): "What is a <op> b?"; a wrong first number gets the
  observation "That is not right. Try again." and another turn; reward ``1 / (k + 1)`` for a right answer at turn
  ``k``, 0.0 if none is right.
- ``arithmetic_compaction_env`` (a rewritten history): as ``arithmetic_feedback``, but after a wrong answer the
  history is *compacted*: the next turn is sampled from a fresh prompt that holds the question and a one-line
  summary of the earlier answers instead of the earlier turns (``EnvStep.context``). The trajectory is then made
  of exact-prefix segments, each trained under its own context (:func:`split_rewritten`, docs/multi_turn.md).

- ``length_feedback`` (feedback between turns, a dense reward): a ``length_target`` instruction; a turn whose length
  is more than a quarter off ``target_length`` tokens gets "That was N tokens; write about T tokens." and another
  turn; the trajectory's reward is the length score of its last turn (``-min(|n - T| / T, 1)``, the
  ``length_target`` reward), so a 135M model improves it within a short run (docs/multi_turn.md, "A run on
  SmolLM2-135M").

An environment is any callable ``env(state, turn_token_ids) -> EnvStep | (observation, done[, reward])``
(rollout/multi_turn.py); docs/tasks.md says how to plug one in. The trajectory's reward (the sum of what the
environment returned) reaches the reward function as ``record.metadata["env_reward"]``: :func:`environment_reward`
returns it (defined in tasks/env_reward.py, which a reward worker imports without torch), a user's
``task.reward_fn`` may combine it with its own reading of the transcript.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.losses.rollout_corrected_pg import TOKEN_DENOMINATOR_MODES
from nemo_rollout_correction.rollout.multi_turn import EnvState, EnvStep, split_segments
from nemo_rollout_correction.rollout.multi_turn_loop import (
    Environment,
    chat_context_renderer,
    chat_observation_encoder,
    run_multi_turn,
)
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.tasks.env_reward import (  # environment_reward: re-exported (public API here before)
    ENV_REWARD_KEY,
    environment_reward,
)
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.tasks.rewards import first_number

__all__ = [
    "CALCULATOR_INSTRUCTION",
    "ENV_REWARD_KEY",
    "FEEDBACK_OBSERVATION",
    "MULTI_TURN_ENVIRONMENTS",
    "arithmetic_compaction_env",
    "arithmetic_feedback_env",
    "calculator_env",
    "check_multi_turn_supported",
    "check_rewrites_supported",
    "environment_reward",
    "evaluate_expression",
    "generate_multi_turn",
    "length_feedback_env",
    "length_score",
    "retokenized_chat_ids",
    "sequence_level_parts",
    "split_rewritten",
    "trajectory_train_rows",
]

CALCULATOR_INSTRUCTION = (" You may use a calculator: write CALC: <expression> and the result comes back."
                          " Give the final answer as ANSWER: <number>.")
FEEDBACK_OBSERVATION = "That is not right. Try again."
_CALC = re.compile(r"CALC\s*[:(]\s*([0-9+\-*/(). ]+)")
_ANSWER = re.compile(r"ANSWER\s*:\s*(.*)", re.DOTALL)
_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub,
                                               ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_expression(text: str) -> float | None:
    """The value of an arithmetic expression of numbers, + - * / and parentheses; None if it is anything else
    (parsed with `ast`, never `eval`), divides by zero, or has more than 64 characters."""
    if len(text) > 64:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                    bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError("not arithmetic")

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _is_right(number: float | None, record: PromptRecord) -> bool:
    return number is not None and record.answer is not None and abs(number - float(record.answer)) < 1e-9


def _format(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def calculator_env(state: EnvState, turn_token_ids: list[int]) -> EnvStep:
    """Tool use: a turn with ``CALC: <expression>`` (and no ``ANSWER:``) gets ``RESULT: <value>``; any other turn
    is final and scored (1.0 for the right answer). A last turn that still calls the calculator scores 0."""
    del turn_token_ids
    text = state.turn_texts[-1]
    answer = _ANSWER.search(text)
    call = _CALC.search(text)
    if call is not None and answer is None:
        result = evaluate_expression(call.group(1))
        state.scratch["calls"] = state.scratch.get("calls", 0) + 1
        return EnvStep(observation=f"RESULT: {'error' if result is None else _format(result)}", done=False)
    final = first_number(answer.group(1)) if answer is not None else first_number(text)
    return EnvStep(observation=None, done=True, reward=1.0 if _is_right(final, state.record) else 0.0)


def arithmetic_feedback_env(state: EnvState, turn_token_ids: list[int]) -> EnvStep:
    """Feedback between turns: a right first number ends the trajectory with reward ``1 / (turn + 1)``; a wrong
    one gets :data:`FEEDBACK_OBSERVATION` and another turn (reward 0 if no turn is right)."""
    del turn_token_ids
    if _is_right(first_number(state.turn_texts[-1]), state.record):
        return EnvStep(observation=None, done=True, reward=1.0 / (state.turn + 1))
    return EnvStep(observation=FEEDBACK_OBSERVATION, done=False)


def arithmetic_compaction_env(state: EnvState, turn_token_ids: list[int]) -> EnvStep:
    """Feedback with a compacted history: a right first number ends the trajectory with reward ``1 / (turn + 1)``;
    a wrong one rewrites the history to a single user message, the question followed by a summary of the wrong
    answers so far (the earlier turns' text is dropped), from which the next turn is sampled."""
    del turn_token_ids
    number = first_number(state.turn_texts[-1])
    if _is_right(number, state.record):
        return EnvStep(observation=None, done=True, reward=1.0 / (state.turn + 1))
    wrong = state.scratch.setdefault("wrong", [])
    wrong.append("no number" if number is None else _format(number))
    summary = f"{state.record.prompt} (Earlier answers, all wrong: {', '.join(wrong)}. Try again.)"
    return EnvStep(context=[{"role": "user", "content": summary}])


def length_score(num_tokens: int, target: int) -> float:
    """The ``length_target`` reward of one response: ``-min(|num_tokens - target| / target, 1)``, in ``[-1, 0]``."""
    return -min(abs(num_tokens - target) / target, 1.0)


def length_feedback_env(state: EnvState, turn_token_ids: list[int]) -> EnvStep:
    """Feedback on length: a turn within a quarter of ``record.metadata["target_length"]`` tokens (its sampled ids,
    end-of-turn token included, as ``length_target`` counts them) ends the trajectory; any other turn gets "That
    was N tokens; write about T tokens." and another turn. Each step's reward is the change of the turn's length
    score (:func:`length_score`) from the previous turn's, so the trajectory's reward, their sum, is the score of
    its last turn (after ``rollout.max_turns`` turns, of the last one generated)."""
    target = int(state.record.metadata["target_length"])
    num_tokens = len(turn_token_ids)
    reward = length_score(num_tokens, target) - sum(state.rewards)  # the sum so far is the previous turn's score
    if abs(num_tokens - target) * 4 <= target:
        return EnvStep(observation=None, done=True, reward=reward)
    return EnvStep(observation=f"That was {num_tokens} tokens; write about {target} tokens.", done=False,
                   reward=reward)


MULTI_TURN_ENVIRONMENTS: dict[str, Environment] = {
    "calculator": calculator_env,
    "arithmetic_feedback": arithmetic_feedback_env,
    "arithmetic_compaction": arithmetic_compaction_env,
    "length_feedback": length_feedback_env,
}
"""The built-in multi-turn tasks' environments, by `task.name`."""


def generate_multi_turn(engine: Any, records: Sequence[PromptRecord], prompts: Sequence[Sequence[int]],
                        sampling: SamplingOptions, env: Environment, tokenizer: Any, *, max_turns: int,
                        max_model_len: int, seed: int | None) -> tuple[RolloutBatch, list[PromptRecord]]:
    """The fleet's multi-turn generation: the batch and, per sample, its record with the trajectory's environment
    reward in `metadata["env_reward"]` (what the reward function reads)."""
    result = run_multi_turn(engine, prompts, records, sampling, env, encode=chat_observation_encoder(tokenizer),
                            decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
                            max_turns=max_turns, max_model_len=max_model_len, seed=seed,
                            render=chat_context_renderer(tokenizer))
    sample_records = [dataclasses.replace(records[s.prompt_index],
                                          metadata={**records[s.prompt_index].metadata, ENV_REWARD_KEY: reward})
                      for s, reward in zip(result.batch.samples, result.env_rewards, strict=True)]
    return result.batch, sample_records


def sequence_level_parts(cfg: TrainConfig) -> list[str]:
    """The `rollout_correction` settings that take a decision per sequence (each as `key=value`): the ones whose
    unit `rollout_correction.sequence_unit` picks."""
    rc = cfg.rollout_correction
    parts = []
    if rc.rollout_is in ("sequence", "geometric"):
        parts.append(f"rollout_is={rc.rollout_is}")
    parts += [f"rollout_rs={c.name}" for c in rc.rejection_criteria if not c.is_token_level]
    if rc.rollout_token_veto_threshold is not None:
        parts.append(f"rollout_token_veto_threshold={rc.rollout_token_veto_threshold}")
    if rc.nonfinite_policy == "reject_sequence":
        parts.append("nonfinite_policy=reject_sequence")
    if rc.opsm_threshold is not None:
        parts.append(f"opsm_threshold={rc.opsm_threshold}")
    if rc.seq_logprob_error_threshold is not None:
        parts.append(f"seq_logprob_error_threshold={rc.seq_logprob_error_threshold}")
    return parts


def check_rewrites_supported(cfg: TrainConfig, what: str | None = None) -> None:
    """Refuse, naming the key, what rewritten histories cannot do (`split_rewritten`): a sequence-level decision
    under `sequence_unit=trajectory` and a `seq-mean-*` loss."""
    what = what or f"task.name={cfg.task.name} rewrites histories (rewritten histories, docs/multi_turn.md)"
    if cfg.rollout_correction.sequence_unit == "trajectory" and sequence_level_parts(cfg):
        raise ValueError(f"{what}: rollout_correction.sequence_unit=trajectory with sequence-level decisions "
                         f"({', '.join(sequence_level_parts(cfg))}) would act on each segment, not the trajectory; "
                         "set rollout_correction.sequence_unit=turn (or turn those settings off)")
    if cfg.grpo.loss_agg_mode not in TOKEN_DENOMINATOR_MODES:
        raise ValueError(f"{what}: grpo.loss_agg_mode={cfg.grpo.loss_agg_mode} would count each segment as a "
                         f"sequence; use one of {', '.join(TOKEN_DENOMINATOR_MODES)}")


def split_rewritten(cfg: TrainConfig, batch: RolloutBatch) -> tuple[RolloutBatch, list[int]] | None:
    """Rewritten histories: the step's batch with one row per exact-prefix segment, and each row's sample (to
    broadcast the trajectory's advantage: `advantages[owner]`); None when no sample was rewritten.

    Refused, naming the key: a sequence-level decision under `sequence_unit=trajectory` (a trajectory's segments
    are separate rows, possibly in other microbatches or on other ranks, and the correction aggregates per row:
    set `rollout_correction.sequence_unit=turn`, a turn lies inside one segment) and a loss whose denominator
    counts sequences (`grpo.loss_agg_mode=seq-mean-*` would count segments). A sample without its logprobs (with
    several engines, one another data-parallel group trains: `trajectory_train_rows`) gives rows without them.
    """
    if not any(s.segments for s in batch.samples):
        return None
    check_rewrites_supported(cfg, "the environment rewrote a history (rewritten histories, docs/multi_turn.md)")
    rows, owner = split_segments(batch.samples)
    return RolloutBatch(rows, n=batch.n, seconds=batch.seconds), owner


def trajectory_train_rows(batch: RolloutBatch,
                          train_rows: Callable[[int, int], Tensor]) -> Callable[[int, int], Tensor]:
    """The trajectories of `batch` each data-parallel rank needs the logprobs of, as `train_rows` for
    `RowSharing.localize` (several engines move logprobs to the ranks that train them, by trajectory).

    train_rows: `(num_rows, dp_rank) -> [rows]` the rows of the step's training batch a rank trains. Without a
    rewritten history the training batch is `batch`: `train_rows` itself. With one, the training batch holds a row
    per exact-prefix segment (`split_rewritten`, after `localize`), so a rank needs the trajectories owning its
    segment rows; the split depends only on token ids and `segments`, which every rank already holds.
    """
    if not any(s.segments for s in batch.samples):
        return train_rows
    _, owner = split_segments(batch.samples)

    def rows(num_samples: int, dp_rank: int) -> Tensor:
        if num_samples != len(batch.samples):
            raise ValueError(f"trajectory_train_rows: asked for {num_samples} samples, the batch has "
                             f"{len(batch.samples)}")
        return torch.tensor(sorted({owner[r] for r in train_rows(len(owner), dp_rank).tolist()}), dtype=torch.long)

    return rows


def check_multi_turn_supported(cfg: TrainConfig) -> None:
    """Refuse, naming the key, what a multi-turn task does not support yet: held-out evaluation (it samples one
    turn), DAPO's overlong penalty (it reads the whole response length), rollout routing replay (the loop
    records no routing), partial rollouts, and for a task that rewrites histories what `check_rewrites_supported`
    refuses."""
    if cfg.eval.enabled:
        raise ValueError(f"task.name={cfg.task.name} is multi-turn and held-out evaluation samples single turns: set "
                         "eval.every_n_steps=0 and eval.before_train=false (multi-turn evaluation is not implemented; "
                         "docs/multi_turn.md)")
    if cfg.grpo.overlong_penalty:
        raise ValueError(f"grpo.overlong_penalty=true is not supported with the multi-turn task {cfg.task.name}: it "
                         "measures the whole response (observations included) against rollout.max_new_tokens, a "
                         "per-turn budget; set grpo.overlong_penalty=false")
    if cfg.rollout.routing_replay != "none":
        raise ValueError(f"rollout.routing_replay={cfg.rollout.routing_replay} is not supported with the multi-turn "
                         f"task {cfg.task.name} (the multi-turn loop records no routing); set "
                         "rollout.routing_replay=none")
    if cfg.task.name == "arithmetic_compaction":  # rewrites every history it continues: refuse now, not at step 1
        check_rewrites_supported(cfg)
    if cfg.rollout.partial_max_tokens_per_step:
        raise ValueError(f"rollout.partial_max_tokens_per_step={cfg.rollout.partial_max_tokens_per_step} is not "
                         f"supported with the multi-turn task {cfg.task.name} (partial rollouts continue single-turn "
                         "responses, never an environment's turns); set rollout.partial_max_tokens_per_step=0")


def retokenized_chat_ids(tokenizer: Any, prompt: str, turn_texts: Sequence[str],
                         observations: Sequence[Any]) -> list[int]:
    """The conversation as a trainer that re-tokenizes chat text would see it: the chat template over `user`
    (prompt), then `assistant` (each turn's text) and `user` (each observation's text; token-id observations
    decoded), tokenized in one piece. Compare with the token-in/token-out ids (`multi_turn.retokenization_drift`)."""
    messages = [{"role": "user", "content": prompt}]
    for k, text in enumerate(turn_texts):
        messages.append({"role": "assistant", "content": text})
        if k < len(observations) and observations[k] is not None:
            obs = observations[k]
            messages.append({"role": "user", "content": obs if isinstance(obs, str) else tokenizer.decode(obs)})
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]

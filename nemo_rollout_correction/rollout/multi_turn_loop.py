"""The multi-turn rollout loop: the engine generates a turn, the environment answers, up to `max_turns`.

Token in / token out. Turn 0 samples `n` responses per prompt from the prompt ids (one `generate` call, the
single-turn seeds). Every later turn `k` generates one response per live trajectory from that trajectory's
whole context as ids (`prompt + turns + observations`, exactly the ids the engine returned and the
observations' ids), so sampled text is never re-tokenized and the engine's behaviour logprobs belong to the very
ids the trainer scores. An observation given as text is tokenized once, on its own (wrapped as a chat user turn
when the tokenizer has a chat template: `chat_observation_encoder`).

An environment may rewrite the history instead of appending an observation (`EnvStep.context`, rendered once when
given as chat messages): the next turn is generated from that context alone and starts a new exact-prefix
segment of the trajectory (`Trajectory.rewrite`, `RolloutSample.segments`; docs/multi_turn.md).

A trajectory ends when the environment says `done`, after `max_turns` turns, or when the next turn would not fit
in `max_model_len` (its observation is then not appended). Its reward is the sum of the rewards the environment
returned (the trainer's reward function reads it from `record.metadata["env_reward"]`, tasks/environments.py).

Seeds: turn 0 uses the call's seeds (`VllmRolloutEngine.generate`: sample `i` of the call gets `seed + i`);
turn `k >= 1` seeds trajectory `i` (its index among the call's samples) with `seed + k * TURN_SEED_STRIDE + i`,
whichever trajectories are still live, so every turn draws afresh, a resumed run draws the same tokens, and an
engine that generates a contiguous share of the prompts from `seed + first sample` (`rollout.placement`) draws
the same tokens as one engine generating them all: the samples do not depend on the number of engines. A turn is
one `generate` call per run of consecutive live trajectories (one call while none has ended).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from nemo_rollout_correction.rollout.multi_turn import EnvState, Trajectory, parse_env_step
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

TURN_SEED_STRIDE = 1 << 32
"""Seed offset between turns (above any step's seeds: `placement.STEP_SEED_STRIDE` times the steps of a run)."""

Environment = Callable[[EnvState, list[int]], Any]
"""`env(state, turn_token_ids) -> EnvStep | (observation, done[, reward])` (rollout/multi_turn.py)."""

ObservationEncoder = Callable[[str, list[int]], list[int]]
"""`encode(text, turn_token_ids) -> ids`: an observation's text as token ids (tokenized once)."""

ContextRenderer = Callable[[list[dict[str, str]]], list[int]]
"""`render(messages) -> ids`: a rewritten history given as chat messages, as the ids of a prompt (rendered once)."""

__all__ = ["TURN_SEED_STRIDE", "ContextRenderer", "Environment", "MultiTurnResult", "ObservationEncoder",
           "chat_context_renderer", "chat_observation_encoder", "run_multi_turn"]


class _Engine(Protocol):
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingOptions,
                 seed: int | None = None) -> RolloutBatch: ...


@dataclasses.dataclass
class MultiTurnResult:
    """A multi-turn `generate`: the batch (`RolloutSample.turn_ids` set), each sample's environment reward (sum
    over its steps) and its final `EnvState`."""

    batch: RolloutBatch
    env_rewards: list[float]
    states: list[EnvState]


def chat_observation_encoder(tokenizer: Any) -> ObservationEncoder:
    """Observation text as the ids of a chat user turn that follows the assistant's turn, tokenized once.

    The chat template renders `[user, assistant, user(obs)]` with the generation prompt; the text after the
    assistant's content is what goes between a turn and the next one (e.g. ChatML
    `<|im_end|>\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n`). When the turn already ended
    with the eos token (vLLM returns it) its text is not repeated. Without a chat template: the plain text.
    """
    def plain(text: str, turn: list[int]) -> list[int]:
        del turn
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    if not getattr(tokenizer, "chat_template", None):
        return plain
    mark_turn, mark_obs = "NRCTURNMARK", "NRCOBSMARK"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": mark_turn},
         {"role": "user", "content": mark_obs}], add_generation_prompt=True, tokenize=False)
    if not isinstance(rendered, str) or mark_turn not in rendered or mark_obs not in rendered:
        return plain
    between = rendered[rendered.index(mark_turn) + len(mark_turn):]
    before, after = between.split(mark_obs, 1)
    eos_text, eos_id = getattr(tokenizer, "eos_token", None), getattr(tokenizer, "eos_token_id", None)

    def encode(text: str, turn: list[int]) -> list[int]:
        head = before
        if eos_text and turn and turn[-1] == eos_id and head.startswith(eos_text):
            head = head[len(eos_text):]
        return plain(head + text + after, turn)

    return encode


def chat_context_renderer(tokenizer: Any) -> ContextRenderer:
    """A rewritten history's messages as prompt ids: the chat template with its generation prompt, tokenized once
    (the way the trainer tokenizes a prompt); without a chat template the contents joined by newlines."""
    def render(messages: list[dict[str, str]]) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        text = "\n".join(m["content"] for m in messages)
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    return render


def run_multi_turn(engine: _Engine, prompts: Sequence[Sequence[int]], records: Sequence[Any],
                   sampling: SamplingOptions, env: Environment, *, encode: ObservationEncoder,
                   decode: Callable[[list[int]], str], max_turns: int, max_model_len: int,
                   seed: int | None = None, render: ContextRenderer | None = None) -> MultiTurnResult:
    """Generate `sampling.n` multi-turn trajectories per prompt (module docstring).

    prompts: `[P]` prompt ids; records: `[P]` the prompt records the environment reads (`EnvState.record`).
    sampling: turn 0's sampling (n per prompt); later turns sample 1 per trajectory with the same settings and
        `max_tokens` cut to what fits in `max_model_len`.
    env: the environment, called once per generated turn.
    encode: observation text -> ids (`chat_observation_encoder`); decode: response ids -> text (the sample's
        `text`, for reward functions: decoded for reading, never re-tokenized).
    Returns samples in prompt order then sample order, `n` per prompt, as single-turn `generate`.

    Raises:
        ValueError: `max_turns < 1`.
        TypeError / ValueError: a malformed environment answer (naming the prompt, sample and turn).
    """
    if max_turns < 1:
        raise ValueError(f"rollout.max_turns must be >= 1, got {max_turns}")
    first = engine.generate(prompts, sampling, seed=seed)
    seconds = first.seconds
    trajectories: list[Trajectory] = []
    states: list[EnvState] = []
    indices: list[int] = []
    for sample in first.samples:
        trajectory = Trajectory(prompt_ids=list(sample.prompt_token_ids))
        trajectory.add_turn(sample.token_ids, sample.logprobs, sample.finish_reason)
        trajectories.append(trajectory)
        states.append(EnvState(record=records[sample.prompt_index], turn_texts=[sample.text]))
        indices.append(sample.prompt_index)
    last_turn = [list(s.token_ids) for s in first.samples]
    live = list(range(len(trajectories)))
    for turn in range(1, max_turns + 1):
        pending: list[tuple[int, int]] = []  # (trajectory, max_tokens of its next turn)
        for i in live:
            state, trajectory = states[i], trajectories[i]
            state.turn = turn - 1
            where = f"environment on prompt {indices[i]}, sample {i % max(sampling.n, 1)}, turn {turn - 1}"
            step = parse_env_step(env(state, last_turn[i]), where)
            if step.reward is not None:
                state.rewards.append(float(step.reward))
            if step.done or turn == max_turns:
                trajectory.done = True
                continue
            if step.context is not None:  # a rewritten history: the next turn starts a new exact-prefix segment
                context = _context_ids(step.context, render, where)
                budget = min(sampling.max_tokens, max_model_len - len(context))
                if budget < 1:
                    raise ValueError(f"{where}: the rewritten context has {len(context)} tokens, no room for a turn "
                                     f"within rollout.max_model_len={max_model_len}")
                trajectory.rewrite(context)
                state.observations.append(None)
                pending.append((i, budget))
                continue
            obs = step.observation
            obs_ids = [] if obs is None else (encode(obs, last_turn[i]) if isinstance(obs, str) else list(obs))
            budget = min(sampling.max_tokens, max_model_len - len(trajectory.context) - len(obs_ids))
            if budget < 1:  # the next turn does not fit: the trajectory ends without this observation
                trajectory.done, trajectory.finish_reason = True, "length"
                continue
            state.observations.append(obs)
            trajectory.add_observation(obs_ids)
            pending.append((i, budget))
        if not pending:
            break
        live = [i for i, _ in pending]
        for call in _turn_calls(pending):
            group = [i for i, _ in call]
            turn_sampling = dataclasses.replace(sampling, n=1, max_tokens=call[0][1])
            # trajectory i (its index among this call's samples) gets seed + turn * stride + i: generate seeds
            # prompt j of a call with seed + j, and the calls hold runs of consecutive trajectories
            turn_seed = None if seed is None else seed + turn * TURN_SEED_STRIDE + group[0]
            out = engine.generate([trajectories[i].context for i in group], turn_sampling, seed=turn_seed)
            seconds += out.seconds
            for i, sample in zip(group, out.samples, strict=True):
                trajectories[i].add_turn(sample.token_ids, sample.logprobs, sample.finish_reason)
                states[i].turn_texts.append(sample.text)
                last_turn[i] = list(sample.token_ids)
    samples = [
        RolloutSample(prompt_index=indices[i], prompt_token_ids=t.prompt_ids, token_ids=list(t.response_ids),
                      logprobs=list(t.logprobs), finish_reason=t.finish_reason, text=decode(t.response_ids),
                      turn_ids=list(t.turn_ids), segments=[(s, list(c)) for s, c in t.segments] or None)
        for i, t in enumerate(trajectories)
    ]
    rewards = [float(sum(s.rewards)) for s in states]
    return MultiTurnResult(RolloutBatch(samples, n=first.n, seconds=seconds), rewards, states)


def _turn_calls(pending: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """A turn's `generate` calls: `pending` (trajectory index, max_tokens) cut into maximal runs of consecutive
    trajectory indices with one max_tokens, so each trajectory's seed is `seed + turn * stride + its index` whatever
    the other trajectories do. All trajectories live and far from max_model_len: one call."""
    calls: list[list[tuple[int, int]]] = []
    for item in pending:
        last = calls[-1][-1] if calls else None
        if last is not None and item[0] == last[0] + 1 and item[1] == last[1]:
            calls[-1].append(item)
        else:
            calls.append([item])
    return calls


def _context_ids(context: list[int] | list[dict[str, str]], render: ContextRenderer | None, where: str) -> list[int]:
    """A rewritten history's ids: token ids as they are, chat messages rendered once."""
    if all(isinstance(t, int) for t in context):
        return [int(t) for t in context]  # type: ignore[arg-type]
    if render is None:
        raise ValueError(f"{where}: the environment rewrote the history as chat messages but run_multi_turn got no "
                         "render function (pass render=chat_context_renderer(tokenizer))")
    return render(list(context))  # type: ignore[arg-type]

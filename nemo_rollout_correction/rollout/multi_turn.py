"""Multi-turn bookkeeping: a trajectory's token segments, its masks and the turn index of every token.

Pure Python and torch, no engine: the loop that drives vLLM is `rollout/multi_turn_loop.py`.

A trajectory is the prompt followed by alternating segments: a *turn* (tokens the policy sampled, with the
engine's behaviour logprobs) and an *observation* (tokens the environment appended, never sampled by the
policy). Token in / token out: the sampled ids are kept exactly as the engine returned them and the next turn is
generated from `prompt + all segments so far` as ids, so sampled text is never re-tokenized; an observation
given as text is tokenized once, on its own.

Per response token the trajectory records a *turn id*: the turn index `k >= 0` of a sampled token,
`OBSERVATION` (-1) of an observation token. `RolloutSample.turn_ids` carries that list to the trainer, where
`RolloutBatch.to_tensors` turns it into `loss_mask` (sampled tokens only) and `turn_index` `[S, L - 1]`.

*Rewritten histories.* An environment may replace the context between turns (`EnvStep.context`: drop or
summarise earlier turns). The next turn is then sampled under a context that is not a prefix of the trajectory,
so the trajectory is cut into *exact-prefix segments*: segment 0 starts at the prompt, segment `j >= 1` at the
rewritten context the engine was given. `RolloutSample.segments` records, per segment `j >= 1`, its first
response index and its context ids; `split_segments` turns such a sample into one training row per segment
(prompt = the segment's context, response = its tokens), each trained under the very context it was sampled
with. The trajectory stays one sample for rewards and advantages (broadcast to its rows by the caller).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OBSERVATION = -1
"""The turn id of an observation token (and of every position outside the response in `turn_index`)."""

__all__ = [
    "OBSERVATION",
    "EnvState",
    "EnvStep",
    "Trajectory",
    "multi_turn_counts",
    "parse_env_step",
    "retokenization_drift",
    "split_segments",
    "turn_segments",
]


@dataclass
class EnvState:
    """What an environment sees of one trajectory (one per sample; the environment may keep its own data in
    `scratch`, which persists across the trajectory's turns).

    Attributes:
        record: the prompt record (`tasks.prompts.PromptRecord`: `.prompt`, `.answer`, `.metadata`).
        turn: index of the turn just generated (0 for the first).
        turn_texts: the decoded text of every turn so far (engine text, for reading only: never re-tokenized).
        observations: the observations appended so far, as the environment returned them.
        rewards: the rewards the environment returned so far (None entries skipped).
        scratch: free per-trajectory storage for the environment.
    """

    record: Any
    turn: int = 0
    turn_texts: list[str] = field(default_factory=list)
    observations: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    scratch: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to a turn.

    observation: token ids (appended as they are), text (tokenized once, as an observation; see
        `multi_turn_loop.chat_observation_encoder`), or None (nothing to append).
    done: the trajectory ends after this turn.
    reward: added to the trajectory's reward (the sum over its steps); None adds nothing.
    context: rewrite the history: the next turn is generated from this context *instead of* the trajectory so
        far (compaction: earlier turns dropped or summarised). Token ids (used as they are) or chat messages
        (`[{"role": ..., "content": ...}]`, rendered once with the chat template and its generation prompt).
        Starts a new exact-prefix segment (module docstring); `observation` must then be None.
    """

    observation: list[int] | str | None = None
    done: bool = False
    reward: float | None = None
    context: list[int] | list[dict[str, str]] | None = None


def parse_env_step(value: Any, where: str) -> EnvStep:
    """An `EnvStep` from what an environment returned: an `EnvStep` or a tuple `(observation, done[, reward])`.

    Raises:
        TypeError: anything else, or fields of the wrong type (naming `where`, e.g. the environment and sample).
    """
    if isinstance(value, EnvStep):
        step = value
    elif isinstance(value, tuple) and len(value) in (2, 3):
        step = EnvStep(value[0], value[1], value[2] if len(value) == 3 else None)
    else:
        raise TypeError(f"{where}: an environment must return EnvStep or (observation, done[, reward]), "
                        f"got {type(value).__name__}")
    obs = step.observation
    ids_ok = isinstance(obs, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in obs)
    if obs is not None and not isinstance(obs, str) and not ids_ok:
        raise TypeError(f"{where}: observation must be token ids (list of int), text or None, got {obs!r:.80}")
    ctx = step.context
    if ctx is not None:
        ctx_ids = isinstance(ctx, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ctx)
        ctx_messages = isinstance(ctx, (list, tuple)) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in ctx)
        if not ctx or not (ctx_ids or ctx_messages):
            raise TypeError(f"{where}: context must be non-empty token ids (list of int) or chat messages "
                            f"(list of {{'role': str, 'content': str}}), got {ctx!r:.80}")
        if obs is not None:
            raise ValueError(f"{where}: an EnvStep with a context (a rewritten history) must have observation=None: "
                             "put the observation into the new context")
    if not isinstance(step.done, bool):
        raise TypeError(f"{where}: done must be a bool, got {step.done!r}")
    if step.reward is not None:
        reward = float(step.reward)
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise ValueError(f"{where}: reward must be finite, got {step.reward!r}")
    return step


@dataclass
class Trajectory:
    """One sample's prompt and segments, appended turn by turn (token in / token out).

    `response_ids`, `logprobs` and `turn_ids` are parallel lists over the response (everything after the
    prompt): observation tokens carry logprob 0.0 (never read: the loss mask excludes them) and turn id
    `OBSERVATION`.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    num_turns: int = 0
    finish_reason: str = ""
    done: bool = False
    segments: list[tuple[int, list[int]]] = field(default_factory=list)
    """Rewritten histories: per segment after the first, `(first response index, context ids it started from)`."""

    @property
    def context(self) -> list[int]:
        """The ids the next turn is generated from: the current segment's context and its tokens so far (without a
        rewrite: the prompt and every turn and observation)."""
        if not self.segments:
            return self.prompt_ids + self.response_ids
        start, context = self.segments[-1]
        return context + self.response_ids[start:]

    def rewrite(self, context_ids: Sequence[int]) -> None:
        """Start a new exact-prefix segment: the next turn is generated from `context_ids` alone."""
        self.segments.append((len(self.response_ids), [int(t) for t in context_ids]))

    def add_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str) -> None:
        """Append the engine's sampled ids and their behaviour logprobs as turn `num_turns`."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"turn {self.num_turns}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.turn_ids.extend([self.num_turns] * len(token_ids))
        self.num_turns += 1
        self.finish_reason = finish_reason

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Append observation ids (out of the loss, the IS weights and the statistics)."""
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.turn_ids.extend([OBSERVATION] * len(token_ids))

    @property
    def num_generated_tokens(self) -> int:
        """Sampled tokens (observations excluded)."""
        return sum(1 for t in self.turn_ids if t != OBSERVATION)


def turn_segments(turn_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """The maximal runs of one turn id: `[(turn id, start, stop)]` over response positions, observations included
    (turn id `OBSERVATION`). `turn_segments([0, 0, -1, 1]) == [(0, 0, 2), (-1, 2, 3), (1, 3, 4)]`."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for index in range(1, len(turn_ids) + 1):
        if index == len(turn_ids) or turn_ids[index] != turn_ids[start]:
            segments.append((int(turn_ids[start]), start, index))
            start = index
    return segments


def split_segments(samples: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """One training row per exact-prefix segment (rewritten histories, module docstring).

    samples: `RolloutSample`s; one with `segments` (a rewritten trajectory) becomes `1 + len(segments)` rows, row
    `j` with `prompt_token_ids` = the context segment `j` was sampled from (the prompt for `j = 0`) and its
    slice of `token_ids`, `logprobs` (when present), `turn_ids` and `token_versions`; every other field is the
    sample's (its prompt index, text, finish reason, version). A sample without `segments` is one row as it is.
    Every sampled token lands in exactly one row, so token-denominator losses count it once.

    Returns `(rows, owner)`: the rows in sample order and, per row, the index of its sample (to broadcast the
    trajectory's reward and advantage: `advantages[owner]`).
    """
    rows: list[Any] = []
    owner: list[int] = []
    for index, sample in enumerate(samples):
        segments = getattr(sample, "segments", None)
        if not segments:
            rows.append(sample)
            owner.append(index)
            continue
        bounds = [(0, list(sample.prompt_token_ids))] + [(int(s), list(c)) for s, c in segments]
        ends = [start for start, _ in bounds[1:]] + [len(sample.token_ids)]
        for (start, context), stop in zip(bounds, ends, strict=True):
            if not 0 <= start <= stop <= len(sample.token_ids):
                raise ValueError(f"sample {index}: segment bounds {start}..{stop} outside its "
                                 f"{len(sample.token_ids)} response tokens")
            cut = slice(start, stop)
            rows.append(dataclasses.replace(
                sample, prompt_token_ids=context, token_ids=list(sample.token_ids[cut]),
                logprobs=list(sample.logprobs[cut]) if sample.logprobs else [],
                turn_ids=None if sample.turn_ids is None else list(sample.turn_ids[cut]),
                token_versions=list(sample.token_versions[cut]) if sample.token_versions else [],
                segments=None))
            owner.append(index)
    return rows, owner


def multi_turn_counts(turn_ids: Sequence[Sequence[int] | None]) -> tuple[list[int], int, int]:
    """Per sample its number of turns (1 for a single-turn sample), and the batch's observation and response
    token counts (`turn_ids` of each sample, None for single-turn)."""
    turns, observed, total = [], 0, 0
    for ids in turn_ids:
        ids = list(ids or [])
        turns.append(max(ids, default=0) + 1)
        observed += sum(1 for t in ids if t == OBSERVATION)
        total += len(ids)
    return turns, observed, total


def retokenization_drift(tito_ids: Sequence[int], retokenized_ids: Sequence[int]) -> tuple[int, int]:
    """What re-tokenizing a conversation's chat text would change: `(differing, total)` token ids.

    tito_ids: the trajectory as the trainer trains it, token in / token out (prompt + turns + observations);
    retokenized_ids: the same conversation rendered as chat text and tokenized again. `differing` counts the
    token-in/token-out ids an optimal alignment (`difflib`, no junk heuristic) leaves unmatched: tokens a
    re-tokenizing trainer would score under other ids or other contexts. `total = len(tito_ids)`.
    """
    matcher = difflib.SequenceMatcher(a=list(tito_ids), b=list(retokenized_ids), autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return len(tito_ids) - matched, len(tito_ids)

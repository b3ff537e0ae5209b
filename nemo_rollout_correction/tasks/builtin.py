"""Built-in tasks: a set of prompt records plus the reward function that scores them.

- ``arithmetic``: locally generated "What is a + b?" / "What is a - b?" problems with operands in
  ``[0, max_operand]``; reward: :func:`~nemo_rollout_correction.tasks.rewards.arithmetic_reward`.
- ``length_target``: short generic writing instructions; reward:
  :func:`~nemo_rollout_correction.tasks.rewards.length_target_reward`, 0 when the response has
  ``target_length`` tokens (the length task of TRL's rollout-correction experiments, seed 000).
- ``calculator`` / ``arithmetic_feedback`` / ``arithmetic_compaction``: multi-turn arithmetic (the ``arithmetic``
  problems) with an environment: a calculator tool, feedback after a wrong answer, or a history compacted after a
  wrong answer (tasks/environments.py, docs/multi_turn.md); reward: the environment's
  (:func:`~nemo_rollout_correction.tasks.env_reward.environment_reward`).
- ``length_feedback``: multi-turn on the ``length_target`` instructions: a turn off the target length gets told
  its length and tries again; reward: the length score of the last turn (the environment's, tasks/environments.py).
- ``dataset``: a user's JSONL/Parquet file (``dataset_path``); reward: ``reward_fn`` if given,
  else the numeric-answer reward when every record has a numeric answer.

Everything is generated from ``seed`` with a local RNG: no download, same records on every rank.

Held-out split (``num_eval_prompts``, the ``eval`` section): ``arithmetic`` holds out the last problems of
its seeded shuffle and never trains on them; ``length_target`` has its own held-out instructions
(:data:`LENGTH_TARGET_HELD_OUT_INSTRUCTIONS`), none of them a training instruction; ``dataset`` has no split
of its own (``eval.dataset`` names a held-out file).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rollout_correction.config.schema import (  # TASK_NAMES re-exported: the config's Literal
    TASK_NAMES,
    TrainConfig,
)
from nemo_rollout_correction.tasks.env_reward import environment_reward
from nemo_rollout_correction.tasks.environments import CALCULATOR_INSTRUCTION, MULTI_TURN_ENVIRONMENTS
from nemo_rollout_correction.tasks.prompts import PromptRecord, load_prompt_dataset
from nemo_rollout_correction.tasks.reward_pool import RewardPool
from nemo_rollout_correction.tasks.rewards import (
    arithmetic_reward,
    length_target_reward,
    load_reward_fn,
    reward_fn_name,
)

__all__ = [
    "LENGTH_TARGET_HELD_OUT_INSTRUCTIONS",
    "LENGTH_TARGET_INSTRUCTIONS",
    "TASK_NAMES",
    "Task",
    "arithmetic_records",
    "arithmetic_split",
    "build_task",
    "length_target_held_out_records",
    "length_target_records",
    "task_from_config",
]

ARITHMETIC_OPERATIONS = ("+", "-")
# Above this many distinct problems, draw by rejection instead of enumerating them all.
_ENUMERATE_LIMIT = 200_000

LENGTH_TARGET_INSTRUCTIONS: tuple[str, ...] = (
    "Write a sentence about the sea.",
    "Describe a rainy morning.",
    "Tell me something about cats.",
    "Write a short note to a friend.",
    "Describe your favourite food.",
    "Write a sentence about the moon.",
    "Explain what a bicycle is.",
    "Describe a busy market.",
    "Write a line about autumn leaves.",
    "Tell me about a quiet library.",
    "Describe the smell of fresh bread.",
    "Write a sentence about mountains.",
    "Explain why people like music.",
    "Describe a walk in the park.",
    "Write a short greeting for a birthday card.",
    "Tell me about a river.",
    "Describe a sunset over a city.",
    "Write a sentence about winter.",
    "Explain what a garden needs.",
    "Describe a cup of coffee.",
    "Write a sentence about the stars.",
    "Tell me about a train journey.",
    "Describe a child playing.",
    "Write a line about the wind.",
    "Explain what makes a good friend.",
    "Describe an old house.",
    "Write a sentence about a forest.",
    "Tell me about the desert.",
    "Describe a thunderstorm.",
    "Write a short thank-you message.",
    "Explain what a map is for.",
    "Describe a snowy street.",
    "Write a sentence about birds.",
    "Tell me about a lighthouse.",
    "Describe the first day of spring.",
    "Write a line about a candle.",
    "Explain why sleep matters.",
    "Describe a fishing boat.",
    "Write a sentence about a bridge.",
    "Tell me about a small village.",
    "Describe the taste of an orange.",
    "Write a sentence about the ocean waves.",
    "Explain what a calendar does.",
    "Describe a crowded bus.",
    "Write a line about a summer night.",
    "Tell me about a mountain lake.",
    "Describe a painting you like.",
    "Write a sentence about a dog.",
    "Explain what a clock is.",
    "Describe a walk on the beach.",
)

# Never trained on: the held-out split of length_target (evaluation).
LENGTH_TARGET_HELD_OUT_INSTRUCTIONS: tuple[str, ...] = (
    "Describe a rowing boat on a lake.",
    "Write a sentence about a volcano.",
    "Tell me about a night market.",
    "Describe a pair of old boots.",
    "Write a line about morning fog.",
    "Explain what a compass does.",
    "Describe a kitchen at dinner time.",
    "Write a sentence about a waterfall.",
    "Tell me about an island.",
    "Describe a field of sunflowers.",
    "Write a short apology note.",
    "Explain why bees matter.",
    "Describe a windy harbour.",
    "Write a sentence about a violin.",
    "Tell me about a mountain hut.",
    "Describe a bowl of soup.",
)


@dataclass(frozen=True)
class Task:
    """Prompt records and the reward that scores their completions.

    Attributes:
        name: one of :data:`TASK_NAMES`.
        records: ``[num_records]`` prompts.
        reward_fn: a :class:`~nemo_rollout_correction.tasks.rewards.RewardFn`, or a
            :class:`~nemo_rollout_correction.tasks.reward_pool.RewardPool` around one
            (``reward_workers >= 1``); either way ``rewards.score(task.reward_fn, ...)`` scores with it.
        reward_name: ``module:qualname`` of the reward function, for logs.
        eval_records: ``[num_eval_prompts]`` held-out prompts, disjoint from ``records`` (empty unless asked).
        success_threshold: a completion is correct when its reward is at least this (pass@k); None when
            the reward has no notion of correctness.
        environment: the multi-turn environment (``calculator``, ``arithmetic_feedback`` or ``environment=``
            of :func:`build_task`); None for a single-turn task.
    """

    name: str
    records: list[PromptRecord]
    reward_fn: Callable[..., Sequence[float]]
    reward_name: str
    eval_records: list[PromptRecord] = field(default_factory=list)
    success_threshold: float | None = None
    environment: Callable[..., Any] | None = None
    """Multi-turn: `env(state, turn_token_ids) -> EnvStep` (rollout/multi_turn.py); None: single-turn."""

    def close(self) -> None:
        """Stop the reward worker processes, if any (a later score starts them again)."""
        if isinstance(self.reward_fn, RewardPool):
            self.reward_fn.close()


def arithmetic_records(
    num_prompts: int, max_operand: int = 10, seed: int = 0, operations: Sequence[str] = ARITHMETIC_OPERATIONS
) -> list[PromptRecord]:
    """``[num_prompts]`` problems "What is a <op> b?" with ``a, b`` in ``[0, max_operand]``.

    Subtraction puts the larger operand first so every answer is a non-negative integer (the task
    measures learning, not a 135M model's grasp of negative numbers). Problems are distinct while
    ``num_prompts`` does not exceed the number of distinct problems; beyond that the shuffled set
    repeats. Deterministic in ``(num_prompts, max_operand, seed, operations)``.
    """
    return arithmetic_split(num_prompts, 0, max_operand=max_operand, seed=seed, operations=operations)[0]


def arithmetic_split(
    num_prompts: int, num_held_out: int, max_operand: int = 10, seed: int = 0,
    operations: Sequence[str] = ARITHMETIC_OPERATIONS,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Training problems (as :func:`arithmetic_records`) and ``num_held_out`` distinct problems never trained on.

    The held-out problems are the last ``num_held_out`` of the seeded shuffle (or, for a huge problem
    space, drawn after the training ones); the training records cycle over the others. With
    ``num_held_out=0`` the training records are exactly :func:`arithmetic_records`'.

    Raises:
        ValueError: a bad option, or ``num_held_out`` leaves no problem to train on.
    """
    _check_positive("num_prompts", num_prompts)
    _check_positive("max_operand", max_operand)
    if isinstance(num_held_out, bool) or not isinstance(num_held_out, int) or num_held_out < 0:
        raise ValueError(f"num_held_out must be an integer >= 0, got {num_held_out!r}")
    unknown = [op for op in operations if op not in ARITHMETIC_OPERATIONS]
    if not operations or unknown:
        raise ValueError(f"operations must be a non-empty subset of {ARITHMETIC_OPERATIONS}, got {tuple(operations)}")
    operations = tuple(dict.fromkeys(operations))
    rng = random.Random(f"arithmetic-{seed}")  # str seeds hash deterministically (unlike hash())
    span = max_operand + 1
    per_op = {"+": span * span, "-": span * (span + 1) // 2}
    total = sum(per_op[op] for op in operations)
    if num_held_out >= total:
        raise ValueError(f"eval.num_prompts={num_held_out} held-out arithmetic problems leave none of the {total} "
                         f"distinct problems (task.max_operand={max_operand}) to train on; lower eval.num_prompts or "
                         "raise task.max_operand")
    if total <= _ENUMERATE_LIMIT:
        problems = [(a, op, b) for op in operations for a in range(span) for b in range(span) if op == "+" or a >= b]
        rng.shuffle(problems)
        train = problems[: len(problems) - num_held_out]
        held_out = problems[len(problems) - num_held_out:]
    else:  # huge space: rejection-sample distinct problems (num_prompts + num_held_out << total)
        seen: set[tuple[int, str, int]] = set()
        problems = []
        wanted = min(num_prompts, total - num_held_out) + num_held_out
        while len(problems) < wanted:
            op, a, b = rng.choice(operations), rng.randrange(span), rng.randrange(span)
            problem = (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)
            if problem not in seen:
                seen.add(problem)
                problems.append(problem)
        train, held_out = problems[: wanted - num_held_out], problems[wanted - num_held_out:]
    return ([_arithmetic_record(*train[i % len(train)]) for i in range(num_prompts)],
            [_arithmetic_record(*problem) for problem in held_out])


def _arithmetic_record(a: int, op: str, b: int) -> PromptRecord:
    answer = a + b if op == "+" else a - b
    return PromptRecord(prompt=f"What is {a} {op} {b}?", answer=str(answer),
                        metadata={"task": "arithmetic", "a": a, "b": b, "op": op})


def length_target_held_out_records(num_prompts: int, target_length: int = 16, seed: int = 0) -> list[PromptRecord]:
    """``[num_prompts]`` held-out instructions (:data:`LENGTH_TARGET_HELD_OUT_INSTRUCTIONS`, seeded order).

    Raises:
        ValueError: more prompts than the 16 held-out instructions.
    """
    if num_prompts > len(LENGTH_TARGET_HELD_OUT_INSTRUCTIONS):
        raise ValueError(f"eval.num_prompts={num_prompts}: length_target holds out "
                         f"{len(LENGTH_TARGET_HELD_OUT_INSTRUCTIONS)} instructions; lower it or set eval.dataset")
    order = list(LENGTH_TARGET_HELD_OUT_INSTRUCTIONS)
    random.Random(f"length_target-eval-{seed}").shuffle(order)
    return [PromptRecord(prompt=text, answer=None, metadata={"task": "length_target", "target_length": target_length})
            for text in order[:num_prompts]]


def length_target_records(num_prompts: int, target_length: int = 16, seed: int = 0) -> list[PromptRecord]:
    """``[num_prompts]`` instructions from :data:`LENGTH_TARGET_INSTRUCTIONS`, each with ``target_length`` tokens.

    The 50 instructions are shuffled by ``seed`` and cycled when ``num_prompts`` exceeds 50.
    """
    _check_positive("num_prompts", num_prompts)
    _check_positive("target_length", target_length)
    order = list(LENGTH_TARGET_INSTRUCTIONS)
    random.Random(f"length_target-{seed}").shuffle(order)
    return [
        PromptRecord(
            prompt=order[index % len(order)],
            answer=None,
            metadata={"task": "length_target", "target_length": target_length},
        )
        for index in range(num_prompts)
    ]


def build_task(
    name: str,
    *,
    num_prompts: int = 256,
    seed: int = 0,
    max_operand: int = 10,
    target_length: int = 16,
    dataset_path: str | Path | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    reward_fn: str | Callable[..., Sequence[float]] | None = None,
    reward_workers: int = 0,
    reward_timeout_s: float = 60.0,
    num_eval_prompts: int = 0,
    environment: Callable[..., Any] | None = None,
    **unused: Any,
) -> Task:
    """Build a task from the ``task:`` config section (see docs/tasks.md).

    Args:
        name: ``arithmetic``, ``length_target`` or ``dataset``.
        num_prompts: records generated by the built-in tasks (ignored by ``dataset``, which uses the file).
        seed: generator seed of the built-in tasks.
        max_operand: ``arithmetic``: largest operand.
        target_length: ``length_target``: target response length in tokens.
        dataset_path, prompt_key, answer_key: ``dataset``: the file and its field names.
        reward_fn: overrides the task's default reward: a callable, a built-in name
            (``arithmetic``, ``length_target``) or ``"pkg.module:callable"`` / ``"file.py:callable"``.
        reward_workers: 0 scores in this process (one call per step); ``N >= 1`` scores in a pool of ``N``
            processes, one call per completion (see ``tasks/reward_pool.py`` for what that needs).
        reward_timeout_s: with a pool, the bound on one call in seconds.
        environment: a multi-turn environment for any task (docs/tasks.md); the multi-turn built-ins bring their
            own.
        num_eval_prompts: held-out prompts to set aside in ``Task.eval_records`` (built-in tasks only;
            ``arithmetic`` then trains without them).
        **unused: other ``task`` fields (``prompts_per_step``, ``use_chat_template``) are accepted and
            ignored, so the whole config section can be passed.

    Raises:
        ValueError: unknown task name, ``dataset`` without ``dataset_path``, a dataset without a
            ``reward_fn`` whose answers are not all numeric, or a bad option value.
        DatasetError, RewardError: from loading the file or the reward function (or a reward function
            that cannot be pickled for the pool).
    """
    del unused
    held_out: list[PromptRecord] = []
    if name == "arithmetic":
        records, held_out = arithmetic_split(num_prompts, num_eval_prompts, max_operand=max_operand, seed=seed)
        default: Callable[..., Sequence[float]] | None = arithmetic_reward
    elif name == "length_target":
        records = length_target_records(num_prompts, target_length=target_length, seed=seed)
        if num_eval_prompts:
            held_out = length_target_held_out_records(num_eval_prompts, target_length=target_length, seed=seed)
        default = length_target_reward
    elif name == "length_feedback":
        records = length_target_records(num_prompts, target_length=target_length, seed=seed)
        if num_eval_prompts:
            held_out = length_target_held_out_records(num_eval_prompts, target_length=target_length, seed=seed)
        default = environment_reward
        environment = environment if environment is not None else MULTI_TURN_ENVIRONMENTS[name]
    elif name in MULTI_TURN_ENVIRONMENTS:
        records, held_out = arithmetic_split(num_prompts, num_eval_prompts, max_operand=max_operand, seed=seed)
        if name == "calculator":
            records, held_out = _with_instruction(records), _with_instruction(held_out)
        default = environment_reward
        environment = environment if environment is not None else MULTI_TURN_ENVIRONMENTS[name]
    elif name == "dataset":
        if dataset_path is None:
            raise ValueError("task.name=dataset needs task.dataset_path=<file.jsonl|file.parquet>")
        if num_eval_prompts:
            raise ValueError("task.name=dataset has no built-in held-out split: set eval.dataset=<file> for evaluation")
        records = load_prompt_dataset(dataset_path, prompt_key=prompt_key, answer_key=answer_key)
        default = arithmetic_reward if reward_fn is None and _all_numeric_answers(records, dataset_path) else None
    else:
        raise ValueError(f"unknown task.name {name!r}; allowed: {', '.join(TASK_NAMES)}")
    if reward_fn is None:
        resolved = default
    elif isinstance(reward_fn, str):
        resolved = load_reward_fn(reward_fn)
    elif callable(reward_fn):
        resolved = reward_fn
    else:
        raise ValueError(f"task.reward_fn must be a string 'pkg.module:callable' or a callable, got {reward_fn!r}")
    assert resolved is not None  # dataset without numeric answers raised in _all_numeric_answers
    reward_name = reward_fn_name(resolved)
    if isinstance(reward_workers, bool) or not isinstance(reward_workers, int) or reward_workers < 0:
        raise ValueError(f"task.reward_workers must be an integer >= 0, got {reward_workers!r}")
    # correctness (pass@k): the binary numeric-answer reward's 1.0; other rewards have no known notion
    threshold = 1.0 if resolved is arithmetic_reward else None
    if reward_workers > 0:
        # A string spec is loaded again in each worker: a file spec's module exists only in this process.
        spec = reward_fn if isinstance(reward_fn, str) else None
        resolved = RewardPool(resolved, reward_workers, reward_timeout_s, spec=spec)
    return Task(name=name, records=records, reward_fn=resolved, reward_name=reward_name, eval_records=held_out,
                success_threshold=threshold, environment=environment)


def _with_instruction(records: list[PromptRecord]) -> list[PromptRecord]:
    """The calculator task's prompts: the arithmetic problem plus how to call the calculator and answer."""
    return [dataclasses.replace(r, prompt=r.prompt + CALCULATOR_INSTRUCTION,
                                metadata={**r.metadata, "task": "calculator"}) for r in records]


def task_from_config(cfg: TrainConfig, *, num_eval_prompts: int = 0) -> Task:
    """The configured task (`task:` section, seeded by `run.seed`): what `nrc train` trains on and `nrc audit`
    samples from, built the same way on every rank. `num_eval_prompts` > 0 holds out that many prompts for
    evaluation (see `build_task`)."""
    options = dataclasses.asdict(cfg.task)
    name = options.pop("name")
    return build_task(name, seed=cfg.run.seed, num_eval_prompts=num_eval_prompts, **options)


def _all_numeric_answers(records: list[PromptRecord], path: str | Path) -> bool:
    """True if every record has a numeric answer; raises with the first offender otherwise."""
    for index, record in enumerate(records):
        try:
            float((record.answer or "").replace(",", ""))
        except ValueError:
            raise ValueError(
                f"{path}: record {index} has answer {record.answer!r}, so the default numeric-answer reward "
                "does not apply; set task.reward_fn=pkg.module:callable (or a built-in: arithmetic, length_target)"
            ) from None
    return True


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

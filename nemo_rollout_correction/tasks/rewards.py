"""Reward functions: the protocol, the built-ins, loading a user's function, and checked scoring.

A reward function scores a batch of completions, one float per completion::

    def my_reward(prompts, completions, records, completion_token_counts) -> list[float]: ...

All four arguments are lists of the same length ``[num_completions]`` (one entry per sampled
completion, so a prompt sampled ``n`` times appears ``n`` times, consecutively):

- ``prompts``: the prompt text as given in the dataset (before any chat template),
- ``completions``: the generated text, special tokens removed,
- ``records``: the :class:`~nemo_rollout_correction.tasks.prompts.PromptRecord` of each prompt
  (``answer`` and ``metadata`` carry the reference data),
- ``completion_token_counts``: number of generated tokens (the policy's tokenizer).

The trainer calls it with keyword arguments, so a function may take only what it needs plus
``**kwargs`` (TRL style: ``def fn(completions, **kwargs)``). Rewards must be finite real
numbers; :func:`score` checks that and names the function, the index and the value otherwise.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from nemo_rollout_correction.tasks.prompts import PromptRecord

__all__ = [
    "BUILTIN_REWARDS",
    "BatchScorer",
    "RewardError",
    "RewardFn",
    "arithmetic_reward",
    "describe_sample",
    "first_number",
    "length_target_reward",
    "load_reward_fn",
    "reward_fn_name",
    "sample_ids_from_records",
    "score",
]

_EXCERPT = 60


class RewardError(ValueError):
    """A reward function cannot be loaded, or it returned something that is not one finite float per completion."""


@runtime_checkable
class RewardFn(Protocol):
    """Scores ``[num_completions]`` completions; returns ``[num_completions]`` finite floats (see module doc)."""

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        records: list[PromptRecord],
        completion_token_counts: list[int],
    ) -> Sequence[float]: ...


@runtime_checkable
class BatchScorer(Protocol):
    """A reward that checks and scores a whole batch itself (:class:`~nemo_rollout_correction.tasks.reward_pool.
    RewardPool`: one bounded call per completion in its workers). :func:`score` hands such an object the batch.

    A protocol, not the class, so that this module does not import the pool module (which imports this one).
    """

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        records: Sequence[PromptRecord],
        completion_token_counts: Sequence[int],
        sample_ids: Sequence[tuple[int, int]] | None = None,
    ) -> list[float]: ...


# A number not glued to a preceding word/number character: "-3", "12", "3.0"; in "x-3" or "5-3" the
# hyphen is an operator, so only the digits count. A trailing "." without digits ("is 5.") is punctuation.
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?\d+(?:\.\d+)?")


def first_number(text: str) -> float | None:
    """The first number in ``text`` (signed, optional decimals), or ``None`` if there is none."""
    match = _NUMBER.search(text.replace(",", ""))  # "1,000" -> 1000
    return float(match.group()) if match else None


def arithmetic_reward(
    prompts: list[str],
    completions: list[str],
    records: list[PromptRecord],
    completion_token_counts: list[int],
    **_: Any,
) -> list[float]:
    """1.0 if the first number in the completion equals the record's answer numerically, else 0.0.

    ``"The answer is 5."``, ``"5"`` and ``"5.0"`` all match answer ``"5"``; ``"-3"`` matches ``"-3"``;
    a completion with no number scores 0.0. Deliberately binary, no partial credit for "some number":
    GRPO normalises rewards within a group, so any correct sample already gets a positive advantage,
    and a format bonus would reward confident wrong answers as much as it helps.

    Raises:
        ValueError: a record has no answer, or an answer that is not a number.
    """
    rewards = []
    for index, (completion, record) in enumerate(zip(completions, records, strict=True)):
        target = _numeric_answer(record, index)
        found = first_number(completion)
        rewards.append(1.0 if found is not None and math.isclose(found, target, rel_tol=0.0, abs_tol=1e-9) else 0.0)
    return rewards


def length_target_reward(
    prompts: list[str],
    completions: list[str],
    records: list[PromptRecord],
    completion_token_counts: list[int],
    **_: Any,
) -> list[float]:
    """``-min(|n_tokens - target| / target, 1)``: 0 at the target length, down to -1 at twice (or zero) length.

    The target is ``record.metadata["target_length"]`` (tokens), so a dataset can give each prompt
    its own. TRL's example (seed 000) uses ``-|20 - len(completion)|`` in characters; counting
    tokens ties the reward to what the policy actually emits, and normalising + clipping keeps it in
    ``[-1, 0]`` whatever the target, so one truncated runaway does not dominate a group.

    Raises:
        ValueError: a record without a positive integer ``target_length`` in its metadata.
    """
    rewards = []
    for index, (count, record) in enumerate(zip(completion_token_counts, records, strict=True)):
        target = record.metadata.get("target_length")
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise ValueError(
                f"length_target_reward: record {index} needs metadata['target_length'] as an integer >= 1, "
                f"got {target!r} (keys: {sorted(record.metadata)})"
            )
        rewards.append(-min(abs(count - target) / target, 1.0))
    return rewards


def _numeric_answer(record: PromptRecord, index: int) -> float:
    if record.answer is None:
        raise ValueError(f"arithmetic_reward: record {index} has no answer (prompt {record.prompt[:60]!r})")
    try:
        return float(record.answer.replace(",", ""))
    except ValueError:
        raise ValueError(
            f"arithmetic_reward: record {index} answer {record.answer!r} is not a number; "
            "use task.reward_fn=pkg.mod:fn for non-numeric answers"
        ) from None


BUILTIN_REWARDS: dict[str, Callable[..., Sequence[float]]] = {
    "arithmetic": arithmetic_reward,
    "length_target": length_target_reward,
}


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a function (or its repr), for messages and logs."""
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}:{qualname}" if module else qualname


def load_reward_fn(spec: str) -> Callable[..., Sequence[float]]:
    """Resolve a reward function from ``"pkg.module:callable"``, ``"path/to/file.py:callable"`` or a built-in name.

    The part after ``:`` may be dotted (``"pkg.mod:Class.method"``). Built-in names:
    ``arithmetic``, ``length_target``. A ``.py`` path is loaded as a standalone module (it need not
    be on ``sys.path``); relative paths are relative to the current directory.

    Raises:
        RewardError: bad format, module not importable (with the underlying error), attribute
            missing (lists the module's public callables), or not callable.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward_fn must be a non-empty string 'pkg.module:callable', got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, colon, attr_path = spec.rpartition(":")
    if not colon or not module_name or not attr_path:
        raise RewardError(
            f"reward_fn {spec!r} is not of the form 'pkg.module:callable' or 'path/to/file.py:callable' "
            f"(or a built-in: {', '.join(BUILTIN_REWARDS)})"
        )
    module = _import_module(module_name, spec)
    target: Any = module
    for depth, part in enumerate(attr_path.split(".")):
        if not hasattr(target, part):
            where = module_name if depth == 0 else f"{module_name}:{'.'.join(attr_path.split('.')[:depth])}"
            available = sorted(
                name for name in dir(target) if not name.startswith("_") and callable(getattr(target, name, None))
            )
            close = difflib.get_close_matches(part, available, n=3, cutoff=0.6)
            # a long listing buries the answer: show close matches when there are any, else a capped list
            shown = f"did you mean {close}?" if close else f"callables there: {available[:30]}"
            raise RewardError(f"reward_fn {spec!r}: {where} has no attribute {part!r}; {shown}")
        target = getattr(target, part)
    if not callable(target):
        raise RewardError(f"reward_fn {spec!r}: {attr_path} is a {type(target).__name__}, not callable")
    fn: Callable[..., Sequence[float]] = target
    return fn


def _import_module(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise RewardError(f"reward_fn {spec!r}: file {path} not found")
        # A unique, readable module name per file (tracebacks show it); sha1 is stable across processes.
        name = f"_nrc_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise RewardError(f"reward_fn {spec!r}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            reason = f"{type(error).__name__}: {error}"
            raise RewardError(f"reward_fn {spec!r}: executing {path} failed: {reason}") from error
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise RewardError(
                f"reward_fn {spec!r}: module {module_name!r} not found (is it installed or on PYTHONPATH? "
                "a file path like 'path/to/file.py:fn' also works)"
            ) from error
        raise RewardError(f"reward_fn {spec!r}: importing {module_name!r} failed: {error}") from error
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
        raise RewardError(f"reward_fn {spec!r}: importing {module_name!r} failed: {reason}") from error


def describe_sample(prompt_index: int, sample_index: int, prompt: str) -> str:
    """``prompt 3, sample 1 ('What is 2 + 5?')``: how errors name one completion (prompt excerpt capped)."""
    excerpt = prompt if len(prompt) <= _EXCERPT else prompt[: _EXCERPT - 3] + "..."
    return f"prompt {prompt_index}, sample {sample_index} ({excerpt!r})"


def sample_ids_from_records(records: Sequence[PromptRecord]) -> list[tuple[int, int]]:
    """``[(prompt_index, sample_index)]`` from the layout the trainer passes: the samples of one prompt are
    consecutive and share one record object.

    For naming samples in errors when the caller did not pass exact ids; a record repeated back to back
    in one step (a dataset smaller than a step) is then counted as one prompt.
    """
    ids: list[tuple[int, int]] = []
    prompt, sample = -1, 0
    for index, record in enumerate(records):
        if index == 0 or record is not records[index - 1]:
            prompt, sample = prompt + 1, 0
        else:
            sample += 1
        ids.append((prompt, sample))
    return ids


def score(
    reward_fn: Callable[..., Any],
    prompts: Sequence[str],
    completions: Sequence[str],
    records: Sequence[PromptRecord],
    completion_token_counts: Sequence[int],
    sample_ids: Sequence[tuple[int, int]] | None = None,
) -> list[float]:
    """Call ``reward_fn`` with keyword arguments and check its output.

    A :class:`~nemo_rollout_correction.tasks.reward_pool.RewardPool` (``task.reward_workers >= 1``)
    scores in its worker processes, one bounded call per completion; anything else is called once, here.

    Args:
        reward_fn: a :class:`RewardFn` or a ``RewardPool``.
        prompts, completions, records, completion_token_counts: ``[num_completions]`` each.
        sample_ids: optional ``[num_completions]`` ``(prompt_index, sample_index)``; errors then name the
            sample (with a prompt excerpt) instead of its index in the batch.

    Returns:
        ``[num_completions]`` finite Python floats.

    Raises:
        ValueError: the inputs have different lengths (a trainer bug, not the reward's).
        RewardError: the function raised, returned a non-sequence or the wrong number of values,
            or a value that is not a real number or is NaN/inf; the message names the function,
            the sample and the value. A pool also raises it for a call past ``task.reward_timeout_s``.
    """
    if isinstance(reward_fn, BatchScorer):
        return reward_fn.score(prompts, completions, records, completion_token_counts, sample_ids=sample_ids)
    num = len(completions)
    lengths = {
        "prompts": len(prompts),
        "records": len(records),
        "completion_token_counts": len(completion_token_counts),
    }
    if sample_ids is not None:
        lengths["sample_ids"] = len(sample_ids)
    if any(length != num for length in lengths.values()):
        raise ValueError(f"score: inputs differ in length: completions={num}, {lengths}")
    name = reward_fn_name(reward_fn)

    def where(index: int) -> str:
        if sample_ids is None:
            return f"index {index}"
        return describe_sample(sample_ids[index][0], sample_ids[index][1], prompts[index])

    try:
        output = reward_fn(
            prompts=list(prompts),
            completions=list(completions),
            records=list(records),
            completion_token_counts=list(completion_token_counts),
        )
    except Exception as error:
        # one completion per call (the pool's workers): the failing sample is known
        on = f" on {where(0)}" if sample_ids is not None and num == 1 else ""
        raise RewardError(f"reward fn {name} raised {type(error).__name__}{on}: {error}") from error
    if hasattr(output, "tolist") and not isinstance(output, list | tuple):  # numpy arrays and torch tensors
        output = output.tolist()
    if isinstance(output, str | bytes) or not isinstance(output, Sequence):
        raise RewardError(f"reward fn {name} must return a list of floats, got {type(output).__name__}")
    if len(output) != num:
        raise RewardError(f"reward fn {name} returned {len(output)} values for {num} completions")
    rewards = []
    for index, value in enumerate(output):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"reward fn {name}: value at {where(index)} is not a real number: {value!r}")
        if not math.isfinite(value):
            raise RewardError(f"reward fn {name}: value at {where(index)} is not finite: {value!r}")
        rewards.append(float(value))
    return rewards

"""Built-in rewards on hand-written completions, loading custom rewards, and checked scoring."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.tasks.rewards import (
    RewardError,
    RewardFn,
    arithmetic_reward,
    first_number,
    length_target_reward,
    load_reward_fn,
    score,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def _arith(completions: list[str], answer: str) -> list[float]:
    n = len(completions)
    return arithmetic_reward(["q"] * n, completions, [PromptRecord("q", answer)] * n, [1] * n)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 5.", 5.0),
        ("5", 5.0),
        ("-3", -3.0),
        ("It is -3 degrees", -3.0),
        ("3.0", 3.0),
        ("1,000 apples", 1000.0),
        ("5-3=2", 5.0),  # the operator "-" after a digit is not a sign
        ("x-3", 3.0),
        ("+7", 7.0),
        ("no number here", None),
        ("", None),
    ],
)
def test_first_number(text: str, expected: float | None) -> None:
    assert first_number(text) == expected


def test_arithmetic_reward_on_hand_written_completions() -> None:
    completions = ["The answer is 5.", "5", "5.0", "**5**", "6", "2 + 3 = 5", "five", ""]
    assert _arith(completions, "5") == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert _arith(["-3", "3", "The result is -3.", "3.0"], "-3") == [1.0, 0.0, 1.0, 0.0]
    assert _arith(["3.0", "3.01"], "3") == [1.0, 0.0]


def test_arithmetic_reward_needs_numeric_answers() -> None:
    with pytest.raises(ValueError, match="record 0 has no answer"):
        arithmetic_reward(["q"], ["5"], [PromptRecord("q")], [1])
    with pytest.raises(ValueError, match="record 0 answer 'Paris' is not a number"):
        arithmetic_reward(["q"], ["5"], [PromptRecord("q", "Paris")], [1])


def test_length_target_reward() -> None:
    record = PromptRecord("Write.", None, {"target_length": 16})
    counts = [16, 12, 20, 8, 32, 0, 100]
    rewards = length_target_reward(["p"] * 7, ["c"] * 7, [record] * 7, counts)
    assert rewards == [0.0, -0.25, -0.25, -0.5, -1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match=r"record 0 needs metadata\['target_length'\].*got None"):
        length_target_reward(["p"], ["c"], [PromptRecord("p")], [3])


def test_builtins_satisfy_the_protocol() -> None:
    assert isinstance(arithmetic_reward, RewardFn)
    assert isinstance(length_target_reward, RewardFn)


# ---------------------------------------------------------------- load_reward_fn


def test_load_builtin_and_module_path() -> None:
    assert load_reward_fn("arithmetic") is arithmetic_reward
    assert load_reward_fn("length_target") is length_target_reward
    assert load_reward_fn("nemo_rollout_correction.tasks.rewards:arithmetic_reward") is arithmetic_reward
    assert load_reward_fn("math:fabs") is math.fabs
    assert load_reward_fn("pathlib:Path.home") == Path.home  # dotted attribute after the colon


def test_load_custom_reward_from_examples_file() -> None:
    fn = load_reward_fn(f"{EXAMPLES / 'custom_reward.py'}:contains_answer")
    records = [PromptRecord("Capital of France?", "Paris"), PromptRecord("Capital of Peru?", "Lima")]
    completions = ["It is paris.", "Cusco", "LIMA " * 10]
    rewards = score(fn, ["a", "b", "b"], completions, [records[0], records[1], records[1]], [4, 2, 36])
    assert rewards == pytest.approx([1.0, 0.0, 1.0 - 0.005 * 20])


def test_load_custom_reward_as_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "custom_reward", raising=False)
    fn = load_reward_fn("custom_reward:contains_answer")
    assert fn.__name__ == "contains_answer"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "must be a non-empty string"),
        ("no_colon_here", r"not of the form 'pkg.module:callable'.*built-in: arithmetic, length_target"),
        (":fn", "not of the form"),
        ("math:", "not of the form"),
        ("surely_not_a_module_xyz:fn", r"module 'surely_not_a_module_xyz' not found"),
        ("nemo_rollout_correction.nope:fn", r"module 'nemo_rollout_correction.nope' not found"),
        ("math:no_such_fn", r"math has no attribute 'no_such_fn'; callables there: \[.*'fabs'"),
        ("math:fbas", r"math has no attribute 'fbas'; did you mean \['fabs'"),
        ("pathlib:Path.nope", r"pathlib:Path has no attribute 'nope'"),
        ("math:pi", "pi is a float, not callable"),
        ("/no/such/file.py:fn", "file /no/such/file.py not found"),
    ],
)
def test_load_reward_fn_errors(spec: str, match: str) -> None:
    with pytest.raises(RewardError, match=match):
        load_reward_fn(spec)


def test_load_reward_fn_reports_errors_inside_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken_reward_mod.py"
    broken.write_text("import surely_missing_dependency_xyz\n\ndef fn(**kw):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # the module exists but its own import fails: say so, not "module not found"
    with pytest.raises(RewardError, match=r"importing 'broken_reward_mod' failed: No module named 'surely_missing"):
        load_reward_fn("broken_reward_mod:fn")
    with pytest.raises(RewardError, match=r"executing .*broken_reward_mod\.py failed: ModuleNotFoundError"):
        load_reward_fn(f"{broken}:fn")
    syntax = tmp_path / "syntax_reward_mod.py"
    syntax.write_text("def fn(:\n")
    with pytest.raises(RewardError, match="importing 'syntax_reward_mod' failed: SyntaxError"):
        load_reward_fn("syntax_reward_mod:fn")


# ---------------------------------------------------------------- score


def _score(fn: Any, n: int = 3) -> list[float]:
    return score(fn, ["p"] * n, ["c"] * n, [PromptRecord("p")] * n, [1] * n)


def test_score_accepts_lists_arrays_and_tensors() -> None:
    assert _score(lambda **kw: [0, 1, 2.5]) == [0.0, 1.0, 2.5]
    assert _score(lambda **kw: np.array([0.5, 1.0, -1.0], dtype=np.float32)) == [0.5, 1.0, -1.0]
    assert _score(lambda **kw: torch.tensor([1.0, 2.0, 3.0])) == [1.0, 2.0, 3.0]
    assert _score(lambda **kw: (np.float64(1), np.int64(2), 3)) == [1.0, 2.0, 3.0]
    assert all(type(value) is float for value in _score(lambda **kw: np.array([1, 2, 3])))


def test_score_passes_keywords_so_trl_style_functions_work() -> None:
    def trl_style(completions: list[str], **kwargs: Any) -> list[float]:
        assert set(kwargs) == {"prompts", "records", "completion_token_counts"}
        return [float(len(c)) for c in completions]

    assert score(trl_style, ["p", "p"], ["ab", "abcd"], [PromptRecord("p")] * 2, [1, 2]) == [2.0, 4.0]


def bad_reward(**kwargs: Any) -> list[float]:
    return [0.0, float("nan"), 1.0]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (bad_reward, r"reward fn \S*test_tasks_rewards:bad_reward: value at index 1 is not finite: nan"),
        (lambda **kw: [0.0, 1.0, float("inf")], r"<lambda>: value at index 2 is not finite: inf"),
        (lambda **kw: [0.0, 1.0], "returned 2 values for 3 completions"),
        (lambda **kw: [0.0, "1.0", 2.0], r"value at index 1 is not a real number: '1.0'"),
        (lambda **kw: [0.0, None, 2.0], "value at index 1 is not a real number: None"),
        (lambda **kw: [True, 0.0, 1.0], "value at index 0 is not a real number: True"),
        (lambda **kw: [0.0, 1j, 2.0], r"value at index 1 is not a real number: 1j"),
        (lambda **kw: 1.0, "must return a list of floats, got float"),
        (lambda **kw: "1.0", "must return a list of floats, got str"),
        (lambda **kw: {0: 1.0}, "must return a list of floats, got dict"),
        (lambda **kw: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ],
)
def test_score_rejects_bad_outputs(fn: Any, match: str) -> None:
    with pytest.raises(RewardError, match=match):
        _score(fn)


def test_score_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match=r"inputs differ in length: completions=2"):
        score(lambda **kw: [0.0, 0.0], ["p"], ["a", "b"], [PromptRecord("p")] * 2, [1, 1])

"""Built-in tasks (arithmetic, length_target, dataset) and build_task's options and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rollout_correction.tasks.builtin import (
    LENGTH_TARGET_INSTRUCTIONS,
    arithmetic_records,
    build_task,
    length_target_records,
)
from nemo_rollout_correction.tasks.prompts import DatasetError, PromptRecord
from nemo_rollout_correction.tasks.rewards import RewardError, arithmetic_reward, length_target_reward, score

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def test_arithmetic_problems_are_correct_and_in_range() -> None:
    records = arithmetic_records(200, max_operand=10, seed=3)
    assert len(records) == 200
    for record in records:
        a, op, b = record.metadata["a"], record.metadata["op"], record.metadata["b"]
        assert record.prompt == f"What is {a} {op} {b}?"
        assert 0 <= a <= 10 and 0 <= b <= 10 and op in "+-"
        assert int(record.answer) == (a + b if op == "+" else a - b) >= 0
    # 11*11 sums + 66 ordered differences = 187 distinct problems: the first 187 are all distinct
    assert len({r.prompt for r in records[:187]}) == 187
    assert {r.metadata["op"] for r in records} == {"+", "-"}


def test_arithmetic_is_deterministic_in_the_seed() -> None:
    assert arithmetic_records(20, seed=1) == arithmetic_records(20, seed=1)
    assert arithmetic_records(20, seed=1) != arithmetic_records(20, seed=2)
    # a larger operand range changes the problems
    assert arithmetic_records(20, max_operand=20, seed=1) != arithmetic_records(20, max_operand=10, seed=1)


def test_arithmetic_large_operands_sample_distinct_problems() -> None:
    records = arithmetic_records(300, max_operand=10**6, seed=0, operations=("+",))
    assert len({r.prompt for r in records}) == 300
    assert max(r.metadata["a"] for r in records) > 1000


def test_arithmetic_answers_score_one_with_the_builtin_reward() -> None:
    records = arithmetic_records(8, seed=0)
    completions = [f"The answer is {r.answer}." for r in records]
    assert score(arithmetic_reward, [r.prompt for r in records], completions, records, [6] * 8) == [1.0] * 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_prompts": 0}, "num_prompts must be an integer >= 1, got 0"),
        ({"num_prompts": 4, "max_operand": 0}, "max_operand must be an integer >= 1"),
        ({"num_prompts": 4, "operations": ("*",)}, r"operations must be a non-empty subset of \('\+', '-'\)"),
        ({"num_prompts": 4, "operations": ()}, "operations must be a non-empty subset"),
    ],
)
def test_arithmetic_rejects_bad_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        arithmetic_records(**kwargs)  # type: ignore[arg-type]


def test_length_target_records() -> None:
    assert len(LENGTH_TARGET_INSTRUCTIONS) == len(set(LENGTH_TARGET_INSTRUCTIONS)) == 50
    records = length_target_records(120, target_length=12, seed=4)
    assert len(records) == 120
    assert {r.prompt for r in records} == set(LENGTH_TARGET_INSTRUCTIONS)
    assert records[:50] == records[50:100]  # cycles through one shuffled order
    assert all(r.answer is None and r.metadata["target_length"] == 12 for r in records)
    assert [r.prompt for r in records[:50]] != list(LENGTH_TARGET_INSTRUCTIONS)
    assert length_target_records(5, seed=4) == length_target_records(5, seed=4) != length_target_records(5, seed=5)
    with pytest.raises(ValueError, match="target_length must be an integer >= 1, got 0"):
        length_target_records(5, target_length=0)


def test_build_task_builtins() -> None:
    task = build_task("arithmetic", num_prompts=16, max_operand=20, seed=9, prompts_per_step=8, use_chat_template=True)
    assert task.name == "arithmetic" and len(task.records) == 16
    assert task.records == arithmetic_records(16, max_operand=20, seed=9)
    assert task.reward_fn is arithmetic_reward
    assert task.reward_name == "nemo_rollout_correction.tasks.rewards:arithmetic_reward"

    task = build_task("length_target", num_prompts=7, target_length=8)
    assert task.reward_fn is length_target_reward
    assert score(task.reward_fn, ["p"] * 2, ["c"] * 2, task.records[:2], [8, 12]) == [0.0, -0.5]


def test_build_task_reward_override() -> None:
    task = build_task("arithmetic", num_prompts=4, reward_fn="math:fabs")
    assert task.reward_name == "math:fabs"

    def custom(**kwargs: object) -> list[float]:
        return [0.0]

    assert build_task("length_target", num_prompts=4, reward_fn=custom).reward_fn is custom
    with pytest.raises(RewardError, match="module 'nope_not_here' not found"):
        build_task("arithmetic", num_prompts=4, reward_fn="nope_not_here:fn")
    with pytest.raises(ValueError, match=r"task\.reward_fn must be a string"):
        build_task("arithmetic", num_prompts=4, reward_fn=3)  # type: ignore[arg-type]


def test_build_task_dataset(tmp_path: Path) -> None:
    numeric = tmp_path / "numeric.jsonl"
    numeric.write_text("\n".join(json.dumps({"prompt": f"{i} + 1?", "answer": i + 1}) for i in range(3)))
    task = build_task("dataset", dataset_path=numeric)
    assert task.reward_fn is arithmetic_reward and task.records[2] == PromptRecord("2 + 1?", "3", {})

    # non-numeric answers need an explicit reward
    with pytest.raises(ValueError, match=r"record 0 has answer 'Paris'.*set task.reward_fn"):
        build_task("dataset", dataset_path=EXAMPLES / "capitals.jsonl")
    custom = f"{EXAMPLES / 'custom_reward.py'}:contains_answer"
    task = build_task("dataset", dataset_path=EXAMPLES / "capitals.jsonl", reward_fn=custom)
    assert task.reward_name.endswith(":contains_answer") and len(task.records) == 12

    # per-record target lengths with the built-in length reward, custom prompt key
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text(json.dumps({"instruction": "Say hi.", "target_length": 4}) + "\n")
    task = build_task("dataset", dataset_path=lengths, prompt_key="instruction", reward_fn="length_target")
    assert score(task.reward_fn, ["Say hi."], ["hi"], task.records, [2]) == [-0.5]


def test_build_task_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown task\.name 'gsm8k'; allowed: arithmetic, length_target, dataset"):
        build_task("gsm8k")
    with pytest.raises(ValueError, match=r"task\.name=dataset needs task\.dataset_path"):
        build_task("dataset")
    with pytest.raises(DatasetError, match="dataset file not found"):
        build_task("dataset", dataset_path=tmp_path / "missing.jsonl")


def test_task_modules_import_no_heavy_frameworks() -> None:
    # A fresh interpreter: the reward/data code must stay importable without vLLM, Megatron, MLflow
    # or pyarrow (Parquet imports it lazily); torch comes only with the package root.
    code = (
        "import sys\n"
        "import nemo_rollout_correction.tasks.prompts, nemo_rollout_correction.tasks.rewards\n"
        "import nemo_rollout_correction.tasks.builtin\n"
        "heavy = ('vllm', 'megatron', 'mlflow', 'pyarrow', 'transformers')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


def test_task_from_config_builds_the_configured_task_with_the_run_seed() -> None:
    from nemo_rollout_correction.config.schema import RunConfig, TaskConfig, TrainConfig
    from nemo_rollout_correction.tasks.builtin import task_from_config

    cfg = TrainConfig(run=RunConfig(seed=7), task=TaskConfig(name="arithmetic", num_prompts=5))
    task = task_from_config(cfg)
    assert task.name == "arithmetic"
    assert task.records == build_task("arithmetic", num_prompts=5, seed=7).records
    assert task.records != build_task("arithmetic", num_prompts=5, seed=8).records

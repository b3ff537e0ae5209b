"""Prompt dataset loading (JSONL, Parquet) with every error, and the resumable PromptSampler."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from default_lane import require

from nemo_rollout_correction.tasks.prompts import (
    DatasetError,
    PromptRecord,
    PromptSampler,
    load_prompt_dataset,
    records_from_dicts,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- JSONL parsing


def test_jsonl_records_keep_prompt_answer_and_metadata(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "What is 2 + 3?", "answer": 5, "level": 1}),
            "",  # a blank line is skipped, not an error
            json.dumps({"prompt": "Name a colour.", "target_length": 4}),
            json.dumps({"prompt": "Half of 5?", "answer": 2.5}),
            json.dumps({"prompt": "Say hi", "answer": "hi"}),
        ],
    )
    records = load_prompt_dataset(path)
    assert records == [
        PromptRecord("What is 2 + 3?", "5", {"level": 1}),
        PromptRecord("Name a colour.", None, {"target_length": 4}),
        PromptRecord("Half of 5?", "2.5", {}),
        PromptRecord("Say hi", "hi", {}),
    ]


def test_custom_keys(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q1", "solution": "7", "prompt": "x"})])
    (record,) = load_prompt_dataset(path, prompt_key="question", answer_key="solution")
    assert record == PromptRecord("q1", "7", {"prompt": "x"})


def test_the_shipped_example_dataset_loads() -> None:
    records = load_prompt_dataset(EXAMPLES / "capitals.jsonl")
    assert len(records) == 12
    assert records[0] == PromptRecord("What is the capital of France?", "Paris", {"region": "Europe"})


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"prompt": "ok"}', '{"prompt": "broken"'], r"d\.jsonl: line 2: invalid JSON"),
        (['{"prompt": "ok"}', "", '["a", "list"]'], r"line 3: expected a JSON object, got list"),
        (['"just a string"'], r"line 1: expected a JSON object, got str"),
        (
            ['{"promt": "typo", "answer": "1"}'],
            r"line 1: missing prompt key 'prompt'; keys present: \['answer', 'promt'\]; did you mean 'promt'",
        ),
        (['{"text": "no close key"}'], r"missing prompt key 'prompt'; keys present: \['text'\]$"),
        (['{"prompt": ""}'], r"line 1: prompt 'prompt' must be a non-empty string, got an empty string"),
        (['{"prompt": "   "}'], r"must be a non-empty string, got an empty string"),
        (['{"prompt": 42}'], r"prompt 'prompt' must be a non-empty string, got 42"),
        (['{"prompt": null}'], r"got None"),
        (
            ['{"prompt": "p", "answer": [1, 2]}'],
            r"line 1: answer 'answer' must be a string, a finite number or absent, got \[1, 2\]",
        ),
        (['{"prompt": "p", "answer": true}'], r"got True"),
        (["", "  "], r"d\.jsonl: dataset is empty"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, lines: list[str], match: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError, match=match):
        load_prompt_dataset(path)


def test_encoding(tmp_path: Path) -> None:
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "caf\u00e9"}, ensure_ascii=False).encode() + b"\n")
    assert load_prompt_dataset(bom) == [PromptRecord("caf\u00e9")]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=r"latin1\.jsonl: line 2: not valid UTF-8"):
        load_prompt_dataset(latin1)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: dataset is empty"):
        load_prompt_dataset(path)


def test_missing_file_and_bad_extension(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.jsonl: dataset file not found"):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nx\n")
    with pytest.raises(DatasetError, match=r"unsupported dataset extension '\.csv'; allowed: \.jsonl, \.parquet"):
        load_prompt_dataset(csv)
    with pytest.raises(DatasetError, match=r"'\(none\)'"):
        load_prompt_dataset(tmp_path / "noext")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DatasetError, match="not a regular file"):
        load_prompt_dataset(tmp_path / "dir.jsonl")


def test_dataset_error_is_a_value_error() -> None:
    assert issubclass(DatasetError, ValueError)


def test_records_from_dicts_checks_like_files() -> None:
    assert records_from_dicts([{"prompt": "a", "answer": 1}]) == [PromptRecord("a", "1", {})]
    with pytest.raises(DatasetError, match="item 1: missing prompt key"):
        records_from_dicts([{"prompt": "a"}, {"q": "b"}])


# ---------------------------------------------------------------- Parquet


def test_parquet_round_trip_and_row_errors(tmp_path: Path) -> None:
    pa = require("pyarrow", "mlflow")
    pq = require("pyarrow.parquet", "mlflow")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["What is 1 + 1?", "Hi"], "answer": ["2", None], "target_length": [3, 4]}), path)
    assert load_prompt_dataset(path) == [
        PromptRecord("What is 1 + 1?", "2", {"target_length": 3}),
        PromptRecord("Hi", None, {"target_length": 4}),
    ]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["ok", ""]}), bad)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 1: prompt 'prompt' must be a non-empty string"):
        load_prompt_dataset(bad)
    no_key = tmp_path / "nokey.parquet"
    pq.write_table(pa.table({"prompts": ["a"]}), no_key)
    with pytest.raises(DatasetError, match=r"row 0: missing prompt key 'prompt'.*did you mean 'prompts'"):
        load_prompt_dataset(no_key)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"corrupt\.parquet: not a readable Parquet file"):
        load_prompt_dataset(corrupt)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    with pytest.raises(DatasetError, match="dataset is empty"):
        load_prompt_dataset(empty)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    # A None entry in sys.modules makes `import pyarrow.parquet` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"d\.parquet: reading Parquet datasets needs pyarrow"):
        load_prompt_dataset(path)


# ---------------------------------------------------------------- sampler


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i}") for i in range(n)]


def _prompts(batch: list[PromptRecord]) -> list[str]:
    return [record.prompt for record in batch]


def test_sampler_epochs_are_permutations_and_batches_cross_epochs() -> None:
    sampler = PromptSampler(_records(10), prompts_per_step=4, seed=7)
    seen = [p for _ in range(5) for p in _prompts(sampler.next_batch())]  # 20 = two full epochs
    assert sorted(seen[:10]) == sorted(f"p{i}" for i in range(10))
    assert sorted(seen[10:]) == sorted(f"p{i}" for i in range(10))
    assert seen[:10] != seen[10:]  # each epoch reshuffles
    assert seen[:10] != [f"p{i}" for i in range(10)]  # and the order is shuffled at all
    assert (sampler.epoch, sampler.position) == (1, 10)


def test_sampler_is_deterministic_in_the_seed() -> None:
    def run(seed: int) -> list[list[str]]:
        sampler = PromptSampler(_records(13), prompts_per_step=5, seed=seed)
        return [_prompts(sampler.next_batch()) for _ in range(6)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_sampler_resume_continues_identically() -> None:
    reference = PromptSampler(_records(11), prompts_per_step=4, seed=5)
    expected = [_prompts(reference.next_batch()) for _ in range(9)]

    first = PromptSampler(_records(11), prompts_per_step=4, seed=5)
    got = [_prompts(first.next_batch()) for _ in range(4)]  # stops mid-epoch (position 5 of epoch 1)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert state == {"seed": 5, "epoch": 1, "position": 5, "num_records": 11, "shuffle": True}

    resumed = PromptSampler(_records(11), prompts_per_step=4, seed=999)  # the state's seed wins
    resumed.load_state_dict(state)
    got += [_prompts(resumed.next_batch()) for _ in range(5)]
    assert got == expected


def test_sampler_without_shuffle_and_small_dataset() -> None:
    sampler = PromptSampler(_records(3), prompts_per_step=4, seed=0, shuffle=False)
    assert _prompts(sampler.next_batch()) == ["p0", "p1", "p2", "p0"]
    assert _prompts(sampler.next_batch()) == ["p1", "p2", "p0", "p1"]
    assert len(sampler) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompts_per_step": 0}, "prompts_per_step must be an integer >= 1, got 0"),
        ({"prompts_per_step": 2.0}, "prompts_per_step must be an integer >= 1, got 2.0"),
        ({"prompts_per_step": 2, "seed": -1}, "seed must be a non-negative integer, got -1"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PromptSampler(_records(3), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty dataset"):
        PromptSampler([], prompts_per_step=1)


def test_sampler_rejects_a_state_from_another_dataset() -> None:
    state = PromptSampler(_records(5), prompts_per_step=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved for 5 records but the dataset has 6"):
        PromptSampler(_records(6), prompts_per_step=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True but this sampler has shuffle=False"):
        PromptSampler(_records(5), prompts_per_step=2, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['position'\]"):
        PromptSampler(_records(5), prompts_per_step=2).load_state_dict({"seed": 1, "epoch": 0, "num_records": 5})
    with pytest.raises(ValueError, match="out of range"):
        PromptSampler(_records(5), prompts_per_step=2).load_state_dict({**state, "position": 6})

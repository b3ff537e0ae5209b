"""Checkpoints are data, not code: every file is read without running anything from it (issue 23, item 2).

A planted pickle whose `__reduce__` would create a marker file (`open(marker, "w")`) stands for an attacker's
payload: each reader must refuse it with an error naming the file, and the marker must not exist afterwards.
Real files: torch.save / torch.distributed.checkpoint writes, read through the one door
(trainer/checkpoint_door.py `open_checkpoint`), which checks every file of a checkpoint before any reader runs.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.trainer import async_rollouts
from nemo_rollout_correction.trainer import checkpoint as ckpt
from nemo_rollout_correction.trainer import checkpoint_door as door


class _Payload:
    """Unpickling this object calls `open(marker, "w")`: the file appears iff the loader ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": _Payload(marker)}, path)


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    path = tmp_path / "rank_0.pt"
    torch.save(ckpt.rng_state(), path)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt.set_rng_state(door.load_data_file(path))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    torch.load(path, weights_only=True)  # the stored form itself is plain data


def test_a_planted_pickle_in_the_rng_file_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "step_3" / "rng" / "rank_0.pt"
    _plant(path, marker)
    with pytest.raises(door.UnsafeCheckpointError, match=str(path)):
        door.load_data_file(path)
    assert not marker.exists()


def _rollouts() -> async_rollouts.PendingBatch:
    samples = [RolloutSample(prompt_index=0, prompt_token_ids=[1, 2], token_ids=[5, 6, 7], logprobs=[-0.5, -1.0, -2.0],
                             finish_reason="length", text="abc", routed_experts=torch.ones(4, 2, 1, dtype=torch.int16),
                             origin=(0, 3, 0, 1), policy_version=2)]
    records = [PromptRecord(prompt="say hi", answer="hi", metadata={"target_length": 3, "tags": ["a"]})]
    return async_rollouts.PendingBatch(step=3, records=records, version=2, local=(RolloutBatch(samples, n=1,
                                                                                              seconds=0.25), [0.5]))


class _NoEngine:
    """The pipeline's engine jobs on a rank without an engine: never called here."""

    def generate_local(self, records: list[PromptRecord], step: int, attempt: int = 0) -> None:
        raise AssertionError("no engine on this rank")

    def push_weights(self, weights: dict[str, torch.Tensor]) -> float:
        raise AssertionError("no engine on this rank")


def test_in_flight_rollouts_round_trip_as_data(tmp_path: Path) -> None:
    batch = _rollouts()
    pipeline = async_rollouts.RolloutPipeline(_NoEngine(), list, max_staleness=1, stale_policy="wait",
                                              samples_per_prompt=1, has_engine=False)
    pipeline.pending = [batch]
    step = _dcp_checkpoint(tmp_path / "step_1")
    path = async_rollouts.pending_file(step, 0)
    path.parent.mkdir(parents=True)
    torch.save({**pipeline.state(1), "placement": {"num_engines": 1}}, path)
    torch.load(path, weights_only=True)  # plain data
    loaded = async_rollouts.load_pending(door.open_checkpoint(step), 0)
    assert loaded is not None and loaded["placement"] == {"num_engines": 1}
    (restored,) = async_rollouts.restored_batches(loaded, loaded)
    assert restored.step == 3 and restored.version == 2 and restored.records == batch.records
    assert restored.local is not None and batch.local is not None
    (got,), (want,) = restored.local[0].samples, batch.local[0].samples
    assert got.origin == (0, 3, 0, 1) and got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert got.routed_experts is not None and torch.equal(got.routed_experts, torch.ones(4, 2, 1, dtype=torch.int16))
    assert restored.local[1] == [0.5]


@pytest.mark.parametrize("name", ["rng/rank_0.pt", "async_rollouts/rank_0.pt", "partial_rollouts.pt",
                                  "dist/common.pt"])
def test_a_planted_pickle_in_any_data_file_is_refused_by_the_door(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "pwned"
    _complete(_dcp_checkpoint(tmp_path / "step_1"))
    step = _complete(_dcp_checkpoint(tmp_path / "step_2"))
    _plant(step / name, marker)
    with pytest.raises(door.UnsafeCheckpointError) as info:
        door.open_checkpoint(step)
    assert str(info.value).startswith(f"{step / name}: refused to load: it is not plain data")
    assert str(info.value).endswith(f"; the previous complete checkpoint is {tmp_path / 'step_1'}")
    assert "\n" not in str(info.value) and not marker.exists()


def _complete(step_dir: Path) -> Path:
    (step_dir / "meta.json").write_text("{}")
    return step_dir


def _dcp_checkpoint(step_dir: Path, extra: object | None = None) -> Path:
    """A real torch.distributed.checkpoint save (one process) laid out like ours: `<step>/dist`, `<step>/rng`."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, object] = {"weight": torch.arange(6.0).reshape(2, 3), "extra_state": [1, 2, 3]}
    if extra is not None:
        state["extra_state"] = extra
    dcp.save(state, checkpoint_id=str(step_dir / "dist"), no_dist=True)
    (step_dir / "rng").mkdir()
    torch.save(ckpt.rng_state(), step_dir / "rng" / "rank_0.pt")
    return step_dir


def test_a_real_dcp_checkpoint_passes_the_check(tmp_path: Path) -> None:
    checkpoint = door.open_checkpoint(_dcp_checkpoint(tmp_path / "step_1"))
    assert checkpoint.tensor_names == ("weight",) and checkpoint.meta == {}


def test_planted_dcp_metadata_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    step = _dcp_checkpoint(tmp_path / "step_1")
    (step / "dist" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    refused = r"dist/\.metadata: refused to load: global io\.open is not allowed"
    with pytest.raises(door.UnsafeCheckpointError, match=refused):
        door.open_checkpoint(step)
    assert not marker.exists()


def test_a_planted_object_among_the_shards_bytes_is_refused_without_running(tmp_path: Path) -> None:
    """torch reads a checkpoint's non-tensor items with weights_only=False: they are checked first."""
    marker = tmp_path / "pwned"
    step = _dcp_checkpoint(tmp_path / "step_1", extra=_Payload(marker))
    assert not marker.exists()
    with pytest.raises(door.UnsafeCheckpointError, match=r"\.distcp: refused to load: item extra_state is not plain"):
        door.open_checkpoint(step)
    assert not marker.exists()


def test_a_truncated_shard_names_the_file_and_the_previous_checkpoint(tmp_path: Path) -> None:
    _dcp_checkpoint(tmp_path / "step_1", extra=[1, 2])
    (tmp_path / "step_1" / "meta.json").write_text("{}")
    step = _dcp_checkpoint(tmp_path / "step_2", extra=[1, 2])
    (step / "meta.json").write_text("{}")
    shard = next((step / "dist").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(door.CorruptCheckpointError) as info:
        door.open_checkpoint(step)
    assert str(shard) in str(info.value) and str(tmp_path / "step_1") in str(info.value)


@pytest.mark.parametrize("text", ['{"step": 2', "[1, 2]", "\udcff"])
def test_a_damaged_meta_json_names_the_file_and_the_previous_checkpoint(tmp_path: Path, text: str) -> None:
    """The resume checks and the MLflow run id lookup read `meta.json` through `load_meta` before the door."""
    for step in (1, 2):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step}))
    damaged = tmp_path / "step_2" / "meta.json"
    damaged.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert ckpt.load_meta(tmp_path / "step_1") == {"step": 1}
    with pytest.raises(door.CorruptCheckpointError, match=r"unreadable checkpoint file") as info:
        ckpt.load_meta(tmp_path / "step_2")
    assert str(damaged) in str(info.value) and str(tmp_path / "step_1") in str(info.value)


def test_another_megatron_backend_is_refused(tmp_path: Path) -> None:
    """Megatron picks its readers from dist/metadata.json: only the torch_dist files are the ones checked."""
    step = _dcp_checkpoint(tmp_path / "step_1")
    (step / "dist" / "metadata.json").write_text('{"sharded_backend": "zarr", "common_backend": "torch"}')
    with pytest.raises(door.UnsafeCheckpointError, match=r"metadata.json: refused to load: sharded_backend 'zarr'"):
        door.open_checkpoint(step)


def test_only_the_door_makes_a_loaded_checkpoint(tmp_path: Path) -> None:
    """`load_model_weights` given a step directory opens it through the door first: the planted index is refused
    before Megatron's own readers (which unpickle `.metadata` with `pickle.load`) see it."""
    marker = tmp_path / "pwned"
    step = _dcp_checkpoint(tmp_path / "step_1")
    (step / "dist" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(door.UnsafeCheckpointError, match=r"\.metadata: refused to load"):
        ckpt.load_model_weights(step, torch.nn.Linear(1, 1))
    assert not marker.exists()

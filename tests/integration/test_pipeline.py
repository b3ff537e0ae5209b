"""Pipeline and context parallelism on CPU: Megatron's schedules over gloo equal the one-rank run.

The reference is the same worker on one rank (Megatron's no-pipelining schedule). With PP = 2,
PP = 2 x TP = 2, CP = 2 (the all-gather CP attention of `models.cp_attention`, Megatron's load-balanced
token layout) and CP = 2 x PP = 2, on tied and untied Llamas:
- the no-grad logprobs of every microbatch (vLLM's temperature/top-k replayed) are identical (CP ranks'
  pieces reassembled by their global positions);
- every parameter's gradient (Megatron DDP's buffer after `finalize_model_grads`) equals the reference's
  under its global name, including both copies of a tied embedding (each must hold the full gradient of
  the matrix);
- the global gradient norm of Megatron's optimizer is the same (stages summed, the tied copy counted once);
- the weights gathered to stage 0 for a refit are the complete Hugging Face state dict, bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

import dist_harness
import pipeline_worker

from nemo_rollout_correction.models.hf_llama import expected_hf_names, read_arch
from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def _microbatches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    # Different widths: the schedule exchanges activation shapes first (variable_seq_lengths).
    return [torch.randint(0, 500, (rows, width), generator=generator) for rows, width in ((3, 11), (2, 17), (3, 6))]


_REFERENCES: dict[bool, Any] = {}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


def _model_and_reference(tied: bool, root: Path) -> tuple[Path, Any]:
    """The tiny Llama (4 layers, GQA 4/2) and its one-rank reference run, built once per session."""
    if tied not in _REFERENCES:
        params = {**TINY_LLAMA_BUILTIN, "num_layers": 4, "tie_word_embeddings": tied}
        hf_dir = tiny_llama_dir(root / ("tied" if tied else "untied"), **params)
        (reference,) = dist_harness.launch(pipeline_worker.worker, 1, str(hf_dir), _microbatches(), 1,
                                           timeout=240.0)
        _REFERENCES[tied] = (hf_dir, reference)
    return _REFERENCES[tied]


def _reassemble(scored: torch.Tensor, positions: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's `[rows, local]` scores and the reference's values at the same positions."""
    keep = positions < want.shape[1]  # the rest are padding positions (no next token)
    return scored[:, keep], want[:, positions[keep]]


# (tied, tp, cp, pp): the tied embedding matters when it is split over stages; the rest are marked slow.
LAYOUTS = [
    pytest.param(False, 2, 1, 2, id="untied-tp2_pp2"),
    pytest.param(False, 1, 2, 1, id="untied-cp2"),
    pytest.param(True, 1, 2, 2, id="tied-cp2_pp2"),
    pytest.param(True, 1, 1, 2, id="tied-pp2", marks=pytest.mark.slow),  # tied over PP stages: tied-cp2_pp2
    pytest.param(False, 1, 1, 2, id="untied-pp2", marks=pytest.mark.slow),
    pytest.param(True, 2, 1, 2, id="tied-tp2_pp2", marks=pytest.mark.slow),
    pytest.param(True, 1, 2, 1, id="tied-cp2", marks=pytest.mark.slow),
    pytest.param(False, 1, 2, 2, id="untied-cp2_pp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("tied", "tp", "cp", "pp"), LAYOUTS)
def test_parallel_layouts_match_one_rank(model_root: Path, tied: bool, tp: int, cp: int, pp: int) -> None:
    hf_dir, reference = _model_and_reference(tied, model_root)
    ranks = dist_harness.launch(pipeline_worker.worker, tp * cp * pp, str(hf_dir), _microbatches(), tp, cp,
                                timeout=300.0)
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        for i, (got, want) in enumerate(zip(result["scored"], reference["scored"], strict=True)):
            if cp > 1:
                got, want = _reassemble(got, result["positions"][i], want)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        # fp32 gradients summed over the ranks in another order: ~1e-6 relative (1.6e-6 seen at TP2 x PP2, tied);
        # a missing or doubled contribution would be off by far more.
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        for name, grad in result["grads"].items():
            if name == "output_layer.weight" and tied:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied matrix
            want = reference["grads"][name]
            if tp > 1 and grad.shape != want.shape:  # a TP shard: compare with the matching slice
                dim = next(d for d in range(grad.dim()) if grad.shape[d] != want.shape[d])
                if "linear_fc1" in name:  # [gate_r; up_r] per rank
                    gate, up = want.chunk(2, dim=0)
                    want = torch.cat([gate.chunk(tp, dim=0)[result["tp_rank"]], up.chunk(tp, dim=0)[result["tp_rank"]]])
                else:  # includes the fused QKV: Megatron groups it per KV head, shards hold whole groups
                    want = want.chunk(tp, dim=dim)[result["tp_rank"]]
            torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5, msg=f"{name} on pp {result['pp_rank']}")
            merged.setdefault(name, grad)
        if result["pp_rank"] == 0 and result["tp_rank"] == 0 and result["cp_rank"] == 0:
            assert set(result["exported"]) == expected_hf_names(read_arch(hf_dir))
            for name, tensor in reference["exported"].items():
                assert torch.equal(result["exported"][name], tensor), name
        else:
            assert result["exported"] == {}
    if tp == 1 and cp == 1:
        assert set(merged) == set(reference["grads"]), "every parameter lives on exactly one stage"

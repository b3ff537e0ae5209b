"""Pipeline parallelism on CPU: Megatron's 1F1B schedule over gloo equals the one-stage run.

The reference is the same worker at PP = 1 (Megatron's no-pipelining schedule). With PP = 2, and
PP = 2 x TP = 2, on tied and untied Llamas:
- the no-grad logprobs of every microbatch (vLLM's temperature/top-k replayed) are identical;
- every parameter's gradient equals the reference's under its global name, including both copies of
  a tied embedding after `sync_tied_embedding_grads` (each must hold the full gradient of the matrix);
- the global gradient norm is the same (stages summed, the tied copy counted once);
- the weights gathered to stage 0 for a refit are the complete Hugging Face state dict, bit-exact.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import dist_harness
import pipeline_worker

from nemo_rollout_correction.models.hf_llama import expected_hf_names, read_arch
from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def _microbatches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    # Different widths: the schedule exchanges activation shapes first (variable_seq_lengths).
    return [torch.randint(0, 500, (rows, width), generator=generator) for rows, width in ((3, 11), (2, 17), (3, 6))]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_and_reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    params = {**TINY_LLAMA_BUILTIN, "num_layers": 4, "tie_word_embeddings": request.param}
    hf_dir = tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "model", **params)
    (reference,) = dist_harness.launch(pipeline_worker.worker, 1, str(hf_dir), _microbatches(), 1, timeout=240.0)
    return hf_dir, reference


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)], ids=["pp2", "tp2_pp2"])
def test_pipeline_stages_match_one_stage(model_and_reference: Any, tp: int, pp: int) -> None:
    hf_dir, reference = model_and_reference
    ranks = dist_harness.launch(pipeline_worker.worker, tp * pp, str(hf_dir), _microbatches(), tp, timeout=300.0)
    tied = read_arch(hf_dir).tie_word_embeddings
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        for got, want in zip(result["scored"], reference["scored"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-6)
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
        if result["pp_rank"] == 0 and result["tp_rank"] == 0:
            assert set(result["exported"]) == expected_hf_names(read_arch(hf_dir))
            for name, tensor in reference["exported"].items():
                assert torch.equal(result["exported"][name], tensor), name
        else:
            assert result["exported"] == {}
    if tp == 1:
        assert set(merged) == set(reference["grads"]), "every parameter lives on exactly one stage"

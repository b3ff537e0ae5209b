"""Multi-turn correction on real gloo ranks equals one process: a multi-turn batch (observations between turns,
`sequence_unit` turn and trajectory) under CP2 (each trajectory's tokens, and so its turns, split over two ranks:
per-turn sums travel in the CP reduction) and DP2 with uneven microbatches. Keep masks, IS weights, the losses,
their gradients and every `rollout_corr/*` metric match the single-process reference."""

from __future__ import annotations

import math
from typing import Any

import dist_harness
import multi_turn_workers as mtw
import pytest
import torch

from nemo_rollout_correction.distributed import cp_token_indices

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def run() -> list[Any]:
    return dist_harness.launch(mtw.worker, 2, timeout=240.0)


def _assemble(ranks: list[Any], key: tuple[str, str], field: str) -> tuple[torch.Tensor, float]:
    """The full `[8, WIDTH]` tensor `field` from every rank's microbatch shards, and the loss: the sum of every
    rank's microbatch losses (each is its tokens' sum over the step's global token count)."""
    cp = mtw.LAYOUTS[key[0]][0]
    full = torch.zeros(8, mtw.WIDTH, dtype=torch.float64)
    loss = 0.0
    for rank, result in enumerate(ranks):
        cols = cp_token_indices(mtw.WIDTH, cp, rank if cp == 2 else 0)
        for mb in result[key]["microbatches"]:
            start, stop = mb["rows"]
            full[start:stop, cols] = mb[field].double()
            loss += mb["loss"]
    return full, loss


@pytest.mark.parametrize("layout", list(mtw.LAYOUTS))
@pytest.mark.parametrize("cfg_name", list(mtw.CONFIGS))
def test_layout_matches_one_process(run: list[Any], layout: str, cfg_name: str) -> None:
    ref = mtw.reference(mtw.CONFIGS[cfg_name])
    (mb,) = ref["microbatches"]
    key = (layout, cfg_name)
    for field in ("keep", "weights", "grad"):
        got, loss = _assemble(run, key, field)
        torch.testing.assert_close(got, mb[field].double(), atol=1e-6, rtol=1e-6, msg=f"{field}")
    assert loss == pytest.approx(mb["loss"], abs=1e-6)
    data = mtw.multi_turn_batch()
    assert not mb["keep"][data["observation_mask"]].any()  # observations never kept
    for rank_result in run:
        metrics = rank_result[key]["metrics"]
        assert set(metrics) == set(ref["metrics"])
        for name, value in ref["metrics"].items():
            if math.isnan(value):
                assert math.isnan(metrics[name]), name
            else:
                assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name

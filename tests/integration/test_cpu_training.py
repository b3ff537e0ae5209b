"""`models.cpu_training`: the CPU fast paths give Megatron's results bit for bit.

- `add_cast_` equals the mixed-dtype `dst.add_(src)` it replaces (bf16, fp16; across chunk boundaries);
- the `multi_tensor_scale` fallback equals Megatron's `local_multi_tensor_scale` for the copy (scale 1),
  the in-place clip scaling and the general case;
- real Megatron DDP on gloo (DP = 1 and 2, bf16 and fp32, tied embeddings): the gradient buffer after two
  microbatches through `cpu_ddp_class()` equals the one through Megatron's own `DistributedDataParallel`,
  and the fast accumulation ran exactly for the bf16 parameters (Megatron keeps the norms in fp32).
"""

from __future__ import annotations

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

import cpu_training_worker
import dist_harness

from nemo_rollout_correction.models import cpu_training
from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fast paths are not installed with CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 1000, (1 << 18) + 17, 3 * (1 << 18)])
def test_add_cast_equals_the_mixed_dtype_add(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    dst = torch.randn(numel, generator=gen)
    src = (torch.randn(numel, generator=gen) * 3).to(dtype)
    want = dst.clone().add_(src)
    assert torch.equal(cpu_training.add_cast_(dst, src), want)
    # a small scratch forces many chunks; a non-contiguous source goes through reshape
    dst2, src2 = torch.randn(64, 32, generator=gen), torch.randn(32, 64, generator=gen).to(dtype).t()
    assert torch.equal(cpu_training.add_cast_(dst2.clone(), src2, torch.empty(7)), dst2.add_(src2))


def test_add_cast_rejects_a_non_float32_destination() -> None:
    with pytest.raises(ValueError, match="float32 dst"):
        cpu_training.add_cast_(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


def test_multi_tensor_scale_equals_megatrons_fallback() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_scale

    assert cpu_training.install_multi_tensor_scale()
    fast = megatron_optimizer.multi_tensor_scale_impl
    assert fast is not local_multi_tensor_scale and clip_grads.multi_tensor_scale_impl is not local_multi_tensor_scale
    assert cpu_training.install_multi_tensor_scale()  # idempotent: wraps once
    assert megatron_optimizer.multi_tensor_scale_impl is fast
    gen = torch.Generator().manual_seed(0)
    main = [torch.randn(n, generator=gen) for n in (5, 1000, 4097)]
    flag = torch.zeros(1, dtype=torch.int)
    cases = [  # (sources, destinations, scale): main -> bf16 model copy, in-place clip, general
        (main, [torch.empty(m.shape, dtype=torch.bfloat16) for m in main], 1.0),
        ([m.clone() for m in main], None, 0.37),
        (main, [torch.empty_like(m) for m in main], 0.5),
    ]
    for src, dst, scale in cases:
        want_dst = [d.clone() for d in dst] if dst is not None else [s.clone() for s in src]
        local_multi_tensor_scale(0, flag, [[s.clone() for s in src] if dst is not None else want_dst,
                                           want_dst], scale)
        got_dst = dst if dst is not None else src
        fast(0, flag, [src, got_dst], scale)
        for got, want in zip(got_dst, want_dst, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.fixture(scope="module")
def tied_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_llama_dir(tmp_path_factory.mktemp("tied") / "tiny", **TINY_LLAMA_BUILTIN,
                              tie_word_embeddings=True))


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "dtype"), [(1, "bfloat16"), (2, "bfloat16"), (2, "float32")])
def test_cpu_ddp_gradients_equal_megatrons(tied_hf_dir: str, world: int, dtype: str) -> None:
    ranks = dist_harness.launch(cpu_training_worker.ddp_gradients, world, tied_hf_dir, dtype, timeout=300.0)
    for result in ranks:
        megatron, cpu = result["grads"]["megatron"], result["grads"]["cpu"]
        assert megatron.keys() == cpu.keys() and any(float(g.abs().max()) > 0 for g in megatron.values())
        for name, grad in megatron.items():
            assert torch.equal(cpu[name], grad), name
        # bf16: every bf16 parameter (the norms stay fp32) took the fast path in each of the two microbatches
        low = result["low_precision_params"]
        assert (low > 0) == (dtype == "bfloat16")
        assert result["calls"] == 2 * low

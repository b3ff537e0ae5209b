"""`cuda_to_cpu`: Megatron's hard-coded CUDA placements land on the CPU (only without CUDA)."""

from __future__ import annotations

import pytest
import torch

from nemo_rollout_correction.distributed.cpu_compat import cuda_to_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the mode is inert with CUDA")


def test_cuda_placements_become_cpu_inside_the_mode_only() -> None:
    with cuda_to_cpu():
        zeros = torch.zeros([], dtype=torch.int, device="cuda")  # as in Megatron's schedules
        moved = torch.ones(3).cuda()  # as in Megatron's tied-embedding set-up
        pinned = torch.tensor([1, 2], pin_memory=True)  # as in its context-parallel rotary embedding
        indexed = torch.arange(4, device=torch.device("cuda", 0))
    assert zeros.device.type == moved.device.type == pinned.device.type == indexed.device.type == "cpu"
    assert torch.equal(moved, torch.ones(3)) and not pinned.is_pinned()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # outside the mode nothing is rewritten


def test_current_stream_waits_are_no_ops_on_the_cpu() -> None:
    """megatron-core 0.19.2's `start_grad_sync` does `torch.cuda.current_stream().wait_event(...)`."""
    from nemo_rollout_correction.distributed.cpu_compat import patch_cuda_for_cpu

    assert patch_cuda_for_cpu()
    stream = torch.cuda.current_stream()
    assert stream.wait_event(object()) is None and stream.wait_stream(stream) is None
    assert stream.synchronize() is None

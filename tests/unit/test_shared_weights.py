"""The CPU refit's shared buffer and the refit verification's checksum (`rollout/shared_weights.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nemo_rollout_correction.rollout.shared_weights import (
    SharedWeightsBuffer,
    TensorSlot,
    checksum,
    iter_views,
    map_file,
    plan_slots,
    slot_view,
    stacked_view,
)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(10, 6, generator=gen),
            "model.norm.weight": torch.randn(6, generator=gen),
            "step": torch.tensor([3], dtype=torch.int64)}


def test_a_second_mapping_sees_the_cast_weights_and_outlives_the_name(tmp_path: Path) -> None:
    state = _state()
    slots, nbytes = plan_slots(state, torch.bfloat16)
    assert [s.dtype for s in slots] == ["bfloat16", "bfloat16", "int64"]  # floating tensors take the engine dtype
    assert all(s.offset % 64 == 0 for s in slots)
    buffer = SharedWeightsBuffer(slots, nbytes, str(tmp_path))
    assert buffer.path is not None
    worker = map_file(buffer.path, nbytes)  # what a vLLM worker maps
    buffer.unlink()
    assert not os.listdir(tmp_path)  # no name left behind
    buffer.write(state)
    wire = [TensorSlot.from_wire(s.to_wire()) for s in slots]
    seen = dict(iter_views(worker, wire))
    for name, tensor in state.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(seen[name], expected), name
    state["model.norm.weight"].add_(1.0)
    buffer.write(state)  # the next step's weights reach the same mapping
    assert torch.equal(seen["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))
    assert buffer.matches(state, torch.bfloat16)
    assert not buffer.matches(state, torch.float32)
    assert not buffer.matches({**state, "extra": torch.zeros(1)}, torch.bfloat16)


def test_checksum_is_exact_and_sees_one_changed_bit_or_swapped_elements() -> None:
    tensor = torch.randn(64, 32, dtype=torch.float32).to(torch.bfloat16)
    assert checksum(tensor) == checksum(tensor.clone())
    bits = tensor.clone().view(torch.int16)
    bits[5, 7] ^= 1  # the last mantissa bit of one element
    assert checksum(bits.view(torch.bfloat16)) != checksum(tensor)
    swapped = tensor.clone()
    swapped[0, 0], swapped[0, 1] = tensor[0, 1], tensor[0, 0]
    if not torch.equal(swapped, tensor):
        assert checksum(swapped) != checksum(tensor)
    rows = [0, 9, 63]
    assert checksum(tensor, rows) == checksum(tensor[rows])
    big = torch.full((4096,), -3.0e38, dtype=torch.float32)  # large bit patterns: the int64 sum must not wrap
    bits32 = big.view(torch.int32).tolist()
    assert checksum(big) == sum(b * (i % 251 + 1) for i, b in enumerate(bits32))


def test_an_unknown_tensor_name_is_refused(tmp_path: Path) -> None:
    state = _state()
    slots, nbytes = plan_slots(state, torch.float32)
    buffer = SharedWeightsBuffer(slots, nbytes, str(tmp_path))
    buffer.unlink()
    with pytest.raises(KeyError):
        buffer.write({"not.a.weight": torch.zeros(1)})


def test_int8_codes_of_a_fused_layer_lie_back_to_back_and_stack_as_a_view() -> None:
    """The int8 refit (rollout/int8_load.py) hands vLLM's oneDNN handler the q/k/v (gate/up) codes as one view of
    the buffer: each layer's scales are laid out behind the block's weights, not between them."""
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for proj, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4), ("o_proj", 8)):
        name = f"model.layers.0.self_attn.{proj}.weight"
        state[name] = torch.randint(-127, 128, (rows, 16), generator=gen, dtype=torch.int8)  # 64-byte multiples
        state[name + "_scale"] = torch.rand(rows, 1, generator=gen).view(torch.int32)
    state["model.layers.0.input_layernorm.weight"] = torch.randn(16, generator=gen)
    slots, nbytes = plan_slots(state, torch.bfloat16)
    names = [s.name for s in slots]
    prefix = "model.layers.0.self_attn."
    assert names[names.index(prefix + "q_proj.weight"):][:4] == [prefix + p + ".weight"
                                                                for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    by_name = {s.name: s for s in slots}
    for name, tensor in state.items():
        slot_view(buffer, by_name[name]).copy_(tensor.to(by_name[name].torch_dtype))
    qkv = [by_name[prefix + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]
    stacked = stacked_view(buffer, qkv)
    assert stacked.data_ptr() == slot_view(buffer, qkv[0]).data_ptr()  # a view: no copy
    assert torch.equal(stacked, torch.cat([state[s.name] for s in qkv]))
    apart = [qkv[0], by_name[prefix + "o_proj.weight"]]  # not back to back: a new tensor, same values
    assert torch.equal(stacked_view(buffer, apart), torch.cat([state[s.name] for s in apart]))

"""The int8 W8A8 quantizer of quantized rollouts (rollout/int8.py): per-output-channel symmetric int8 weights.

Round trip within half a step per element, one scale per row (its largest magnitude maps to 127), rows of zeros,
which tensors are quantized, and tensor parallelism: quantizing a column-parallel shard equals the shard of the
quantized full weight, while a row-parallel shard must keep the full row's scale (quantizing it alone differs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_rollout_correction.rollout.int8 import (
    dequantize,
    is_quantized_linear,
    quantize_per_channel,
    quantize_state,
    shard_quantized,
    write_int8_checkpoint,
)


def test_round_trip_is_within_half_a_step_per_row() -> None:
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    codes, scale = quantize_per_channel(weight)
    assert codes.dtype == torch.int8 and codes.shape == (64, 48)
    assert scale.dtype == torch.float32 and scale.shape == (64, 1)
    assert torch.allclose(scale, weight.abs().amax(dim=1, keepdim=True) / 127)  # one scale per output channel
    assert (codes.abs().amax(dim=1) == 127).all()  # every row's largest magnitude maps to +-127
    error = (dequantize(codes, scale) - weight).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all()
    # per channel, not per tensor: a small row keeps its own resolution
    assert error[0].max() < 1e-4 < error[-1].max()


def test_zero_rows_get_zero_codes_and_a_finite_scale() -> None:
    weight = torch.randn(4, 8)
    weight[2] = 0
    codes, scale = quantize_per_channel(weight.to(torch.bfloat16))
    assert (codes[2] == 0).all() and scale[2].item() == 1.0
    assert torch.isfinite(scale).all() and torch.equal(dequantize(codes, scale)[2], torch.zeros(8))


def test_only_the_decoder_linear_layers_are_quantized() -> None:
    names = {"model.embed_tokens.weight": (16, 8), "lm_head.weight": (16, 8), "model.norm.weight": (8,),
             "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.self_attn.q_proj.weight": (8, 8),
             "model.layers.0.self_attn.k_proj.weight": (4, 8), "model.layers.0.mlp.down_proj.weight": (8, 12)}
    out = quantize_state((n, torch.randn(s)) for n, s in names.items())
    quantized = {n for n in names if is_quantized_linear(n)}
    assert quantized == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                         "model.layers.0.mlp.down_proj.weight"}
    for name in names:
        assert out[name].dtype == (torch.int8 if name in quantized else torch.float32)
        assert (f"{name}_scale" in out) == (name in quantized)


@pytest.mark.parametrize("size", [2, 4])
def test_tp_shards_column_parallel_equal_row_parallel_keep_the_full_scale(size: int) -> None:
    weight = torch.randn(32, 24, generator=torch.Generator().manual_seed(size))
    codes, scale = quantize_per_channel(weight)
    rows, cols = 32 // size, 24 // size
    for rank in range(size):
        # column parallel (q/k/v, gate/up): quantizing the rank's rows alone = the rows of the full quantization
        own = quantize_per_channel(weight[rank * rows:(rank + 1) * rows])
        sharded = shard_quantized(codes, scale, parallel="column", rank=rank, size=size)
        assert torch.equal(own[0], sharded[0]) and torch.equal(own[1], sharded[1])
        # row parallel (o, down): the rank's columns with the full row's scale; quantizing them alone would not be
        part = shard_quantized(codes, scale, parallel="row", rank=rank, size=size)
        assert torch.equal(part[0], codes[:, rank * cols:(rank + 1) * cols]) and torch.equal(part[1], scale)
        alone = quantize_per_channel(weight[:, rank * cols:(rank + 1) * cols])
        assert not torch.equal(alone[1], scale)
    # the ranks' row-parallel partial products sum to the full layer's (what vLLM's all-reduce computes)
    x = torch.randn(3, 24)
    full = x @ dequantize(codes, scale).T
    partial = sum(x[:, r * cols:(r + 1) * cols] @ dequantize(*shard_quantized(codes, scale, parallel="row", rank=r,
                                                                                size=size)).T for r in range(size))
    assert torch.allclose(partial, full, atol=1e-5)


def test_checkpoint_has_compressed_tensors_config_and_int8_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = tmp_path / "src"
    source.mkdir()
    state = {"model.embed_tokens.weight": torch.randn(16, 8), "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8),
             "model.norm.weight": torch.ones(8)}
    save_file(state, str(source / "model.safetensors"))
    (source / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (source / "tokenizer.json").write_text("{}")
    out = write_int8_checkpoint(source, tmp_path / "int8")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["format"] == "int-quantized" and config["ignore"] == ["lm_head"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    written = load_file(str(out / "model.safetensors"))
    assert written["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    assert written["model.layers.0.mlp.up_proj.weight_scale"].shape == (12, 1)
    assert torch.equal(written["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert (out / "tokenizer.json").is_file()


def test_moe_models_are_refused_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4}))
    with pytest.raises(ValueError, match=r"rollout\.quantization=int8 supports dense models"):
        write_int8_checkpoint(tmp_path, tmp_path / "out")


def test_quantizer_equals_round_of_w_over_the_row_scale() -> None:
    """The in-place quantizer (one float32 temporary) gives round(w / scale) clamped, bit for bit."""
    weight = torch.randn(96, 80, generator=torch.Generator().manual_seed(5)) * 0.02
    codes, scale = quantize_per_channel(weight)
    assert torch.equal(scale, weight.abs().amax(dim=1, keepdim=True) / 127)
    assert torch.equal(codes, torch.round(weight / scale).clamp(-127, 127).to(torch.int8))


def test_probe_channels_cover_every_packed_part() -> None:
    """The int8 verification's sampled output channels (rollout/int8_load.py): each part of a fused layer (q, k, v
    of a TP shard) gets its first and last channel and at most 16, all inside the layer."""
    from nemo_rollout_correction.rollout.int8_load import probe_channels

    sizes = [288, 96, 96]
    channels = probe_channels(sizes).tolist()
    starts = [0, 288, 384]
    for start, size in zip(starts, sizes, strict=True):
        mine = [c for c in channels if start <= c < start + size]
        assert mine[0] == start and mine[-1] == start + size - 1 and 2 <= len(mine) <= 16
    assert len(channels) == len(set(channels)) and max(channels) < sum(sizes)
    assert probe_channels([3]).tolist() == [0, 1, 2]


def test_tp_engines_on_one_numa_node_get_a_cpu_group_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's automatic thread binding needs a NUMA node per CPU worker; on one node a TP=2 engine gets one group
    of the allowed CPUs per worker instead (rollout/engine_processes.py)."""
    import glob
    import os

    from nemo_rollout_correction.rollout.engine_processes import cpu_threads_bind

    monkeypatch.setattr(glob, "glob", lambda pattern: ["/sys/devices/system/node/node0"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_threads_bind(2) == "0,1|2,3"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cpu_threads_bind(2) == "nobind"
    monkeypatch.setattr(glob, "glob", lambda pattern: ["node0", "node1"])
    assert cpu_threads_bind(2) is None  # vLLM's "auto" binds a node per worker

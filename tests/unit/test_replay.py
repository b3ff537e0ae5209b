"""Recorded rollouts (rollout/replay.py): a recorded call replays exactly, and a different request is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rollout_correction.config import ConfigError, load_config
from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.replay import ReplayEngine, open_engine, record_call, replay_dir
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

SAMPLING = SamplingOptions(n=2, max_tokens=4)
PROMPTS = [[1, 2, 3], [4, 5]]


def _batch() -> RolloutBatch:
    routing = torch.arange(6, dtype=torch.int16).reshape(3, 2, 1)
    return RolloutBatch([RolloutSample(0, [1, 2, 3], [7, 8], [-0.5, -1.25], "length", "ab", routed_experts=routing),
                         RolloutSample(0, [1, 2, 3], [9], [float("nan")], "stop", "c", origin=(0, 1, 0, 1)),
                         RolloutSample(1, [4, 5], [6], [-2.0], "stop", "d", policy_version=3),
                         RolloutSample(1, [4, 5], [], [], "stop", "")], n=2, seconds=0.5)


def test_a_recorded_call_replays_exactly(tmp_path: Path) -> None:
    batch = _batch()
    record_call(tmp_path, 1, 0, PROMPTS, SAMPLING, 42, batch)
    engine = open_engine(f"replay:{tmp_path}", None, EngineOptions(model_dir=str(tmp_path)), 1)
    assert isinstance(engine, ReplayEngine)
    replayed = engine.generate(PROMPTS, SAMPLING, seed=42)
    assert replayed.n == 2 and replayed.seconds == 0.5
    for a, b in zip(batch.samples, replayed.samples, strict=True):
        assert (a.token_ids, a.finish_reason, a.text, a.origin, a.policy_version) == \
               (b.token_ids, b.finish_reason, b.text, b.origin, b.policy_version)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(replayed.samples[0].routed_experts, batch.samples[0].routed_experts)
    assert engine.refit(iter([("w", torch.ones(2))])) >= 0.0  # loads nothing
    with pytest.raises(RolloutEngineError, match=r"has 1 calls of engine 1, and this run asks for more"):
        engine.generate(PROMPTS, SAMPLING, seed=42)


def test_another_request_or_no_recording_is_refused(tmp_path: Path) -> None:
    record_call(tmp_path, 0, 0, PROMPTS, SAMPLING, 42, _batch())
    engine = open_engine(f"replay:{tmp_path}", None, EngineOptions(model_dir=str(tmp_path)), 0)
    with pytest.raises(RolloutEngineError, match=r"differs from the recorded one in prompts, seed"):
        engine.generate([[1, 2]], SAMPLING, seed=7)
    with pytest.raises(RolloutEngineError, match=r"no recorded rollouts of engine 3"):
        open_engine(f"replay:{tmp_path}", None, EngineOptions(model_dir=str(tmp_path)), 3)


def test_source_settings_are_checked() -> None:
    assert replay_dir("vllm") is None and replay_dir("replay:/x") == Path("/x")
    with pytest.raises(ValueError, match=r"rollout\.source='file:/x'"):
        replay_dir("file:/x")
    with pytest.raises(ConfigError, match=r"rollout\.source"):
        load_config(["rollout.source=replay:"])
    with pytest.raises(ConfigError, match=r"rollout\.record_dir"):
        load_config(["rollout.source=replay:/x", "rollout.record_dir=/y"])
    assert load_config(["rollout.source=replay:/x"]).rollout.source == "replay:/x"

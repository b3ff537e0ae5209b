"""The refit's expected vLLM reload warnings are hidden; a real failure to load a layer stays visible."""

from __future__ import annotations

import logging

import pytest

from nemo_rollout_correction.rollout.worker_extension import _RELOAD_LOGGER, _quiet_expected_reload_warnings


def test_only_layers_without_weights_by_design_are_silenced(caplog: pytest.LogCaptureFixture) -> None:
    _quiet_expected_reload_warnings()
    _quiet_expected_reload_warnings()  # idempotent: one filter
    logger = logging.getLogger(_RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=_RELOAD_LOGGER):
        for layer in ("RotaryEmbedding", "ParallelLMHead", "QKVParallelLinear"):
            logger.warning("%s: Failed to load weights", layer)
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]

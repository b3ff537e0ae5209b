"""The GPU refit through vLLM's weight-transfer API, CUDA IPC backend (UNVERIFIED: no GPU vLLM here).

For the colocated engine shards of `rollout.placement=per_dp_group` on GPU (`distributed_executor_backend=
"external_launcher"`): the trainer's GPU tensors are shared with the engine's worker by CUDA IPC handles, no copy
through files (`staging_device` "cuda": the trainer gathers them on its GPU). vLLM's
`IPCTrainerWeightTransferEngine` all-gathers the handles over the default process group, so every rank of the job
must push at the same time (each is the sender to its own external_launcher shard). The NCCL backend serves
engines on other GPUs than the trainer's, which this placement never creates. The weight source takes the
installed vLLM release's form (`rollout/weight_source.py`). Not verifiable (`rollout/refit_verified` = 0).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.refit.base import RefitPath, RefitTarget


class WeightTransferRefit(RefitPath):
    """The refit through vLLM's IPC weight transfer (module docstring). Raises RolloutEngineError on CPU."""

    staging_device = "cuda"

    def push(self, engine: RefitTarget, named_tensors: Iterable[tuple[str, Tensor]], *,
             staging_dir: str | None = None) -> float:
        if not torch.cuda.is_available():
            raise RolloutEngineError("the weight-transfer refit needs CUDA (vLLM's IPC weight transfer); on CPU the "
                                     "engine refits through a shared buffer (refit)")
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        from nemo_rollout_correction.rollout.weight_source import tensor_weight_source

        # The trainer's tensors as they are: `staging_device` keeps them on the GPU, `.to` is then no copy.
        device = torch.device("cuda", torch.cuda.current_device())
        source = tensor_weight_source({name: tensor.detach().to(device).contiguous()
                                       for name, tensor in named_tensors})
        start = time.perf_counter()
        engine.wake_up(["weights"])  # the weights must be resident to be overwritten
        try:
            sender = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0),
                                                                 client=_SyncClient(engine.llm), source=source)
            engine.weight_version += 1
            sender.send_weights()
            engine.llm.reset_prefix_cache()
        except Exception as exc:
            raise RolloutEngineError(f"weight transfer failed: {type(exc).__name__}: {exc}") from exc
        return time.perf_counter() - start


class _SyncClient:
    """vLLM's trainer engines call a `VLLMWeightSyncClient`; `LLM` takes the requests wrapped."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


__all__ = ["WeightTransferRefit"]

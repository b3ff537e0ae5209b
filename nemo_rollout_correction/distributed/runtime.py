"""Process-group set-up and the few step-level collectives the trainer needs.

- `init_runtime(tp, pp, cp)`: initialise torch.distributed (from torchrun's environment, or a
  one-process group when launched directly), then Megatron-Core's `parallel_state`; returns this
  rank's `Runtime` (global rank/world, the `ParallelGroups`, whether it is the logging rank).
- `all_reduce_sums`: a step's scalar statistics summed over data x context parallelism.
- `any_rank`: whether a flag is set on any rank (the preemption check at each step boundary).
- `broadcast_object`: rollouts and rewards from the rank that hosts the rollout engine;
- `all_gather_object`: every engine's rollouts and rewards when each data-parallel group hosts one;
- `send_object` / `recv_object`: the logprobs and routing of the rows a data-parallel group trains;
- `launched_process_group` / `sum_over_world`: a bare process group from torchrun's environment, without
  Megatron (the launchers' smoke job, `launch/smoke.py`).

Gradients are not reduced here: Megatron's DDP and `finalize_model_grads` do it (`models.optimizer`).

torch.distributed stays in this package (docs/design.md, "Layers"); gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_rollout_correction.distributed.cpu_compat import patch_cuda_for_cpu
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.tensor_gather import (
    all_gather_object,
    broadcast_object,
    collective_device,
    recv_object,
    send_object,
)


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    groups: ParallelGroups
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel size (world / (tp x pp x cp))."""
        return self.groups.dp_size

    @property
    def is_main(self) -> bool:
        """Global rank 0: hosts the CPU rollout engine, logs to MLflow, prints progress."""
        return self.rank == 0


class PortInUseError(RuntimeError):
    """The process group's rendezvous port (`MASTER_PORT`) is taken by another process; the message names it."""

    def __init__(self, address: str, port: str) -> None:
        self.address, self.port = address, port
        super().__init__(f"port {port} (MASTER_PORT) on {address} is in use by another process, so torch.distributed "
                         "cannot listen on it: unset MASTER_PORT (a run started directly picks a free port) or set "
                         "it to a free port (`ss -ltnp` shows who holds this one)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_runtime(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, context_parallel_size: int = 1,
                 *, timeout_s: float = 1800.0) -> Runtime:
    """Initialise torch.distributed and Megatron's parallel state; idempotent within a process.

    Under torchrun (RANK/WORLD_SIZE set) the process group uses its env:// rendezvous; run directly,
    a one-process group on a free local port (or `MASTER_PORT` when set). Raises ValueError when the world size
    is not a multiple of tp x pp x cp, `PortInUseError` when the rendezvous port is taken.
    """
    from megatron.core import parallel_state as ps

    patch_cuda_for_cpu()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        except dist.DistNetworkError as exc:  # the rendezvous store could not listen: say which port, not errno 98
            if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
                raise
            raise PortInUseError(os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")) from exc
    world = dist.get_world_size()
    model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of policy.tensor_parallel_size x "
                         f"pipeline_parallel_size x context_parallel_size = {tensor_parallel_size} x "
                         f"{pipeline_parallel_size} x {context_parallel_size}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                     pipeline_model_parallel_size=pipeline_parallel_size,
                                     context_parallel_size=context_parallel_size)
    return Runtime(rank=dist.get_rank(), world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   groups=ParallelGroups.from_megatron(), tensor_parallel_size=tensor_parallel_size,
                   pipeline_parallel_size=pipeline_parallel_size, context_parallel_size=context_parallel_size)


def shutdown_runtime() -> None:
    """Destroy Megatron's parallel state and the process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def initialized_world_size() -> int:
    """The default process group's size, 0 when there is none (an engine started in process checks it)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0


def barrier() -> None:
    """A barrier over the whole job (no-op without torch.distributed)."""
    if dist.is_initialized():
        dist.barrier()




@contextmanager
def launched_process_group(backend: str) -> Iterator[tuple[int, int]]:
    """Join the default process group from torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...).

    Yields `(rank, world_size)` and destroys the group on exit. Unlike `init_runtime` it sets up no
    Megatron state and takes the backend (`gloo` or `nccl`) from the caller.
    """
    dist.init_process_group(backend)
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def sum_over_world(value: float, device: torch.device | None = None) -> float:
    """SUM one scalar over every rank of the job (a plain all-reduce on the default group).

    `device`: where the collective's tensor lives (the rank's CUDA device under NCCL, CPU for gloo).
    """
    buf = torch.tensor([float(value)], device=device)
    dist.all_reduce(buf)
    return float(buf.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one rank of the job (one 1-element MAX all-reduce).

    The preemption check at each step boundary (`trainer.preemption`): a signal may reach one rank only (or
    the ranks at different moments), and all ranks must stop after the same step. Without torch.distributed
    it returns `flag`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    buf = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(None))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return bool(buf.item())


def all_reduce_sums(values: dict[str, float], groups: ParallelGroups) -> dict[str, float]:
    """SUM a small dict of scalars over the data x context parallel group (one float64 all-reduce).

    Every rank must pass the same keys (in any order).
    """
    if groups.dp_cp_size == 1 or not values:
        return dict(values)
    keys = sorted(values)
    buf = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                       device=collective_device(groups.dp_cp_group))
    dist.all_reduce(buf, group=groups.dp_cp_group)
    return dict(zip(keys, buf.tolist(), strict=True))


__all__ = [
    "PortInUseError",
    "Runtime",
    "all_gather_object",
    "all_reduce_sums",
    "any_rank",
    "barrier",
    "broadcast_object",
    "init_runtime",
    "initialized_world_size",
    "launched_process_group",
    "recv_object",
    "send_object",
    "shutdown_runtime",
    "sum_over_world",
]

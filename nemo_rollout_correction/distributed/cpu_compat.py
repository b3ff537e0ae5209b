"""Run Megatron-Core's CPU-capable code paths on machines without CUDA.

Megatron-Core calls `torch.cuda.current_device()` in several helpers (rotary embeddings, some tensor-parallel
utilities, parallel-state set-up) and uses the result as a `device=`; on CPU `patch_cuda_for_cpu` makes it
return `"cpu"`, `torch.cuda.synchronize()` a no-op (the pipeline p2p code calls it after every exchange) and
`torch.cuda.current_stream()` a stream whose waits are no-ops (megatron-core 0.19's gradient buffer waits on
it before every reduction). Megatron's pipeline schedules also create tensors with a literal `device="cuda"`,
its tied-embedding set-up calls `Tensor.cuda()`, its context-parallel rotary embedding pins memory, and its
optimizers (`megatron.core.optimizer`) assert that every parameter's `Tensor.type()` is a `torch.cuda.*` type;
`cuda_to_cpu()` is a torch-function mode that keeps all of it on the CPU while Megatron code runs (model
construction, DDP wrapping, the schedule with its gradient finalisation, the optimizer build and step). Lives
in the distributed layer because process-group set-up (`runtime.init_runtime`) needs it before any model
exists; `models.megatron_cpu` re-exports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def patch_cuda_for_cpu() -> bool:
    """Make `torch.cuda.current_device()` return `"cpu"` when CUDA is unavailable (idempotent).

    Megatron-Core uses the result as a `device=` argument, which `"cpu"` satisfies. Returns whether
    the patch is (now) active; with CUDA available nothing is changed and False is returned.
    """
    if torch.cuda.is_available():
        return False
    if not getattr(torch.cuda.current_device, "_nrc_cpu_patch", False):

        def current_device() -> str:
            return "cpu"

        def synchronize(device: Any = None) -> None:
            return None

        def current_stream(device: Any = None) -> _HostStream:
            return _HOST_STREAM

        current_device._nrc_cpu_patch = True  # type: ignore[attr-defined]
        torch.cuda.current_device = current_device  # type: ignore[assignment]
        torch.cuda.synchronize = synchronize
        # megatron-core 0.19's gradient buffer (`start_grad_sync`, `finish_grad_sync`) asks for the current
        # stream to wait on CUDA-graph events; on the CPU every op is already ordered
        torch.cuda.current_stream = current_stream  # type: ignore[assignment]
    return True


class _HostStream:
    """The CPU's stand-in for a CUDA stream: host ops run in program order, so every wait or sync is a no-op."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event


_HOST_STREAM = _HostStream()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrite `device="cuda..."` to the CPU, drop `pin_memory=True`, make `Tensor.cuda()` the identity and
    `Tensor.type()` report `torch.cuda.*` type strings."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers assert `param.type() == "torch.cuda.FloatTensor"` (or the
            # BFloat16/Half variants) to pick the fp32-main-param path; the CPU tensor answers as
            # the CUDA tensor it stands in for. Only the query form: `type(dtype)` is a cast.
            name: str = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")) or kwargs.get("pin_memory"):  # copy only what is rewritten
            kwargs = dict(kwargs)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):  # staging for a host-to-GPU copy; nothing to pin without CUDA
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """While active (and only without CUDA), tensors Megatron places on "cuda" land on the CPU.

    With CUDA available this does nothing. The mode costs a Python call per torch function, so the
    trainer enters it only around Megatron's schedule and model construction.
    """
    if torch.cuda.is_available():
        yield
        return
    patch_cuda_for_cpu()
    with _CudaToCpu():
        yield


@contextlib.contextmanager
def without_torch_function_modes() -> Iterator[None]:
    """Suspend `cuda_to_cpu` (and any torch-function mode) inside it: model code that needs no rewriting
    then runs without the mode's per-call Python overhead. A no-op with CUDA (no mode is ever active)."""
    if torch.cuda.is_available():
        yield
        return
    with torch._C.DisableTorchFunction():  # the documented way modes themselves use to call through
        yield


__all__ = ["cuda_to_cpu", "patch_cuda_for_cpu", "without_torch_function_modes"]

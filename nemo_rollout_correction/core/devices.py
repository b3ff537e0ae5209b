"""Moving a record of tensors (a dataclass such as the trainer's microbatch) to the device that computes on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def tensor_fields_to(record: T, device: torch.device | str, *, keep: Iterable[str] = ()) -> T:
    """`record` (a dataclass instance, frozen or not) with every tensor field on `device`: a copy, or `record` itself
    when nothing moves.

    Fields named in `keep` stay where they are (e.g. row indices into host-side tensors); None and non-tensor
    fields are left alone. Rollout tensors are built on the CPU and the policy's logprobs live on its device
    (CUDA on GPU machines): moving a microbatch once, where it is built, keeps every later plan, loss and metric
    computation on one device (`tests/unit/test_microbatch_device.py` runs it with the `meta` device).
    """
    if not dataclasses.is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"tensor_fields_to needs a dataclass instance, got {type(record).__name__}")
    skipped = set(keep)
    target = torch.device(device)
    moved: dict[str, Any] = {}
    for field in dataclasses.fields(record):
        value: Any = getattr(record, field.name)
        if field.name not in skipped and isinstance(value, Tensor) and value.device != target:
            moved[field.name] = value.to(target)
    return dataclasses.replace(record, **moved) if moved else record


__all__ = ["tensor_fields_to"]

"""torch.distributed.checkpoint's metadata types, named for the trainer's checkpoint checks.

`trainer/checkpoint.py` reads a checkpoint's `.metadata` as data before loading it (no code runs on load) and
must tell byte items (pickled objects, checked with `weights_only=True`) from tensors. The type lives in
`torch.distributed.checkpoint`, which only this package imports (docs/design.md, Layers).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata


def is_bytes_item(entry: Any) -> bool:
    """True when a `Metadata.state_dict_metadata` entry is a byte item (a pickled object), not a tensor."""
    return isinstance(entry, BytesStorageMetadata)


__all__ = ["is_bytes_item"]

"""Export a live Megatron-Core policy, at any TP/PP/CP/DP layout, as a Hugging Face checkpoint.

`export_hf(policy, out_dir, groups)` is a collective over the job: the pipeline of dp rank 0 / cp rank 0
gathers the full Hugging Face state dict (every TP rank joins the per-parameter all-gathers of
`hf_mapping.iter_hf_weights`, then TP rank 0 of each stage sends its stage's tensors to stage 0 with
`distributed.pipeline.gather_weights_to_first_stage`: the same path as the rollout-engine refit, so export
and refit derive from the one mapping table in `hf_mapping.py`). Global rank 0 of that pipeline then
writes, into a temporary directory renamed into place at the end (a crash never leaves a half-written
export under the final name):

- `config.json` (transformers' `AutoConfig` of the source checkpoint, with the export dtype),
- `model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` above
  `max_shard_size` (huggingface_hub's `save_torch_state_dict`: the same sharding and index format as
  `save_pretrained`),
- the tokenizer files and chat template (`AutoTokenizer.save_pretrained`),
- `generation_config.json` (the source's, or one derived from the model config).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.pipeline import gather_weights_to_first_stage
from nemo_rollout_correction.models.policy import MegatronPolicy

EXPORT_DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_SHARD_SIZE = "5GB"


def export_dtype(name: str) -> torch.dtype:
    """`"float32"` or `"bfloat16"` -> torch dtype; ValueError names the allowed values."""
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r} is not supported; allowed: {', '.join(EXPORT_DTYPES)}")
    return torch.float32 if name == "float32" else torch.bfloat16


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def shard_size_bytes(size: int | str) -> int:
    """A shard-size limit (`5GB`, `200MB`, or bytes) in bytes; ValueError names what is allowed.

    Decimal units, as huggingface_hub's sharding reads them (its parser is not public API in 2.x, hence
    this small one: it only validates; the string itself goes to `save_torch_state_dict`).
    """
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a size such as 5GB, got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", size.upper())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size: use a number with a unit KB, MB, GB or TB "
                             "(e.g. 5GB)")
        value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {size!r}")
    return value


def _writes(groups: ParallelGroups) -> bool:
    """Whether this rank writes the export: stage 0, TP rank 0 of the pipeline of dp rank 0 and cp rank 0."""
    return groups.dp_rank == 0 and groups.cp_rank == 0 and groups.pp_rank == 0 and groups.tp_rank == 0


def gather_hf_state_dict(policy: MegatronPolicy, groups: ParallelGroups) -> dict[str, Tensor] | None:
    """The full Hugging Face state dict on the writing rank (`export_hf`), None elsewhere.

    Every rank of the job must call it. Ranks outside the pipeline of dp rank 0 / cp rank 0 hold replicas
    of its weights and return at once; within it, every TP rank joins the all-gathers and TP rank 0 of each
    stage sends its stage to stage 0. Tensors keep the policy's parameter dtype (cast on the writer).
    """
    if groups.dp_rank != 0 or groups.cp_rank != 0:
        return None
    weights = policy.hf_weights(dtype=None)
    if groups.tp_rank != 0:
        for _ in weights:  # take part in the TP all-gathers
            pass
        return None
    state: dict[str, Tensor] = {}
    for name, tensor in gather_weights_to_first_stage(weights, groups):
        if groups.pp_rank == 0:
            state[name] = tensor.detach().to("cpu", copy=True)
    return state if _writes(groups) else None


def write_hf_checkpoint(state: dict[str, Tensor], out_dir: str | Path, source_dir: str | Path, *,
                        dtype: str = "float32", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write `state` (full HF names) with the config, tokenizer and generation config of `source_dir`.

    The files go to a temporary sibling of `out_dir`, renamed to `out_dir` when complete (an existing
    `out_dir` is replaced). Returns `out_dir`.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    torch_dtype = export_dtype(dtype)
    limit = shard_size_bytes(max_shard_size)
    out = Path(out_dir).resolve()
    source = Path(source_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config = AutoConfig.from_pretrained(str(source))
        config.dtype = dtype  # transformers 5's name of the weights' dtype (torch_dtype before)
        config.save_pretrained(str(tmp))
        tensors = {name: tensor.to(torch_dtype).contiguous() for name, tensor in state.items()}
        save_torch_state_dict(tensors, tmp, max_shard_size=limit, metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(tmp))
        try:
            generation = GenerationConfig.from_pretrained(str(source))
        except OSError:  # the source has none: derive it from the model config, as save_pretrained does
            generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(str(tmp))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an existing `out` is moved aside first and removed after."""
    old: Path | None = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf(policy: MegatronPolicy, out_dir: str | Path, groups: ParallelGroups, *, dtype: str = "float32",
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, source_dir: str | Path | None = None
              ) -> Path | None:
    """Export `policy` as a Hugging Face checkpoint in `out_dir`; every rank of the job must call it.

    Any layout (TP, PP, CP, DP): see the module docstring. `source_dir` (default `policy.hf_dir`) provides
    the config, tokenizer and generation config. Returns `out_dir` on the writing rank, None elsewhere.
    The caller synchronises ranks afterwards if they need the files.
    """
    export_dtype(dtype)  # fail before the collectives on a bad dtype
    shard_size_bytes(max_shard_size)
    state = gather_hf_state_dict(policy, groups)
    if state is None:
        return None
    return write_hf_checkpoint(state, out_dir, source_dir or policy.hf_dir, dtype=dtype,
                               max_shard_size=max_shard_size)


def exported_files(out_dir: str | Path) -> dict[str, Any]:
    """A summary of an export directory (file names and total weight bytes), for logs and the run summary."""
    out = Path(out_dir)
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    return {"files": sorted(p.name for p in out.iterdir()), "weights": weights,
            "weight_bytes": sum((out / name).stat().st_size for name in weights)}


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "EXPORT_DTYPES", "export_dtype", "export_hf", "exported_files",
           "gather_hf_state_dict", "shard_size_bytes", "write_hf_checkpoint"]

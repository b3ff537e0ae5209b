"""`nrc export <run-dir-or-checkpoint> --output DIR [--dtype float32|bfloat16]`: a checkpoint as a Hugging Face model.

The checkpoint's own saved configuration (`meta.json`) says which model and dtype the run trained; the
policy is built at world size 1 (one process, TP = PP = CP = 1) from that model, the checkpoint's weights
are loaded into it (`trainer.checkpoint.load_model_weights`, which reads a checkpoint saved at any
TP/PP/CP/DP layout). The checkpoint is opened first, through the one door every reader takes
(`trainer.checkpoint_door.open_checkpoint`: every file checked as data; an unsafe or corrupt file is refused in
one line naming it, exit 1, before any model is built); then `models.hf_export.export_hf` writes the Hugging Face
directory (config, sharded safetensors with an index above `--max-shard-size`, tokenizer and chat template,
generation config), atomically.

A LoRA run (`policy.lora.rank` > 0) exports its merged model `W + alpha/r B A` by default; `--adapter` writes
only the adapter in PEFT form (`adapter_config.json` naming the base model + `adapter_model.safetensors`).

`<run-dir-or-checkpoint>` is a step directory (`.../checkpoints/step_<N>`, holding `meta.json`), a
checkpoint directory (its newest complete step), or a run directory (`<run>/checkpoints`, newest step).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
EXIT_FAILED = 1


def resolve_step_dir(source: Path) -> Path:
    """The complete checkpoint step directory `source` names (see the module docstring).

    Raises:
        FileNotFoundError: nothing that holds a complete checkpoint (the message says what was looked for).
    """
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    if (source / "meta.json").is_file():
        return source
    for root in (source, source / "checkpoints"):
        step_dir = ckpt.latest_checkpoint(root)
        if step_dir is not None:
            return step_dir
    raise FileNotFoundError(f"{source}: no complete checkpoint here (looked for meta.json, step_<N>/meta.json and "
                            "checkpoints/step_<N>/meta.json)")


def _without_redacted(tree: Any) -> Any:
    """The saved config without the values redaction replaced (they take their defaults): checkpoint metadata
    hides every string under a secret-looking name, and none of those matters to an export (model, dtype,
    layout)."""
    from nemo_rollout_correction.config.redaction import REDACTED

    if isinstance(tree, dict):
        return {key: _without_redacted(value) for key, value in tree.items() if value != REDACTED}
    return tree


def run_export(args: argparse.Namespace) -> int:
    """`nrc export`: see the module docstring; returns the exit code."""
    from nemo_rollout_correction.config import ConfigError, from_dict
    from nemo_rollout_correction.trainer import checkpoint as ckpt
    from nemo_rollout_correction.trainer.checkpoint_door import CorruptCheckpointError, open_checkpoint

    try:
        step_dir = resolve_step_dir(Path(args.source))
    except FileNotFoundError as exc:
        print(f"nrc export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # the door: an unsafe (UnsafeCheckpointError is a ValueError), corrupt or old per-rank checkpoint is refused
    # before any model is built
    try:
        checkpoint = open_checkpoint(step_dir)
    except (CorruptCheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"nrc export: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    meta = checkpoint.meta
    try:
        cfg = from_dict(_without_redacted(meta["config"]))
        dtype = args.dtype or cfg.export.dtype
        max_shard_size = args.max_shard_size or cfg.export.max_shard_size
        from nemo_rollout_correction.models.hf_export import export_dtype, shard_size_bytes

        export_dtype(dtype)
        shard_size_bytes(max_shard_size)
    except (FileNotFoundError, ConfigError, ValueError, KeyError) as exc:
        print(f"nrc export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.output)
    print(f"[nrc export] checkpoint {step_dir} (step {meta.get('step')}), model {cfg.model.source} "
          f"({cfg.model.dtype})", file=sys.stderr, flush=True)
    # One process: a torchrun environment inherited from a shell must not make it wait for other ranks.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime

    runtime = init_runtime(1, 1, 1)
    try:
        from nemo_rollout_correction.models.hf_export import export_hf, exported_files
        from nemo_rollout_correction.models.policy import MegatronPolicy
        from nemo_rollout_correction.models.sources import resolve_model_source

        hf_dir = resolve_model_source(cfg.model.source)
        policy = MegatronPolicy.from_hf(hf_dir, params_dtype=cfg.model.dtype, seed=cfg.run.seed, lora=cfg.policy.lora)
        print("[nrc export] policy built at world size 1; loading the checkpoint's weights", file=sys.stderr,
              flush=True)
        ckpt.load_model_weights(checkpoint, policy.model)  # layout-free: any saved TP/PP/CP/DP
        if args.adapter:
            return _export_adapter(policy, cfg, out, dtype)
        export_hf(policy, out, runtime.groups, dtype=dtype, max_shard_size=max_shard_size, source_dir=hf_dir)
    except (ValueError, FileNotFoundError, CorruptCheckpointError) as exc:
        print(f"nrc export: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        shutdown_runtime()
    summary = exported_files(out)
    print(f"[nrc export] wrote {out} ({dtype}, {len(summary['weights'])} safetensors file(s), "
          f"{summary['weight_bytes'] / 1e6:.1f} MB of weights)", file=sys.stderr, flush=True)
    return 0


def _export_adapter(policy: Any, cfg: Any, out: Path, dtype: str) -> int:
    """`--adapter`: the LoRA adapter alone in PEFT form (`models.lora_export`), naming the run's base model."""
    import torch

    from nemo_rollout_correction.models.lora_export import write_peft_adapter

    if not policy.lora:
        print("nrc export: --adapter needs a checkpoint of a LoRA run (policy.lora.rank > 0); this run trained all "
              "weights: export the full model without --adapter", file=sys.stderr)
        return EXIT_USAGE
    tensors = policy.hf_adapter_state_dict(dtype=getattr(torch, dtype))
    write_peft_adapter(out, tensors, cfg.policy.lora, cfg.model.source)
    print(f"[nrc export] wrote the LoRA adapter (PEFT: adapter_config.json, adapter_model.safetensors) to {out}: "
          f"{len(tensors)} tensors, {sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6:.2f} MB, "
          f"base model {cfg.model.source}", file=sys.stderr, flush=True)
    return 0


def _one_line(exc: BaseException) -> str:
    """The refusal on one line (a CheckpointException lists every rank's error over many lines)."""
    return " ".join(str(exc).split())


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `nrc export`."""
    parser = sub.add_parser("export", help="write a checkpoint as a Hugging Face model (safetensors, tokenizer)",
                            description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("source", help="a run directory, its checkpoint directory, or one step_<N> directory")
    parser.add_argument("--output", "-o", required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weights dtype (default: the run's export.dtype, float32 unless set)")
    parser.add_argument("--max-shard-size", default=None,
                        help="largest safetensors file, e.g. 5GB (default: the run's export.max_shard_size)")
    parser.add_argument("--adapter", action="store_true",
                        help="LoRA runs: write only the adapter in PEFT form (adapter_config.json + "
                             "adapter_model.safetensors; vLLM's LoRARequest and PEFT load it) instead of the "
                             "merged model")
    parser.set_defaults(func=run_export)


__all__ = ["add_parser", "resolve_step_dir", "run_export"]

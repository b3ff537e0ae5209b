"""Resume safety: may this run continue from that checkpoint?

A checkpoint's `meta.json` holds the (redacted) config of the run that wrote it. Resuming compares it with
the current config key by key (dotted names): every difference outside `CHANGEABLE` is an incompatibility
(another model, task, objective, sampling or optimizer setting would silently train something else from
the restored state), and all of them are reported in ONE error. A different layout (TP/PP/CP sizes, the
number of processes, micro-batch size, sequence packing and token budgets, engine placement) is allowed: the
checkpoint is layout-free (`trainer.checkpoint`); the trainer logs the change. So is a longer or shorter
`run.num_steps` (the LR schedule then follows the new length from the saved position), and anything about
tracking, checkpointing, launching, evaluation or export.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

CHANGEABLE: tuple[str, ...] = (
    "policy.tensor_parallel_size",
    "policy.pipeline_parallel_size",
    "policy.context_parallel_size",
    "policy.micro_batch_size",
    "policy.sequence_packing",  # how the update groups rows, like the two above: the same loss up to rounding
    "policy.prefix_sharing",  # how a pack lays out its rows: the same loss up to rounding
    "policy.max_tokens_per_microbatch",
    "rollout.placement",
    "rollout.max_staleness",  # in-flight batches beyond the new bound go by rollout.stale_policy
    "rollout.stale_policy",
    "run.num_steps",
    "run.resume",
    "run.overwrite",
    "run.log_every",
    "run.progress",
    "run.output_dir",
    "run.name",
    "checkpoint.",
    "rollout_correction.alert.",  # the alarm watches the run; it changes nothing that is trained
    "tracking.",
    "launcher.",
    "audit.",
    "eval.",
    "export.",
)
"""Config keys (or `section.` prefixes) that may differ between the checkpoint's run and the resuming run."""

OPTIMIZER_LAYOUT_KEY = "policy.use_distributed_optimizer"
"""May change only for a weights-only checkpoint: the two optimizers store their state under different names."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf value) pairs of a nested config dict."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def _changeable(key: str, has_optimizer: bool) -> bool:
    if key == OPTIMIZER_LAYOUT_KEY:
        return not has_optimizer
    return any(key == rule or (rule.endswith(".") and key.startswith(rule)) for rule in CHANGEABLE)


_MISSING = "<absent>"


def incompatible_keys(saved: Mapping[str, Any], current: Mapping[str, Any], *, has_optimizer: bool = True,
                      defaults: Mapping[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ and may not, as `{key: (checkpoint value, current value)}`, sorted by key.

    Both configs are nested dicts (`config.loader.to_dict`, redacted the same way). A key present in one
    only counts as a difference (`"<absent>"` stands for the missing side), except that a key the checkpoint
    lacks but `defaults` (the schema's defaults, same shape) has is read at its default: a key added after
    the checkpoint was written defaults to the behaviour of the code that wrote it, so upgrading the package
    does not make every older checkpoint refuse to resume.
    """
    old, new = dict(flatten(saved)), dict(flatten(current))
    default = dict(flatten(defaults)) if defaults is not None else {}
    differing = {}
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, default.get(key, _MISSING)), new.get(key, _MISSING)
        if before != after and not _changeable(key, has_optimizer):
            differing[key] = (before, after)
    return differing


def check_resume(step_dir: str, saved: Mapping[str, Any], current: Mapping[str, Any], *,
                 has_optimizer: bool = True, defaults: Mapping[str, Any] | None = None) -> None:
    """Raise one ValueError naming every incompatible key (see `incompatible_keys`); return when compatible."""
    differing = incompatible_keys(saved, current, has_optimizer=has_optimizer, defaults=defaults)
    if not differing:
        return
    listed = "; ".join(f"{key}: checkpoint {before!r}, now {after!r}" for key, (before, after) in differing.items())
    raise ValueError(
        f"cannot resume from {step_dir}: {len(differing)} config key(s) differ from the run that wrote it "
        f"({', '.join(differing)}). {listed}. Resume with the checkpoint's values, or start a fresh run "
        "(another run.output_dir or checkpoint.dir, or run.resume=false). Allowed to differ: the layout "
        "(policy.tensor/pipeline/context_parallel_size, policy.micro_batch_size, the number of processes), "
        "run.num_steps, run.name/output_dir/log_every/progress, checkpoint.*, tracking.*, launcher.*, audit.*, "
        "eval.*, export.*, and policy.use_distributed_optimizer for a weights-only checkpoint.")


def check_config_resumes(cfg: Any) -> None:
    """With `run.resume=true`, compare `cfg` (a `TrainConfig`) with the newest complete checkpoint's config and
    raise `check_resume`'s ValueError when they are incompatible; nothing to do without a checkpoint.

    The CLI calls it right after loading the config, before any process group, MLflow run or engine exists,
    so a refused resume costs nothing and leaves the checkpoint's MLflow run untouched.
    """
    from pathlib import Path

    from nemo_rollout_correction.config.loader import defaults_dict, to_dict
    from nemo_rollout_correction.config.redaction import redact_tree
    from nemo_rollout_correction.trainer import checkpoint as ckpt
    from nemo_rollout_correction.trainer.checkpoint_door import CorruptCheckpointError

    if not cfg.run.resume:
        return
    step_dir = ckpt.latest_checkpoint(Path(cfg.checkpoint_dir))
    if step_dir is None:
        return
    try:
        meta = ckpt.load_meta(step_dir)
    except CorruptCheckpointError:  # the door refuses it inside the run, whose MLflow record then ends FAILED
        return
    check_resume(str(step_dir), meta.get("config", {}), redact_tree(to_dict(cfg)),
                 has_optimizer=bool(meta.get("has_optimizer", True)), defaults=redact_tree(defaults_dict()))


__all__ = ["CHANGEABLE", "OPTIMIZER_LAYOUT_KEY", "check_config_resumes", "check_resume", "flatten",
           "incompatible_keys"]

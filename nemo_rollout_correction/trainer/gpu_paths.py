"""Refusals of GPU-only configurations that cannot work, before any model or engine is built.

`check_gpu_paths` runs at the start of `GrpoTrainer` (and is pure: tests call it for every combination of
placement, routing replay, evaluation, TP size and device). Each refusal names the settings and what to use
instead. The GPU paths that remain allowed but never ran on a GPU in this project are listed in
docs/deployment.md, "GPU status".
"""

from __future__ import annotations

import logging

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.rollout.placement import resolve_placement

_log = logging.getLogger("nemo_rollout_correction.trainer")


def per_dp_group_gpu_shards(cfg: TrainConfig, *, data_parallel_size: int, cuda: bool) -> bool:
    """Whether this job builds vLLM engine shards on every rank (`rollout.placement=per_dp_group` on GPU, with
    vLLM's `external_launcher`), the form whose engines need every shard to call them together."""
    placement = resolve_placement(cfg.rollout.placement, data_parallel_size, one_engine=cfg.async_partial)
    return cuda and placement == "per_dp_group"


def gpu_path_problems(cfg: TrainConfig, *, data_parallel_size: int, cuda: bool) -> list[str]:
    """Why this configuration cannot run on this kind of machine (empty when it can)."""
    if not per_dp_group_gpu_shards(cfg, data_parallel_size=data_parallel_size, cuda=cuda):
        return []
    placement = (f"rollout.placement={cfg.rollout.placement}"
                 + (f" (per_dp_group at data-parallel size {data_parallel_size})"
                    if cfg.rollout.placement == "auto" else ""))
    problems = []
    if cfg.rollout.max_staleness > 0:
        problems.append(
            f"rollout.max_staleness={cfg.rollout.max_staleness} with {placement} on GPU: the async weight push runs in "
            "the rollout worker thread, and vLLM's IPC weight transfer does all_gather_object/barrier on the default "
            "NCCL group there while the main thread runs training collectives on it (a hang). Use "
            "rollout.max_staleness=0, or rollout.placement=rank0 for async rollouts")
    if cfg.eval.enabled and cfg.policy.tensor_parallel_size > 1:
        problems.append(
            f"held-out evaluation (eval.every_n_steps={cfg.eval.every_n_steps}, eval.before_train="
            f"{cfg.eval.before_train}) with {placement} on GPU and policy.tensor_parallel_size="
            f"{cfg.policy.tensor_parallel_size}: the evaluator runs on global rank 0 only, while each engine is "
            "sharded over its data-parallel group's tensor-parallel ranks, which must all generate together (the "
            "other shards would wait forever). Use rollout.placement=rank0, or eval.every_n_steps=0 and "
            "eval.before_train=false")
    return problems


def unverified_paths(cfg: TrainConfig, *, data_parallel_size: int, cuda: bool) -> list[str]:
    """The GPU-only paths this configuration takes that never ran on a GPU (docs/deployment.md, "GPU status")."""
    if not cuda:
        return []
    paths = []
    if per_dp_group_gpu_shards(cfg, data_parallel_size=data_parallel_size, cuda=cuda):
        chosen = " (chosen by rollout.placement=auto)" if cfg.rollout.placement == "auto" else ""
        paths.append(f"vLLM engine shards per data-parallel group with external_launcher, sleep mode and the IPC "
                     f"weight-transfer refit{chosen}")
    if cfg.rollout.routing_replay == "r3":
        paths.append("routing replay from vLLM's enable_return_routed_experts")
    if cfg.packs_sequences:
        paths.append("packed sequences (policy.sequence_packing) on Transformer Engine's THD attention")
    return paths


def check_gpu_paths(cfg: TrainConfig, *, data_parallel_size: int, cuda: bool) -> None:
    """Raise ValueError listing every problem of `gpu_path_problems`; log a warning naming each unverified path."""
    problems = gpu_path_problems(cfg, data_parallel_size=data_parallel_size, cuda=cuda)
    if problems:
        raise ValueError("this configuration cannot run: " + "; ".join(problems))
    for path in unverified_paths(cfg, data_parallel_size=data_parallel_size, cuda=cuda):
        _log.warning("UNVERIFIED GPU path: %s never ran on a GPU in this project's tests (docs/deployment.md, "
                     "\"GPU status\")", path)


__all__ = ["check_gpu_paths", "gpu_path_problems", "per_dp_group_gpu_shards", "unverified_paths"]

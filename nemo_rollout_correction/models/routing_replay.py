"""Rollout routing replay (R3, arXiv 2510.11370): the trainer's MoE routers use the experts vLLM chose.

Megatron-Core ships the mechanism: with `TransformerConfig(moe_enable_routing_replay=True)` every `TopKRouter`
owns a `RouterReplay`, whose `REPLAY_FORWARD` action makes the router take given top-k expert ids (and gather
its own probabilities for them) instead of its own top k. `RoutingReplay` drives it for one policy model:

- `attach(input_ids, routed_experts)` registers a microbatch's routing (`[rows, width, moe_layers, topk]`,
  -1 where none exists) under the microbatch's tokens. Every later forward of the model on those tokens
  (old-logprob pass, pre-pass, every training microbatch, every epoch) replays it: a forward pre-hook on the
  model finds it by the tokens' content and sets each router's target indices; a forward without routing
  (nothing attached) routes with the trainer's own routers.
- Token order: Megatron's router sees `[seq, batch, hidden]` flattened, token (s, b) at row `s * batch + b`;
  the replay indices are laid out the same way. Positions without routing (the last sampled token, padding)
  get experts `0..topk-1`: any valid ids do, since neither can change a logprob of a real token (causal
  attention, right padding).
- Pipeline parallelism: each stage's routers carry their global `layer_number`, so a stage takes its own
  layers' columns. Context parallelism: `attach` takes the CP shard's `position_ids` and cuts the same
  positions out of the routing.
- `rollout/router_agreement`: the fraction of (real token, layer) decisions where the trainer's own router
  would have chosen the same expert SET as the rollout. Megatron's `RouterReplay` has no hook for "what would
  the router have chosen" in replay mode, so each instance's `get_replay_topk` is wrapped: in
  `REPLAY_FORWARD` it also runs the router's own top-k (`default_compute_topk`) under no_grad and counts the
  agreement, the first time each attached microbatch is replayed (the old-logprob pass, or the first
  training forward in bypass mode).

Not covered: activation recomputation (Megatron's `REPLAY_BACKWARD`; the trainer does not recompute), and
MTP layers. `RouterReplay.global_router_replay_instances` is a process-global list; the instances of this
model are taken out of it so that several models in one process (a reference model, tests) never mix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


def _fingerprint(input_ids: Tensor) -> tuple[tuple[int, ...], str]:
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    return tuple(ids.shape), hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).hexdigest()


@dataclass
class _Attached:
    routing: Tensor  # [rows, width, moe_layers, topk] int64, -1 where no routing
    measured: bool = False


@dataclass
class _Router:
    replay: Any  # megatron RouterReplay
    column: int  # global MoE layer index: the routing's third dimension
    valid: Tensor | None = None  # [tokens] bool, the current forward's tokens with rollout routing
    measure: bool = False


@dataclass
class RoutingReplay:
    """Replays attached rollout routing in every forward of `model` (see the module docstring)."""

    model: nn.Module
    routers: list[_Router]
    topk: int
    attached: dict[tuple[tuple[int, ...], str], _Attached] = field(default_factory=dict)
    matches: int = 0
    decisions: int = 0
    replayed_forwards: int = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> RoutingReplay:
        """Wire replay into `model`, built with `moe_enable_routing_replay=True` (`routing_replay_fields`)."""
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        found = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not found:
            raise ValueError("rollout.routing_replay=r3 needs a mixture-of-experts model; this one has no router")
        missing = [m for m in found if getattr(m, "router_replay", None) is None]
        if missing:
            raise ValueError("the model was built without moe_enable_routing_replay=True: its routers cannot replay")
        routers = []
        for order, router in enumerate(found):
            layer = router.layer_number
            routers.append(_Router(replay=router.router_replay, column=(layer - 1) if layer else order))
        mine = {id(r.replay) for r in routers}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
        self = cls(model=model, routers=routers, topk=int(found[0].topk))
        for router in routers:
            self._wrap_topk(router)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward)
        return self

    # ---- attaching routing ------------------------------------------------------------------------------

    def attach(self, input_ids: Tensor, routed_experts: Tensor, position_ids: Tensor | None = None) -> None:
        """Replay `routed_experts` in every forward on exactly `input_ids` `[rows, width]`.

        routed_experts: `[rows, >= width, moe_layers, topk]` (`RolloutBatch.to_tensors()["routed_experts"]`
        rows), -1 where none; position_ids: the `[width]` global positions of a CP shard's tokens (positions
        past the routing's end, CP padding, get none).
        """
        rows, width = input_ids.shape
        routing = routed_experts.to(torch.int64)
        if position_ids is None:
            routing = routing[:, :width]
        else:
            pos = position_ids.to("cpu", torch.int64)
            inside = pos < routing.shape[1]
            picked = routing[:, pos.clamp(max=routing.shape[1] - 1)]
            routing = torch.where(inside.view(1, -1, 1, 1), picked, torch.full_like(picked, -1))
        if routing.shape[0] != rows or routing.shape[1] != width:
            raise ValueError(f"routing of shape {tuple(routed_experts.shape)} does not cover input_ids {rows}x{width}")
        self.attached[_fingerprint(input_ids)] = _Attached(routing=routing)

    def clear(self) -> None:
        """Forget every attached microbatch and the agreement counts (call once per step)."""
        self.attached.clear()
        self.matches = self.decisions = 0

    def agreement(self) -> tuple[int, int]:
        """(decisions where the trainer's router agreed with the rollout's expert set, decisions counted)."""
        return self.matches, self.decisions

    # ---- hooks ------------------------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        input_ids = kwargs.get("input_ids", args[0] if args else None)
        entry = self.attached.get(_fingerprint(input_ids)) if isinstance(input_ids, Tensor) else None
        if entry is None:  # no rollout routing for these tokens: the trainer's own routing
            for router in self.routers:
                router.replay.clear_indices()
                router.replay.clear_router_replay_action()
            return
        routing = entry.routing  # [rows, width, layers, topk]
        rows, width = routing.shape[:2]
        fallback = torch.arange(self.topk, dtype=torch.int64)
        for router in self.routers:
            if router.column >= routing.shape[2]:
                raise ValueError(f"routing has {routing.shape[2]} MoE layers; the model's layer {router.column + 1} "
                                 "has none")
            layer = routing[:, :, router.column].transpose(0, 1).reshape(width * rows, self.topk)  # row s*B+b
            valid = layer[:, 0] >= 0
            target = torch.where(valid.unsqueeze(1), layer, fallback.expand_as(layer))
            router.replay.clear_indices()
            router.replay.set_target_indices(target)
            router.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.valid, router.measure = valid, not entry.measured
        entry.measured = True
        self.replayed_forwards += 1

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # set_target_indices also appends to a backward-replay list that only recomputation consumes: clear it.
        for router in self.routers:
            router.replay.clear_indices()
            router.replay.clear_router_replay_action()
            router.valid, router.measure = None, False

    def _wrap_topk(self, router: _Router) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.replay
        original: Callable[..., tuple[Tensor, Tensor]] = replay.get_replay_topk

        def get_replay_topk(scores: Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
                            default_compute_topk: Any = None) -> tuple[Tensor, Tensor]:
            if (replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD and router.measure
                    and router.valid is not None):
                with torch.no_grad():
                    _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
                    target = replay.target_topk_idx.to(own.device)
                    same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
                    valid = router.valid.to(own.device)
                    self.matches += int((same & valid).sum())
                    self.decisions += int(valid.sum())
            return original(scores, topk, num_groups, group_topk, default_compute_topk)

        replay.get_replay_topk = get_replay_topk


def routing_replay_fields() -> dict[str, Any]:
    """`TransformerConfig` fields that give every MoE router a `RouterReplay`."""
    return {"moe_enable_routing_replay": True}


def check_moe_for_replay(num_experts: int, architecture: str) -> None:
    """Refuse `rollout.routing_replay=r3` for a dense model, naming the key."""
    if not num_experts:
        raise ValueError(f"rollout.routing_replay=r3 needs a mixture-of-experts model; {architecture} is dense. "
                         "Set rollout.routing_replay=none")


__all__ = ["RoutingReplay", "check_moe_for_replay", "routing_replay_fields"]

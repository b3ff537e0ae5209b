"""The adapter-only refit: a LoRA policy (`policy.lora`) pushes its adapters, never the base weights.

The engine starts with vLLM's LoRA support (`EngineOptions.lora_rank` > 0: `enable_lora`, `max_lora_rank`) and
serves the base checkpoint plus the current adapter: every request of `generate` carries the path's
`lora_request()`. A push receives the adapters in PEFT names (`models/lora_export.py`: per Hugging Face projection,
q/k/v and gate/up split from Megatron's fused layouts by the full refit's own table), writes them as a PEFT
adapter directory (`adapter_config.json` + `adapter_model.safetensors`, on /dev/shm unless `staging_dir` says
otherwise) and has the engine load it as a NEW adapter, id = the new weight version, then removes the previous one.

Why a new id per version and not vLLM's in-place reload (`load_inplace`): vLLM keys everything by the adapter id
(its worker's adapter cache, the scheduler's batches, punica's slot mapping), so a new id can never be served from
a stale cached copy: a request names exactly the version it was generated with, and a failed load fails the next
request instead of silently serving the previous adapter. The previous adapter is removed right after, so the
engine holds one adapter (`max_loras` = 1 suffices) and the version directories are deleted as they are replaced.

Verifiable (`verify`): every worker fingerprints its own registered copy of some adapter tensors (the first and
last layer's projections; `RefitExtension.nrc_lora_checksums`) and they are compared with the pushed tensors as
vLLM holds them: cast to the engine's dtype, B multiplied in place by alpha / r (`LoRALayerWeights.optimize`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.errors import RefitVerificationError, RolloutEngineError
from nemo_rollout_correction.rollout.refit.base import RefitPath, RefitTarget
from nemo_rollout_correction.rollout.shared_weights import checksum

_A, _B = ".lora_A.weight", ".lora_B.weight"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's allowed `max_lora_rank` values (`vllm.config.lora.MaxLoRARanks`)."""


def max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`; ValueError past 512."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"policy.lora.rank={rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def write_adapter_dir(out: Path, tensors: Mapping[str, Tensor], rank: int, alpha: float,
                      base_model: str = "") -> Path:
    """A PEFT adapter directory of `tensors` (PEFT names) with rank `rank` and `alpha`; returns `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({name.removesuffix(_A).rsplit(".", 1)[-1] for name in tensors if name.endswith(_A)})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


class LoraAdapterRefit(RefitPath):
    """The adapter-only refit (module docstring). `phases`: "write" (the PEFT directory), "load" (the engine's
    add and remove, the prefix-cache reset); `pushed_bytes`: the bytes of the latest push's tensors."""

    staging_device = "cpu"
    verifiable = True

    def __init__(self) -> None:
        super().__init__()
        self._request: Any = None
        self._dir: Path | None = None
        self._root: Path | None = None
        self._pushed: dict[str, Tensor] = {}
        self._verified_sums: dict[str, int] = {}
        self.pushed_bytes = 0

    def lora_request(self) -> Any:
        return self._request

    def push(self, engine: RefitTarget, named_tensors: Iterable[tuple[str, Tensor]], *,
             staging_dir: str | None = None) -> float:
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        # in the engine's dtype, as the full refit's buffer: vLLM casts the adapter to it on load anyway
        dtype = getattr(torch, engine.options.dtype)
        state = {name: tensor.detach().to("cpu", dtype) for name, tensor in named_tensors}
        if not state or not all(name.endswith((_A, _B)) for name in state):
            bad = next((n for n in state if not n.endswith((_A, _B))), None)
            raise ValueError(f"the LoRA adapter refit takes PEFT adapter tensors (*.lora_A/B.weight), got {bad!r}"
                             if bad else "refit() got no tensors")
        if self._root is None:
            base = staging_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            self._root = Path(tempfile.mkdtemp(prefix="nrc-lora-", dir=base))
        version = engine.weight_version + 1
        out = write_adapter_dir(self._root / f"v{version}", state, engine.options.lora_rank,
                                engine.options.lora_alpha, engine.options.model_dir)
        written = time.perf_counter()
        engine.weight_version += 1  # before the load: even a failed load salts the prefix cache anew
        request = LoRARequest(f"nrc-v{version}", version, str(out))
        previous, previous_dir = self._request, self._dir
        try:
            if previous is not None:
                engine.watched("remove the previous LoRA adapter",
                               lambda: engine.llm.llm_engine.remove_lora(previous.lora_int_id))
            self._request, self._dir = None, out
            added = engine.watched("load the LoRA adapter", lambda: engine.llm.llm_engine.add_lora(request))
            if added is False:
                raise RuntimeError(f"vLLM did not add adapter {request.lora_name}")
            engine.llm.reset_prefix_cache()
        except RolloutEngineError:
            raise
        except Exception as exc:
            raise RolloutEngineError(f"vLLM {engine.name}: LoRA adapter refit failed: {type(exc).__name__}: "
                                     f"{exc}") from exc
        self._request = request
        if previous_dir is not None:
            shutil.rmtree(previous_dir, ignore_errors=True)
        self._pushed = state
        self.pushed_bytes = sum(t.numel() * t.element_size() for t in state.values())
        self.phases = {"write": written - start, "load": time.perf_counter() - written}
        return time.perf_counter() - start

    def verify(self, engine: RefitTarget) -> None:
        if self._request is None or not self._pushed:
            raise RolloutEngineError(f"verify_refit on {engine.name} before any LoRA adapter refit")
        stems = adapter_verify_stems(self._pushed)
        try:
            answers = engine.llm.collective_rpc("nrc_lora_checksums", args=(self._request.lora_int_id, stems))
        except Exception as exc:
            raise RolloutEngineError(f"refit verification of {engine.name} failed: {type(exc).__name__}: "
                                     f"{exc}") from exc
        scale = engine.options.lora_alpha / engine.options.lora_rank
        dtype = getattr(torch, engine.options.dtype)
        checked, current = 0, {}  # (the pushed tensors are already in the engine's dtype)
        for worker, answer in enumerate(answers):
            if answer is None:
                raise RefitVerificationError(f"refit verification failed on {engine.name} (worker {worker}): the "
                                             f"LoRA adapter {self._request.lora_name} is not loaded there")
            for stem in stems:
                got = answer.get(stem)
                if got is None:
                    continue
                a = self._pushed[stem + _A].to(dtype)
                b = self._pushed[stem + _B].to(dtype)
                b *= scale  # vLLM folds the scaling into its copy of B, in its dtype (LoRALayerWeights.optimize)
                for part, want in (("A", a), ("B", b)):
                    key = f"{stem}.{part}@{worker}"
                    current[key] = checksum(want)
                    if int(got[part]) != current[key]:
                        why = ("it still holds the previous adapter (the sync was lost)"
                               if self._verified_sums.get(key) == int(got[part]) else
                               "it holds neither the new nor the previous adapter")
                        raise RefitVerificationError(
                            f"refit verification failed on {engine.name} (worker {worker}): LoRA {part} of {stem!r} "
                            f"differs from the trainer's after the adapter sync: {why}.")
                    checked += 1
        if checked == 0:
            raise RefitVerificationError(f"refit verification on {engine.name}: none of the LoRA tensors {stems} is "
                                         "readable on the engine's workers")
        self._verified_sums = current

    def release(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root, self._dir, self._request = None, None, None
        self._verified_sums = {}


def adapter_verify_stems(tensors: Mapping[str, Tensor]) -> list[str]:
    """PEFT module stems (`base_model.model.model.layers.L.self_attn.q_proj`) to read back: every projection of
    the first and the last adapted layer."""
    stems = sorted({name.removesuffix(_A) for name in tensors if name.endswith(_A)})
    layers = sorted({int(s.split(".")[4]) for s in stems if s.split(".")[3] == "layers"})
    keep = {layers[0], layers[-1]} if layers else set()
    return [s for s in stems if s.split(".")[3] == "layers" and int(s.split(".")[4]) in keep]


__all__ = ["VLLM_LORA_RANKS", "LoraAdapterRefit", "adapter_verify_stems", "max_lora_rank", "write_adapter_dir"]

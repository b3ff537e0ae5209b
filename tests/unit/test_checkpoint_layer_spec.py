"""A checkpoint of one Megatron-Core layer spec is refused, by name, when loaded into a model of the other: the
local spec (CPU) keeps separate norm modules, the Transformer Engine spec (GPU) fuses them into the next linear
layer (`models.hf_mapping.TE_ALIASES`) and adds `_extra_state`."""

from __future__ import annotations

from pathlib import Path

import pytest
from default_lane import require

require("megatron.core", "megatron")

from nemo_rollout_correction.models.hf_mapping import TE_ALIASES
from nemo_rollout_correction.trainer.checkpoint import check_layer_spec, layer_spec_of

LOCAL = [f"decoder.layers.{i}.{suffix}" for i in range(2) for suffix in (
    "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
    "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")] + [
    "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
TO_TE = {local: te for te, local in TE_ALIASES.items()}
TE = [next((name.replace(local, te) for local, te in TO_TE.items() if name.endswith(local)), name) for name in LOCAL]
OPTIMIZER = [f"optimizer.state.exp_avg.{name}" for name in LOCAL]


def test_layer_spec_is_read_from_names() -> None:
    assert layer_spec_of(LOCAL) == "local"
    assert layer_spec_of(TE) == "transformer_engine"
    assert layer_spec_of(LOCAL + OPTIMIZER) == "local"
    assert layer_spec_of(["embedding.word_embeddings.weight"]) is None  # a stage without layers says nothing


@pytest.mark.parametrize(("saved", "wanted"), [(LOCAL + OPTIMIZER, TE), (TE, LOCAL)])
def test_the_other_spec_is_refused_with_what_to_do(saved: list[str], wanted: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        check_layer_spec(Path("ckpt/step_3"), saved, wanted)
    message = str(caught.value)
    assert "ckpt/step_3" in message and "local" in message
    assert "transformer_engine" in message and "nrc export" in message and "model.source" in message


def test_the_same_spec_loads() -> None:
    check_layer_spec(Path("x"), LOCAL + OPTIMIZER, LOCAL)
    check_layer_spec(Path("x"), TE, TE)
    check_layer_spec(Path("x"), ["embedding.word_embeddings.weight"], TE)

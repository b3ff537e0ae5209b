"""Bind the packed-sequence path's Megatron calls (`models.packing`, `models.schedule._stage_forward`) against
whichever megatron-core is importable: in-process with the installed 0.16.1, and as a script in a subprocess with
the GPU image's 0.19.2 on PYTHONPATH (`python packing_probe.py` prints one JSON line). The GPU path itself
(Transformer Engine's THD attention) needs a GPU; what a CPU can check is that every argument the trainer passes
exists in that release and that its TE attention still turns a causal THD pack into `padding_causal`."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any

import torch


def probe() -> dict[str, Any]:
    """{check: "ok" or what failed}."""
    import megatron.core
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    from nemo_rollout_correction.models.packing import PackedRows

    results: dict[str, Any] = {"megatron_core": megatron.core.__version__}
    packed = PackedRows.of(torch.randint(0, 9, (3, 7)), torch.tensor([2, 7, 4]))
    params = packed.packed_seq_params()
    results["packed_seq_params"] = "ok" if isinstance(params, PackedSeqParams) and params.qkv_format == "thd" \
        else f"not a THD PackedSeqParams: {params!r}"
    used = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"}
    missing = used - {f.name for f in dataclasses.fields(PackedSeqParams)}
    results["packed_seq_fields"] = "ok" if not missing else f"missing {sorted(missing)}"
    try:  # the call `_stage_forward` makes on a packed microbatch
        inspect.signature(GPTModel.forward).bind(None, input_ids=packed.input_ids, position_ids=packed.position_ids,
                                                 attention_mask=None, packed_seq_params=params)
        results["gpt_forward"] = "ok"
    except TypeError as exc:
        results["gpt_forward"] = f"TypeError: {exc}"
    spec = importlib.util.find_spec("megatron.core.extensions.transformer_engine")
    source = Path(spec.origin).read_text() if spec is not None and spec.origin else ""
    results["te_thd_padding_causal"] = "ok" if 'qkv_format == "thd"' in source and "padding_causal" in source \
        else "TEDotProductAttention no longer maps a causal THD pack to padding_causal"
    rope = importlib.util.find_spec("megatron.core.models.common.embeddings.rope_utils")
    rope_source = Path(rope.origin).read_text() if rope is not None and rope.origin else ""
    results["rope_thd"] = "ok" if "def _apply_rotary_pos_emb_thd" in rope_source else "no THD rotary embedding"
    return results


if __name__ == "__main__":
    print(json.dumps(probe()))

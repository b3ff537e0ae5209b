"""The PEFT adapter `nrc export --adapter` writes (models.lora_export) loaded by PEFT itself, logprobs compared.

Not a test: PEFT is not a dependency of this package. It needs `peft` (0.21.2 was used: a pure-Python wheel whose
requirements, accelerate 1.15.0 included, the package's own torch 2.13 CPU and transformers satisfy, so it pulls
no other torch), e.g. `pip install --no-deps --target /tmp/peftlib peft accelerate` and
`PYTHONPATH=$PWD:/tmp/peftlib python benchmarks/lora_peft_load.py`.

In one gloo process: a tiny-llama LoRA policy (rank 8, B seeded noise of std 0.02) writes its adapter with
`write_peft_adapter`; transformers loads the base checkpoint, `PeftModel.from_pretrained` the adapter; printed:
max |trainer - PEFT| token logprob on random sequences, and how far the adapter moves PEFT's from the base.
"""

import tempfile

import torch


def main() -> None:
    import peft
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nemo_rollout_correction.audit.lora import seed_adapter_b
    from nemo_rollout_correction.distributed.runtime import init_runtime
    from nemo_rollout_correction.models.lora import LoraConfig
    from nemo_rollout_correction.models.lora_export import write_peft_adapter
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.sources import resolve_model_source
    init_runtime()
    hf = str(resolve_model_source("tiny-llama"))
    lora = LoraConfig(rank=8, alpha=16.0)
    policy = MegatronPolicy.from_hf(hf, lora=lora)
    seed_adapter_b(policy, 0.02, 1)
    out = write_peft_adapter(tempfile.mkdtemp(), policy.hf_adapter_state_dict(), lora, hf)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (4, 24), generator=gen)
    with torch.no_grad():
        ours = policy.token_logprobs(ids)
        base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        base_lp = torch.log_softmax(base(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        model = PeftModel.from_pretrained(base, str(out)).eval()
        logits = model(ids).logits[:, :-1].float()
        theirs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    diff, effect = float((ours - theirs).abs().max()), float((theirs - base_lp).abs().max())
    print(f"peft {peft.__version__} transformers {transformers.__version__}: max |trainer - peft| {diff:.3e}; "
          f"adapter effect max |peft - base| {effect:.3e}")


if __name__ == "__main__":
    main()

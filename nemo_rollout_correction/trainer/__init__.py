"""The GRPO trainer (docs/training.md).

- `grpo`: `GrpoTrainer`, one step = rollouts -> rewards -> advantages -> rollout correction -> update -> refit:
  the wiring, the step's phases, the run loop and the checkpoint calls; it owns three components:
- `fleet`: `RolloutFleet`, the engines: placement, generation, the step's batch by rollout mode (synchronous,
  async pipeline, partial), refit, evaluation's use of the engines; with `row_sharing` (`RowSharing`: rows
  between ranks) and `in_flight` (`InFlightRollouts`: a checkpoint's in-flight rollouts);
- `step_batch`: `prepare_batch`, the step's batch from its rollouts: advantages, rewritten-history rows,
  tensors, the overlong filter, the staleness tensors;
- `policy_update`: `PolicyUpdate`, the optimizer updates: mini-batches and microbatches, old and reference
  logprobs, plan -> forward/backward -> finish, as immutable records per phase;
- `step_report`: `StepReport`, the step's metrics, the review, `metrics.jsonl` and the observer calls;
- `async_rollouts`: the k-step-off-policy pipeline of engine jobs (`rollout.max_staleness`);
- `partial_rollouts`: the fleet's driver of partial rollouts (`rollout.partial`);
- `dynamic_sampling`: DAPO's refills, overlong penalty and overlong filter on the step's batch;
- `evaluation`: held-out evaluation on the engine;
- `mismatch_alert`: the mismatch alarm (warning, MLflow tag, strict stop);
- `checkpoint`: sharded, layout-free checkpoints (Megatron `dist_checkpointing`) and exact resume;
- `resume_check`: which config changes a resume accepts (the layout) and which it refuses;
- `preemption`: SIGTERM/SIGINT/SIGUSR1 handling, every rank stops after the same step;
- `gpu_paths`: GPU-only layouts refused or logged as unverified;
- `observer`: the `TrainObserver` protocol (what the trainer reports) and the per-step review data;
- `console`: what a person sees (progress bar with ETA, closing summary, library output to a log file).

The tasks, rewards and prompt data are in `tasks`; what the trainer shares with `nrc audit` (engine settings,
tokenisation, the rollout exchange, re-scoring, routing replay, metric names) is in `harness`; the audit itself
is `audit`, which imports no trainer module.

Layer: beside `audit` and `tracking`, above `harness` and `tasks` (docs/design.md, "Layers"); the CLI glues
them together.
"""

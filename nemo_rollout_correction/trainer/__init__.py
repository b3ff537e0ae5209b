"""The GRPO trainer and the audit (docs/training.md, docs/audit.md).

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
- `metric_names`: the names of the emitted metrics that code reads (console, observer, audit);
- `async_rollouts`: the k-step-off-policy pipeline of engine jobs (`rollout.max_staleness`);
- `dynamic_sampling`: DAPO's refills, overlong penalty and overlong filter on the step's batch;
- `evaluation`: held-out evaluation on the engine;
- `scoring`: re-scoring rollout tokens with the policy, per-sequence log ratios (shared with the audit);
- `routing_replay`: MoE rollout routing replay (R3) glue;
- `audit`: `nrc audit`, the mismatch report of a model + engine + dtype without training;
- `settings`: engine, sampling and replay settings shared by both, tokenisation, the rollout broadcast;
- `tasks`, `rewards`, `reward_pool`, `data`: built-in tasks, reward functions (and their worker pool) and prompt
  datasets;
- `checkpoint`: sharded, layout-free checkpoints (Megatron `dist_checkpointing`) and exact resume;
- `resume_check`: which config changes a resume accepts (the layout) and which it refuses;
- `observer`: the `TrainObserver` protocol (what the trainer reports) and the per-step review data;
- `console`: what a person sees (progress bar with ETA, closing summary, library output to a log file).

Layer: beside `tracking`, above `config` (docs/design.md, "Layers"); the CLI glues the two together.
"""

"""The GRPO trainer and the audit (docs/training.md, docs/audit.md).

- `grpo`: `GrpoTrainer`, one step = rollouts -> rewards -> advantages -> rollout correction -> update -> refit;
- `audit`: `nrc audit`, the mismatch report of a model + engine + dtype without training;
- `settings`: engine, sampling and replay settings shared by both, tokenisation, the rollout broadcast;
- `tasks`, `rewards`, `data`: built-in tasks, reward functions and prompt datasets;
- `checkpoint`: sharded, layout-free checkpoints (Megatron `dist_checkpointing`) and exact resume;
- `resume_check`: which config changes a resume accepts (the layout) and which it refuses;
- `observer`: the `TrainObserver` protocol (what the trainer reports) and the per-step review data;
- `console`: what a person sees (progress bar with ETA, closing summary, library output to a log file).

Layer: beside `tracking`, above `config` (docs/design.md, "Layers"); the CLI glues the two together.
"""

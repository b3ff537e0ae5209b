"""What a run trains on: prompt data, built-in tasks, rewards and multi-turn environments (docs/tasks.md).

- `builtin`: `Task` (prompt records + the reward that scores them), `build_task`, `task_from_config`;
- `prompts`: `PromptRecord`, JSONL/Parquet loading, `PromptSampler` (resumable);
- `rewards`: the reward protocol, the built-in rewards, a user's function, checked `score`;
- `reward_pool`: `RewardPool`, rewards scored in worker processes, each call bounded in time;
- `environments`: the multi-turn environments (calculator, feedback, compaction) and the fleet's seam;
- `env_reward`: the multi-turn reward, light (no torch at import: a spawned reward worker loads it).

Nothing here imports the trainer or the audit; both import it. This `__init__` imports nothing, so a reward
worker that loads `env_reward` does not pay for torch.

Layer: beside `harness`, above `config`, below `trainer` and `audit` (docs/design.md, "Layers").
"""

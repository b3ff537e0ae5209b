"""What `nrc train` and `nrc audit` both put around a policy and its rollout engine (docs/design.md, "Layers").

A clean audit is meant to predict the first training step, so both commands build the engine, tokenise
prompts, share rollouts and re-score them in one way, kept here once:

- `settings`: engine, sampling and replay settings from the config; prompt tokenisation, the pad id;
- `exchange`: the engine ranks' rollouts shared with (broadcast to, gathered on) every rank of the job;
- `scoring`: a CP rank's cut of the tokens, re-scoring rollout tokens with the policy, per-sequence log ratios;
- `routing_replay`: MoE rollout routing replay (R3) attached to the policy's forwards, the router agreement;
- `metric_names`: the names of the step metrics code reads (console, observer, mismatch alarm, audit).

Layer: beside `tasks`, above `config`, `models` and `rollout`, below `trainer` and `audit`.
"""

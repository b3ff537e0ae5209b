"""`nrc audit`: the rollout/trainer mismatch of a model + engine + dtype, without training (docs/audit.md).

- `mismatch`: `run_audit` (generate as training would, re-score with the Megatron policy, report the mismatch
  and what each preset would do), `format_report`, `format_comparison`;
- `probes`: whole-distribution TV/KL on the audit's fixed tokens, per-layer trainer vs `transformers`;
- `multi_turn`: `run_multi_turn_audit` (`nrc audit --multi-turn`), the token ids re-tokenizing chat text changes.

What it shares with `nrc train` (engine and sampling settings, tokenisation, the rollout exchange, re-scoring,
routing replay, metric names) lives in `harness`, below both; the audit imports no trainer module and the
trainer none of the audit's.

Layer: beside `trainer` and `tracking`, above `harness` and `tasks` (docs/design.md, "Layers").
"""

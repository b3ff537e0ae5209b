"""`nrc audit [key=value ...]`: the mismatch report of a model + vLLM engine + dtype (see docs/audit.md).

Uses the same configuration as `nrc train` (model, rollout engine and sampling, task prompts, policy
dtype and parallelism, the `audit:` section; `audit.vocab_top_k` and `audit.layer_sequences` size the
whole-distribution and per-layer probes of audit/probes.py). With no arguments it audits the
embedded default model (SmolLM2-135M-Instruct) on the default task. The report is printed; it is also logged
to MLflow when `tracking.tracking_uri` is set, and written as JSON with `--json PATH`. `--multi-turn` reports
instead the token ids that re-tokenizing multi-turn chat text changes (audit/multi_turn.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_rollout_correction.cli.preflight import add_config_dir_argument, check_media_packages
from nemo_rollout_correction.config import ConfigError, load_config, to_dict
from nemo_rollout_correction.config.redaction import secret_values
from nemo_rollout_correction.trainer.console import Console, set_current


def run_audit_cli(overrides: Sequence[str], json_path: str | None = None, config_dir: str | None = None,
                  multi_turn: bool = False) -> int:
    """Run the audit; returns the exit code (2: bad configuration, 3: tracking unreachable, 1: failure).
    `multi_turn`: the re-tokenization drift of multi-turn trajectories instead (audit/multi_turn.py)."""
    try:
        cfg = load_config(list(overrides), config_dir)
    except ConfigError as exc:
        print(f"nrc audit: configuration error: {exc}", file=sys.stderr)
        return 2
    problem = check_media_packages("nrc audit")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    # Progress and errors go through the trainer's console (stderr, credentials redacted, main rank only);
    # the report itself is the command's result and goes to stdout.
    console = Console(secrets=secret_values(to_dict(cfg)))
    set_current(console)
    if multi_turn:
        return _multi_turn_audit(cfg, json_path, console)
    from nemo_rollout_correction.audit.mismatch import format_comparison, format_report, run_audit
    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime

    runtime = init_runtime(cfg.policy.tensor_parallel_size, cfg.policy.pipeline_parallel_size,
                           cfg.policy.context_parallel_size)
    console.is_main = runtime.is_main
    tracker = None
    try:
        if runtime.is_main and cfg.tracking.tracking_uri:
            from nemo_rollout_correction.tracking import MlflowTracker, TrackingUnavailableError

            tracker = MlflowTracker(cfg.tracking.tracking_uri, cfg.tracking.experiment,
                                    f"audit-{Path(cfg.model.source).name}-{cfg.rollout.dtype}", cfg.run.output_dir,
                                    rank=runtime.rank, tags={"nrc.kind": "audit"})
            try:
                tracker.start()
            except TrackingUnavailableError as exc:
                console.print(f"nrc audit: {exc}")
                return 3
        reports = run_audit(cfg, runtime, log=console.print)
        if not runtime.is_main:
            return 0
        for report in reports:
            print(format_report(report))
            print()
        if len(reports) > 1:
            print(format_comparison(reports))
        if json_path:
            Path(json_path).write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
        if tracker is not None:
            tracker.log_config(to_dict(cfg))
            for step, report in enumerate(reports):
                tracker.log_metrics(report.flat_metrics(), step=step)
            report_file = Path(cfg.run.output_dir) / "audit_report.json"
            report_file.parent.mkdir(parents=True, exist_ok=True)
            report_file.write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
            tracker.log_artifact(report_file, "audit")
            tracker.close("FINISHED")
            tracker = None
        return 0
    except Exception as exc:
        console.is_main = True  # a failure is reported by whichever rank hit it
        console.print(f"nrc audit: failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        if tracker is not None:
            tracker.close("FAILED")
        shutdown_runtime()
        set_current(None)


def _multi_turn_audit(cfg: Any, json_path: str | None, console: Console) -> int:
    """`nrc audit --multi-turn`: one process, the engine only (no trainer, no MLflow run)."""
    from nemo_rollout_correction.audit.multi_turn import format_multi_turn_report, run_multi_turn_audit

    try:
        report = run_multi_turn_audit(cfg, log=console.print)
        print(format_multi_turn_report(report))
        if json_path:
            Path(json_path).write_text(json.dumps({**dataclasses.asdict(report),
                                                   "differing_frac": report.differing_frac}, indent=2))
        return 0
    except Exception as exc:
        console.print(f"nrc audit: failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        set_current(None)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `nrc audit`."""
    parser = sub.add_parser("audit", help="measure the vLLM/trainer mismatch of a model, engine and dtype",
                            description="Generate with vLLM as training would, re-score with the Megatron policy and "
                                        "print the mismatch report (kl, k3_kl, chi2, ppl ratio, weight quantiles, "
                                        "what each preset would truncate or reject, worst sequences; TV and KL of "
                                        "whole next-token distributions on the fixed tokens, the first response "
                                        "token alone, per-layer trainer vs transformers differences). Takes the "
                                        "same key=value overrides as `nrc train`, e.g. rollout.dtype=bfloat16 "
                                        "audit.compare_dtypes=true model.source=/path/to/hf_checkpoint.")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--json", metavar="PATH", help="also write the report(s) as JSON")
    parser.add_argument("--multi-turn", action="store_true",
                        help="instead: the fraction of token ids that re-tokenizing the chat text of multi-turn "
                             "trajectories changes, against token in / token out (engine only; docs/audit.md)")
    add_config_dir_argument(parser)
    parser.set_defaults(func=lambda args: run_audit_cli(args.overrides, args.json, args.config_dir,
                                                        args.multi_turn))


__all__ = ["add_parser", "run_audit_cli"]

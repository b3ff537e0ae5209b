"""`nrc`: the command-line entry point.

Subcommands:
  nrc train         GRPO with rollout correction: vLLM rollouts, Megatron-Core policy, MLflow (the main job)
  nrc audit         measure the rollout/trainer mismatch of a model + engine + dtype before a long run
  nrc config show   print the resolved training configuration (after overrides)
  nrc launch        run `nrc train` under torchrun locally or on Slurm (NeMo-Run)
  nrc export        write a run's checkpoint as a Hugging Face model (safetensors, tokenizer, chat template)
  nrc demo          every preset applied to generated rollouts with a real bf16-vs-fp32 mismatch
  nrc presets       list the presets and their resolved fields
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from nemo_rollout_correction import RolloutCorrectionConfig, __version__, compute_rollout_correction
from nemo_rollout_correction.cli import audit as audit_cli
from nemo_rollout_correction.cli import export as export_cli
from nemo_rollout_correction.cli import train as train_cli
from nemo_rollout_correction.cli.preflight import add_config_dir_argument

# The columns of the demo table: (header, metric key without the rollout_corr/ prefix).
_COLUMNS: tuple[tuple[str, str], ...] = (
    ("kept", "kept_token_fraction"),
    ("is_mean", "rollout_is_mean"),
    ("is_p99", "rollout_is_p99"),
    ("ess", "rollout_is_eff_sample_size"),
    ("rs_masked", "rollout_rs_masked_fraction"),
    ("kl", "kl"),
    ("chi2_tok", "chi2_token"),
)


def generate_rollouts(batch: int, seq: int, vocab: int, seed: int, num_nan: int) -> dict[str, torch.Tensor]:
    """Rollouts whose mismatch is real numerics, not injected noise.

    The "rollout engine" samples tokens from bf16 logits and reports bf16 log-softmax
    logprobs; the "trainer" re-scores the same tokens from the same logits in fp32. Response
    lengths vary per row (right padding), and `num_nan` rollout logprobs are NaN, as vLLM
    occasionally returns.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen) * 3.0
    rollout_logp_all = torch.log_softmax(logits.bfloat16(), dim=-1).float()
    tokens = torch.multinomial(rollout_logp_all.exp().reshape(-1, vocab), 1, generator=gen).reshape(batch, seq)
    rollout_logprobs = rollout_logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=gen)
    loss_mask = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    if num_nan:
        rows = torch.randint(0, batch, (num_nan,), generator=gen)
        rollout_logprobs[rows, 0] = float("nan")
    # GRPO-like advantages (half the rows negative), for the presets that mask by advantage (OPSM, DPPO-TV).
    advantages = torch.where(torch.rand(batch, generator=gen) < 0.5, -1.0, 1.0)
    return {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs, "loss_mask": loss_mask,
            "advantages": advantages}


def _format_row(name: str, metrics: dict[str, float], millis: float) -> str:
    cells = [f"{name:<28}"]
    for header, key in _COLUMNS:
        value = metrics.get(f"rollout_corr/{key}")
        cells.append(f"{'-':>{max(len(header), 9)}}" if value is None else f"{value:>{max(len(header), 9)}.4g}")
    cells.append(f"{millis:>8.1f}")
    return " ".join(cells)


def run_demo(args: argparse.Namespace) -> int:
    """`nrc demo`: run presets on generated rollouts and print a comparison table."""
    names = args.preset or RolloutCorrectionConfig.preset_names()
    unknown = [n for n in names if n not in RolloutCorrectionConfig.preset_names()]
    if unknown:
        print(f"nrc demo: unknown preset(s) {unknown}; valid: {RolloutCorrectionConfig.preset_names()}",
              file=sys.stderr)
        return 2
    print(f"nrc demo (nemo_rollout_correction {__version__}): generated data, not a training run")
    print(f"generating {args.batch} x {args.seq} rollouts (vocab {args.vocab}): bf16 rollout engine vs fp32 "
          f"trainer, {args.nan} NaN rollout logprob(s) injected ...", flush=True)
    data = generate_rollouts(args.batch, args.seq, args.vocab, args.seed, args.nan)
    header = " ".join([f"{'preset':<28}", *(f"{h:>{max(len(h), 9)}}" for h, _ in _COLUMNS), f"{'ms':>8}"])
    print(header)
    print("-" * len(header))
    results: dict[str, dict[str, float]] = {}
    for name in names:
        cfg = RolloutCorrectionConfig.from_preset(name)
        start = time.perf_counter()
        out = compute_rollout_correction(data["old_logprobs"], data["rollout_logprobs"], data["loss_mask"], cfg,
                                         advantages=data["advantages"])
        millis = (time.perf_counter() - start) * 1e3
        results[name] = out.metrics
        print(_format_row(name, out.metrics, millis), flush=True)
    first = results[names[0]]
    print(f"\nnon-finite rollout logprobs: {first['rollout_corr/nonfinite_token_count']:.0f} token(s) in "
          f"{first['rollout_corr/nonfinite_seq_count']:.0f} sequence(s), kept out of every loss "
          "(nonfinite_policy=reject_sequence)")
    if args.show_metrics:
        print(f"\nall metrics for preset {names[0]!r}:")
        for key, value in sorted(first.items()):
            print(f"  {key:<52} {value:.6g}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True))
        print(f"\nwrote {args.json}")
    return 0


def run_presets(args: argparse.Namespace) -> int:
    """`nrc presets`: list every preset with its non-default fields."""
    defaults = RolloutCorrectionConfig().to_dict()
    for name in RolloutCorrectionConfig.preset_names():
        fields = RolloutCorrectionConfig.from_preset(name).to_dict()
        changed = {k: v for k, v in fields.items() if v != defaults[k]}
        print(f"{name:<28} {changed if changed else '(defaults: metrics only, nothing applied)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `nrc` argument parser."""
    parser = argparse.ArgumentParser(prog="nrc", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"nemo_rollout_correction {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="apply the presets to generated rollouts with a bf16/fp32 mismatch")
    demo.add_argument("--preset", action="append", help="preset to run (repeatable; default: all)")
    demo.add_argument("--batch", type=_positive_int, default=64, help="sequences (default 64)")
    demo.add_argument("--seq", type=_positive_int, default=512, help="response length (default 512)")
    demo.add_argument("--vocab", type=_positive_int, default=1024, help="vocabulary size (default 1024)")
    demo.add_argument("--nan", type=_non_negative_int, default=2, help="NaN rollout logprobs to inject (default 2)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--show-metrics", action="store_true", help="print every metric of the first preset")
    demo.add_argument("--json", metavar="PATH", help="also write all metrics of all presets as JSON")
    demo.set_defaults(func=run_demo)

    presets = sub.add_parser("presets", help="list the presets and their fields")
    presets.set_defaults(func=run_presets)

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved `nrc train` configuration as YAML")
    show.add_argument("overrides", nargs="*", help="key=value overrides, as for `nrc train`")
    add_config_dir_argument(show)
    show.set_defaults(func=run_config_show)

    train_cli.add_parser(sub)
    audit_cli.add_parser(sub)
    export_cli.add_parser(sub)
    # `nrc launch ...` is dispatched in main() before parsing (its options belong to the launcher); this entry
    # only lists it in `nrc --help`.
    sub.add_parser("launch", help="launch nrc train with torchrun locally or on Slurm (NeMo-Run); see nrc launch -h")
    return parser


def run_launch(argv: list[str]) -> int:
    """`nrc launch ...`: forwarded to `nemo_rollout_correction.launch.main` (which has its own --help)."""
    from nemo_rollout_correction.launch import main as launch_main

    return int(launch_main(argv))


def run_config_show(args: argparse.Namespace) -> int:
    """`nrc config show [overrides]`: the composed, validated configuration."""
    from nemo_rollout_correction.config import ConfigError, config_show

    try:
        print(config_show(list(args.overrides), args.config_dir), end="")
    except ConfigError as exc:
        print(f"nrc config show: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run `nrc`; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return run_launch(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

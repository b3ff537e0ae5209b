"""`nrc launch` / `python -m nemo_rollout_correction.launch`: run `nrc train` (or any entry) under torchrun.

    python -m nemo_rollout_correction.launch launcher.nproc_per_node=2 rollout_correction=token_tis
    python -m nemo_rollout_correction.launch launcher.name=slurm launcher.nodes=4 launcher.nproc_per_node=8 \\
        launcher.account=acct launcher.partition=batch launcher.container_image=nvcr.io/my/nrc:0.1.0 \\
        launcher.container_mounts=[/lustre/data:/data] run.output_dir=/data/runs/grpo --dry-run
    python -m nemo_rollout_correction.launch launcher.nproc_per_node=2 \\
        --entry-module nemo_rollout_correction.launch.smoke -- --output-dir /tmp/smoke

The overrides (and `--config-dir`) are those of `nrc train` (Hydra syntax); the composed config's `launcher:` section
(`launcher=slurm`, `launcher.<field>=<value>`, `parallelism=<layout>`) says how to start it, and every
override is passed on to `nrc train`. With `--entry-module` or `--entry` the job runs that instead,
with the non-launcher overrides and the arguments after `--` (docs/deployment.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from nemo_rollout_correction.config.options import add_config_dir_argument
from nemo_rollout_correction.config.schema import LauncherConfig
from nemo_rollout_correction.launch.entry import Entry, shell_join, torchrun_command
from nemo_rollout_correction.launch.settings import is_launcher_override, settings_for


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (the part of argv before `--`)."""
    p = argparse.ArgumentParser(prog="nrc launch", description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join((__doc__ or "").splitlines()[1:]))
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="launcher.<field>=<value> and nrc train overrides (Hydra syntax)")
    entry = p.add_mutually_exclusive_group()
    entry.add_argument("--entry-module", metavar="MODULE",
                       help="run `python -m MODULE <args after -->` instead of nrc train")
    entry.add_argument("--entry", metavar="EXECUTABLE", help="run `EXECUTABLE <args after -->` instead of nrc train")
    add_config_dir_argument(p)
    p.add_argument("--name", default="nrc", help="NeMo-Run experiment and job name (default: nrc)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for every rank")
    p.add_argument("--job-dir", help="slurm: directory for the sbatch script and logs (shared file system)")
    p.add_argument("--dry-run", action="store_true",
                   help="render without running: print the torchrun command, and for slurm the sbatch script")
    p.add_argument("--no-tail-logs", action="store_true", help="do not stream the ranks' logs while waiting")
    p.add_argument("--print-torchrun", action="store_true",
                   help="only print the plain torchrun command (no NeMo-Run needed) and exit")
    return p


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r} must be KEY=VALUE")
        env[key] = value
    return env


def resolve(argv: Sequence[str]) -> tuple[argparse.Namespace, LauncherConfig, Entry]:
    """Parse argv into the options, the launcher settings and the entry each rank runs."""
    argv = list(argv)
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if args.entry_module or args.entry:
        # A custom entry: only the launcher's own overrides configure the launch; the rest go to the entry.
        ours = [o for o in args.overrides if is_launcher_override(o)]
        rest = [o for o in args.overrides if not is_launcher_override(o)]
        settings = settings_for(ours, args.config_dir)
        make = Entry.module if args.entry_module else Entry.executable
        entry = make(args.entry_module or args.entry, *rest, *tail)
    else:
        if tail:
            raise ValueError(f"arguments after -- ({tail}) need --entry or --entry-module; "
                             "nrc train takes key=value overrides")
        # The whole nrc train config is composed (and validated) here, before anything is started.
        settings = settings_for(args.overrides, args.config_dir)
        # Every rank composes the same config: it gets the directory as an absolute path (its cwd may differ).
        config_dir = [] if args.config_dir is None else ["--config-dir", str(Path(args.config_dir).resolve())]
        entry = Entry.train([*config_dir, *args.overrides])
    return args, settings, entry


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the process exit status (0 success, 1 job failed, 2 bad input)."""
    try:
        args, settings, entry = resolve(sys.argv[1:] if argv is None else argv)
        env = _parse_env(args.env)
    except ValueError as exc:
        print(f"nrc launch: {exc}", file=sys.stderr)
        return 2
    command = torchrun_command(settings, entry)
    if args.print_torchrun or args.dry_run:
        print(shell_join(command))
    if args.print_torchrun:
        return 0
    from nemo_rollout_correction.launch.recipe import launch  # imports nemo-run

    try:
        result = launch(settings, entry, name=args.name, dryrun=args.dry_run, env=env, job_dir=args.job_dir,
                        tail_logs=not args.no_tail_logs)
    except ImportError as exc:
        print(f"nrc launch: {exc}", file=sys.stderr)
        return 2
    if result.sbatch_script is not None:
        print(result.sbatch_script)
    print(f"nrc launch: {result.status} (experiment directory {result.experiment_dir})")
    return 0 if result.succeeded else 1

"""`nrc train [key=value ...]`: the GRPO main job (see docs/training.md).

Order of operations is chosen so failures are cheap and loud:
1. the configuration is composed and validated (bad override -> exit 2 with the key named); global rank 0 locks
   `run.output_dir` and settles a previous run in it (trainer/run_dir.py: another live run there, or a previous
   run without run.resume/run.overwrite -> exit 2 with one line naming it);
2. torch.distributed and Megatron's parallel state are initialised (torchrun or one process);
3. on the logging rank, the MLflow store is contacted BEFORE any model work (unreachable -> exit 3);
4. the trainer builds the policy and the vLLM engine and runs; any failure marks the MLflow run FAILED,
   flushes what was logged, and exits non-zero. An expected failure (disk full, an engine killed by the OOM
   killer, a port in use, a missing model directory: cli/failures.py) is said in one line, on the terminal and
   as the run's `nrc.error`; any other keeps `Type: message` and its traceback in the log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nemo_rollout_correction.cli.preflight import add_config_dir_argument, check_media_packages
from nemo_rollout_correction.config import ConfigError, load_config, to_dict
from nemo_rollout_correction.config.redaction import secret_values
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.trainer.console import Console, RunSummary, set_current

if TYPE_CHECKING:
    from nemo_rollout_correction.tracking import MlflowTracker

EXIT_CONFIG = 2
EXIT_TRACKING = 3
EXIT_FAILED = 1
# EXIT_PREEMPTED (75, a clean stop on SIGTERM/SIGINT/SIGUSR1) is defined in trainer/preemption.py


def _resume_run_id(cfg: TrainConfig) -> str | None:
    """The MLflow run id stored in the newest checkpoint when resuming (None otherwise)."""
    from nemo_rollout_correction.trainer import checkpoint as ckpt
    from nemo_rollout_correction.trainer.checkpoint_door import CorruptCheckpointError

    if not cfg.run.resume:
        return None
    step_dir = ckpt.latest_checkpoint(Path(cfg.checkpoint_dir))
    if step_dir is None:
        return None
    try:
        meta = ckpt.load_meta(step_dir)
    except CorruptCheckpointError:  # unknown run id: a new MLflow run records the failure, which
        return None                      # `_check_resume_checkpoint` raises with its one line
    run_id = meta.get("observer", {}).get("mlflow_run_id")
    return str(run_id) if run_id else None


def run_train(overrides: Sequence[str], config_dir: str | None = None, verbose: bool = False) -> int:
    """Run the GRPO job with Hydra-style `overrides` (and a user config directory searched before conf/);
    returns the exit code (also written to `$NRC_EXIT_CODE_FILE` when set: docs/deployment.md). Library output
    goes to `<run.output_dir>/nrc.log` (also to the terminal with `verbose`); the terminal shows our progress
    and a closing summary (trainer/console.py)."""
    from nemo_rollout_correction.trainer.preemption import write_exit_code

    code = _run_train(overrides, config_dir, verbose)
    write_exit_code(code)
    return code


def _run_train(overrides: Sequence[str], config_dir: str | None, verbose: bool) -> int:
    try:
        cfg = load_config(list(overrides), config_dir)
    except ConfigError as exc:
        print(f"nrc train: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    problem = check_media_packages("nrc train")
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_CONFIG
    from nemo_rollout_correction.trainer.resume_check import check_config_resumes
    from nemo_rollout_correction.trainer.run_dir import PreviousRunFound, RunDirBusy, claim_run_dir

    rank = int(os.environ.get("RANK", "0"))
    console = Console(secrets=secret_values(to_dict(cfg)), verbose=verbose, is_main=rank == 0)
    lock = None
    try:
        if rank == 0:  # the run directory is this run's (lock; a previous run continued, moved aside or refused)
            lock = claim_run_dir(Path(cfg.run.output_dir), Path(cfg.checkpoint_dir), resume=cfg.run.resume,
                                 overwrite=cfg.run.overwrite, log=console.print)
        # a resume into another model/task/objective refuses before any process group, MLflow run or engine
        check_config_resumes(cfg)
    except (RunDirBusy, PreviousRunFound, ValueError) as exc:
        if lock is not None:
            lock.release()
        print(f"nrc train: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    log_path = Path(cfg.run.output_dir) / ("nrc.log" if rank == 0 else f"nrc.rank{rank}.log")
    if rank == 0:  # other ranks write their log after the start barrier (`_run`): rank 0 holds the directory then
        console.capture_library_output(log_path)
    set_current(console)
    console.print(f"[nrc train] library output (vLLM, Megatron, transformers warnings) goes to {log_path}"
                  + ("" if verbose else "; --verbose shows it here too"))
    try:
        return _run(cfg, console, log_path)
    finally:
        console.close()
        set_current(None)
        if lock is not None:
            lock.release()


def _run(cfg: TrainConfig, console: Console, log_path: Path) -> int:
    from nemo_rollout_correction.cli.failures import explain
    from nemo_rollout_correction.distributed.runtime import barrier, init_runtime, shutdown_runtime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)  # Python warnings -> the log file, with a timestamp and their origin
    try:
        runtime = init_runtime(cfg.policy.tensor_parallel_size, cfg.policy.pipeline_parallel_size,
                               cfg.policy.context_parallel_size)
    except Exception as exc:  # a port in use: one line, and an MLflow run that says so; anything else as it is
        line = explain(exc, cfg)
        if line is None:
            raise
        console.print(f"nrc train: {line}")
        _record_early_failure(cfg, exc, line)
        return EXIT_FAILED
    barrier()  # the start barrier: rank 0 has claimed the run directory (`_run_train`) before any rank goes on
    console.capture_library_output(log_path)  # other ranks' logs (rank 0's is already captured)
    Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
    observer = None
    tracker = None
    if runtime.is_main and cfg.tracking.enabled:
        from nemo_rollout_correction.cli.observer import MlflowObserver
        from nemo_rollout_correction.tracking import TrackingUnavailableError

        tracker = _tracker(cfg, runtime.rank, system_metrics=cfg.tracking.system_metrics)
        try:
            tracker.start()
        except TrackingUnavailableError as exc:
            console.print(f"nrc train: {exc}")
            shutdown_runtime()
            return EXIT_TRACKING
        tracker.log_config(to_dict(cfg))  # before any model work: a run that fails early still shows its config
        observer = MlflowObserver(cfg, tracker)
        console.print(f"[nrc train] MLflow run {tracker.run_id} at {tracker.tracking_uri}")

    from nemo_rollout_correction.trainer import preemption
    from nemo_rollout_correction.trainer.grpo import GrpoTrainer

    trainer = None
    code = 0
    # installed before the (minutes-long) model and engine start-up so a signal then is not lost: the trainer
    # stops before its first step
    stop = preemption.install(console.print)
    try:
        _check_resume_checkpoint(cfg)  # before the minutes-long model and engine start-up
        trainer = GrpoTrainer(cfg, runtime, observer, log=console.print)
        trainer.train()
        if trainer.stopped_by is not None:
            code = preemption.EXIT_PREEMPTED
            console.print(f"[nrc train] stopped by {trainer.stopped_by} after step {trainer.step_index}: checkpoint "
                          f"written to {cfg.checkpoint_dir}, MLflow run KILLED; run.resume=true continues "
                          f"(exit {code})")
    except BaseException as exc:
        code = EXIT_FAILED
        line = explain(exc, cfg)  # an expected failure (cli/failures.py): its one line, not Python's
        console.print(f"nrc train: failed at step {getattr(trainer, 'step_index', 0)}: "
                      + (line or f"{_one_line(exc)} (traceback in {log_path})"))
        traceback.print_exc()  # fd 2: the log file
        if trainer is None and tracker is not None:  # failed before the trainer owned the run: close it here
            from nemo_rollout_correction.cli.observer import record_error

            record_error(tracker, exc, Path(cfg.run.output_dir), line)
            tracker.close("FAILED")
    finally:
        stop.release()
        if trainer is not None:
            trainer.close()
        shutdown_runtime()
    if code == 0 and runtime.is_main and trainer is not None:
        summary = RunSummary.from_history(
            getattr(trainer, "step_history", []), output_dir=cfg.run.output_dir, checkpoint_dir=cfg.checkpoint_dir,
            log_path=str(log_path), mlflow_run_id=None if tracker is None else tracker.run_id,
            tracking_uri=None if tracker is None else tracker.tracking_uri,
            hf_export_dir=None if trainer.hf_export_dir is None else str(trainer.hf_export_dir),
            last_eval=trainer.last_eval)
        for line in summary.lines():
            console.print(line)
        console.print(f"[nrc train] done: {cfg.run.num_steps} steps; outputs in {cfg.run.output_dir}")
    return code


def _tracker(cfg: TrainConfig, rank: int, *, system_metrics: bool) -> MlflowTracker:
    """The run's MLflow tracker (continuing the checkpoint's MLflow run when resuming)."""
    from nemo_rollout_correction.tracking import MlflowTracker

    return MlflowTracker(cfg.tracking.tracking_uri, cfg.tracking.experiment, cfg.run.name, cfg.run.output_dir,
                         rank=rank, resume_run_id=_resume_run_id(cfg), system_metrics=system_metrics)


def _record_early_failure(cfg: TrainConfig, error: BaseException, line: str) -> None:
    """An MLflow run ended FAILED with `line` for a failure before the process group exists (rank 0 only, by
    `RANK`): the run's config and the reason are on record like any other failed run. A tracking store that
    cannot be reached leaves the terminal line as the only record."""
    if int(os.environ.get("RANK", "0")) != 0 or not cfg.tracking.enabled:
        return
    from nemo_rollout_correction.cli.observer import record_error
    from nemo_rollout_correction.tracking import TrackingUnavailableError

    tracker = _tracker(cfg, 0, system_metrics=False)
    try:
        tracker.start()
    except TrackingUnavailableError:
        return
    tracker.log_config(to_dict(cfg))
    record_error(tracker, error, Path(cfg.run.output_dir), line)
    tracker.close("FAILED")


def _check_resume_checkpoint(cfg: TrainConfig) -> None:
    """With `run.resume=true`, pass the newest checkpoint through the door (`trainer.checkpoint_door`: every file
    checked as data) now, so an unsafe or corrupt one fails the run in seconds, naming the file and the previous
    complete checkpoint; the trainer's resume opens it through the same door again when it loads it."""
    from nemo_rollout_correction.trainer import checkpoint as ckpt
    from nemo_rollout_correction.trainer.checkpoint_door import open_checkpoint

    step_dir = ckpt.latest_checkpoint(Path(cfg.checkpoint_dir)) if cfg.run.resume else None
    if step_dir is not None:
        open_checkpoint(step_dir)


def _one_line(exc: BaseException) -> str:
    """`Type: message` on one line (a CheckpointException lists every rank's error over many lines)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:2000]}"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `nrc train`."""
    parser = sub.add_parser("train", help="run GRPO with rollout correction (vLLM rollouts, Megatron-Core policy)",
                            description="Run GRPO. Overrides use Hydra syntax: key=value, group=option, "
                                        "e.g. `nrc train run.num_steps=4 rollout_correction=decoupled_geo_rs`. "
                                        "`nrc config show` prints the resolved configuration.")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    add_config_dir_argument(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="also show library output (vLLM, Megatron, transformers warnings) on the terminal; "
                             "it always goes to <run.output_dir>/nrc.log")
    parser.set_defaults(func=lambda args: run_train(args.overrides, args.config_dir, args.verbose))


__all__ = ["add_parser", "run_train"]

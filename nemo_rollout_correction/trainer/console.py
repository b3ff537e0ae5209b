"""What `nrc train` shows a person: our progress and a closing summary; library output goes to a log file.

vLLM, Megatron-Core, transformers and setuptools write warnings and banners to the process's stdout and
stderr, from this process and from vLLM's engine subprocesses. Python logging cannot catch the latter, so
`Console.capture_library_output` redirects file descriptors 1 and 2 into a pipe: a thread copies every
line, with credentials redacted (config/redaction.py), to `<run.output_dir>/nrc.log` (`nrc.rank<r>.log` on
other ranks) and, with `--verbose`, to the terminal too. Our own lines (start-up steps, the progress bar,
the summary) go straight to the terminal through `Console.print`, redacted the same way.

The progress display is tqdm (a bar with ETA on a terminal; one plain line per step, with the ETA, when
stderr is a file or a CI log, where a redrawn bar would be unreadable).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets as _secrets
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nemo_rollout_correction.config.redaction import redact_text
from nemo_rollout_correction.harness import metric_names as mn

__all__ = ["Console", "RunSummary", "StepProgress", "current", "set_current"]


class Console:
    """The terminal of one `nrc` process: redacted printing, optional capture of library output to a file."""

    def __init__(self, stream: IO[str] | None = None, secrets: Iterable[str] = (), verbose: bool = False,
                 is_main: bool = True) -> None:
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self.secrets = frozenset(secrets)
        self.verbose = verbose
        self.is_main = is_main
        self.log_path: Path | None = None
        self._saved_fds: tuple[int, int] | None = None
        self._copier: threading.Thread | None = None
        self._drained: threading.Event | None = None
        # The line `close` writes into the pipe last: the copier has drained this process's output once it reads it.
        self._marker = f"\0nrc-console-close-{_secrets.token_hex(8)}\n".encode()

    def print(self, message: str) -> None:
        """Write one line of ours to the terminal (main rank only), credentials redacted."""
        if not self.is_main:
            return
        self.stream.write(redact_text(message, self.secrets) + "\n")
        self.stream.flush()

    def capture_library_output(self, log_path: Path) -> None:
        """Send fds 1 and 2 (this process and every child started from now on) to `log_path` via a redacting
        copier thread; the terminal stays reachable through `self.stream`. Undone by `close`."""
        if self._saved_fds is not None:
            return
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        sys.stdout.flush()
        sys.stderr.flush()
        saved_out, saved_err = os.dup(1), os.dup(2)
        self._saved_fds = (saved_out, saved_err)
        # Our lines keep going to the terminal that fd 2 pointed at before the redirect.
        self.stream = os.fdopen(os.dup(saved_err), "w", buffering=1, encoding="utf-8", errors="replace")
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        echo = self.stream if (self.verbose and self.is_main) else None
        self._drained = threading.Event()
        self._copier = threading.Thread(target=_copy_lines,
                                        args=(read_end, log_path, self.secrets, echo, self._marker, self._drained),
                                        name="nrc-log-copier", daemon=True)
        self._copier.start()

    def close(self) -> None:
        """Restore fds 1 and 2 and let the copier drain this process's output into the log file.

        Children that inherited fds 1 and 2 (multiprocessing's resource tracker, a spawned worker) hold the pipe
        open until they exit, which is after this process: the copier never sees EOF here. So the last write into
        the pipe is a marker line, and `close` waits until the copier has read it (everything written before it
        is in the log); the copier keeps copying what children write after it while this process lives."""
        if self._saved_fds is None:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.write(1, self._marker)
        saved_out, saved_err = self._saved_fds
        os.dup2(saved_out, 1)  # closes this process's write ends of the pipe
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        self._saved_fds = None
        if self._copier is not None and self._drained is not None:
            self._drained.wait(timeout=10.0)  # a copier that died (an unwritable log) must not hang the exit
            self._copier = None
            self._drained = None


def _copy_lines(read_end: int, log_path: Path, secrets: frozenset[str], echo: IO[str] | None, marker: bytes,
                drained: threading.Event) -> None:
    with os.fdopen(read_end, "rb") as source, open(log_path, "a", encoding="utf-8") as sink:
        for raw in source:
            if raw.endswith(marker):  # `close`'s last write (after a child's unfinished line, if any)
                drained.set()
                raw = raw[: -len(marker)] + b"\n" if len(raw) > len(marker) else b""
                if not raw:
                    continue
            line = redact_text(raw.decode("utf-8", errors="replace"), secrets)
            sink.write(line)
            sink.flush()
            if echo is not None:
                with contextlib.suppress(Exception):
                    echo.write(line)
                    echo.flush()


_CURRENT: Console | None = None


def current() -> Console:
    """The process's Console (set by `nrc train` / `nrc audit`; a plain stderr one otherwise)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Console()
    return _CURRENT


def set_current(console: Console | None) -> None:
    """Make `console` the process's Console (None: back to a plain stderr one on next use)."""
    global _CURRENT
    _CURRENT = console


class StepProgress:
    """The per-step display: a tqdm bar with ETA on a terminal, a plain line per step otherwise."""

    def __init__(self, total: int, start: int, console: Console, every: int = 1) -> None:
        self.total = total
        self.every = max(every, 1)
        self.console = console
        self.start_step = start
        self.started = time.monotonic()
        self._bar: Any = None
        tty = bool(getattr(console.stream, "isatty", lambda: False)())
        if tty and console.is_main:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, file=console.stream, unit="step", dynamic_ncols=True,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")

    def eta_seconds(self, step: int) -> float:
        """Seconds left at `step`, from the mean time of the steps run in this process (nan before the first)."""
        done = step - self.start_step
        if done <= 0:
            return math.nan
        return (time.monotonic() - self.started) / done * (self.total - step)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Show step `step` (1-based, after it ran) with its headline metrics."""
        text = format_step(metrics)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.every and step != self.total:
            return
        from tqdm import tqdm

        eta = self.eta_seconds(step)
        eta_text = "?" if math.isnan(eta) else tqdm.format_interval(eta)
        self.console.print(f"step {step}/{self.total}  {text}  eta {eta_text}")

    def close(self) -> None:
        """Finish the bar (a no-op for plain lines)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_step(m: Mapping[str, float]) -> str:
    """The headline of one step: reward, loss, mismatch, kept fraction, ESS, length and timings.

    The mismatch is the k3 KL estimate (non-negative per token): the signed k1 `rollout_corr/kl` can print
    as a negative "kl" and read as no mismatch when it averages out.
    """
    def updated(key: str) -> float:  # present on steps with an update (not on a DAPO-skipped step)
        return mn.optional(m, key, math.nan)

    ess = updated(mn.RC_IS_EFF_SAMPLE_SIZE)  # also absent without IS
    return (f"reward {m[mn.REWARD_MEAN]:.3f}  loss {updated(mn.LOSS_POLICY):+.4f}  "
            f"k3 kl {updated(mn.RC_K3_KL):.2e}  kept {updated(mn.RC_KEPT_TOKEN_FRACTION):.3f}  ess {ess:.3f}"
            f"  len {m[mn.RESPONSE_LENGTH_MEAN]:.1f}  gen {m[mn.TIMING_GENERATION]:.1f}s  "
            f"train {m[mn.TIMING_TRAIN]:.1f}s")


@dataclass
class RunSummary:
    """What a finished run prints last: the reward trend, the mismatch, and where everything is."""

    steps: int
    reward_first: float
    reward_last: float
    kl_mean: float
    k3_kl_mean: float
    kept_mean: float
    output_dir: str
    checkpoint_dir: str
    log_path: str | None
    mlflow_run_id: str | None
    tracking_uri: str | None
    hf_export_dir: str | None = None
    """The Hugging Face export of the end of the run (`export.at_end`), if written."""
    last_eval: tuple[int, Mapping[str, float]] | None = None
    """(step, `eval/*` metrics) of the run's last evaluation, if any."""

    @classmethod
    def from_history(cls, history: list[Mapping[str, float]], **where: Any) -> RunSummary:
        """Build the summary from the per-step metrics of this process's steps."""
        def mean(key: str) -> float:
            vals = [float(h[key]) for h in history if key in h and math.isfinite(float(h[key]))]
            return sum(vals) / len(vals) if vals else math.nan

        first = float(history[0][mn.REWARD_MEAN]) if history else math.nan
        last = float(history[-1][mn.REWARD_MEAN]) if history else math.nan
        return cls(steps=len(history), reward_first=first, reward_last=last, kl_mean=mean(mn.RC_KL),
                   k3_kl_mean=mean(mn.RC_K3_KL), kept_mean=mean(mn.RC_KEPT_TOKEN_FRACTION), **where)

    def lines(self) -> list[str]:
        """The summary as printed."""
        out = [
            f"[nrc train] summary ({self.steps} steps run)",
            f"  reward          {self.reward_first:.3f} -> {self.reward_last:.3f}",
            # kl (k1) is signed and can average out; k3 is non-negative, so it shows the size of the mismatch.
            f"  mismatch        mean kl {self.kl_mean:.2e} (k3 {self.k3_kl_mean:.2e}), "
            f"mean kept fraction {self.kept_mean:.3f}",
        ]
        if self.last_eval is not None:
            step, m = self.last_eval
            passes = "".join(f", {k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(m.items())
                             if k.startswith(mn.EVAL_PASS_AT_PREFIX))
            greedy = f", greedy reward {m[mn.EVAL_GREEDY_REWARD_MEAN]:.3f}" if mn.EVAL_GREEDY_REWARD_MEAN in m else ""
            reward = m[mn.EVAL_REWARD_MEAN]
            out.append(f"  last eval       step {step}: reward {reward:.3f}{passes}{greedy}")
        out += [f"  run directory   {self.output_dir}", f"  checkpoints     {self.checkpoint_dir}"]
        if self.hf_export_dir:
            out.append(f"  Hugging Face    {self.hf_export_dir}")
        if self.log_path:
            out.append(f"  library log     {self.log_path}")
        if self.mlflow_run_id and self.tracking_uri:
            out.append(f"  MLflow run      {self.mlflow_run_id} at {self.tracking_uri}")
            if self.tracking_uri.startswith(("http://", "https://")):
                out.append(f"  browse          {self.tracking_uri}")
            else:
                out.append(f"  browse          mlflow ui --backend-store-uri {self.tracking_uri}")
        return out

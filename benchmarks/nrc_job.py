"""One `nrc train` job for the step benchmarks (bench_train.py, bench_async.py, bench_rollout.py).

The benchmarks run the real CLI as a subprocess, so a job pays its own start-up like a user's, and read the
per-step metrics it writes. Imported as a sibling module (`python benchmarks/<bench>.py` puts this directory
on sys.path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_nrc_train(cmd: list[str], out: Path, label: str) -> tuple[list[dict[str, float]], float]:
    """Run `cmd` (an `nrc train` command writing to `out`) outside any inherited torchrun environment; returns its
    `metrics.jsonl` rows and the job's wall seconds. A failing job ends the benchmark with its stderr tail."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    print(f"{label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{label}: nrc train exited {proc.returncode}")
    seconds = time.perf_counter() - start
    print(f"{label}: done in {seconds:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], seconds

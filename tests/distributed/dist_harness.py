"""A small launcher for real multi-process torch.distributed tests on gloo.

`launch(fn, world_size, *args)` starts `world_size` fresh processes (spawn), joins them into a
gloo process group on a free local port, runs `fn(rank, world_size, *args)` in each, and returns
the per-rank results (anything `torch.save` can write). A failing rank fails the launch with its
traceback; a hang fails it after `timeout` seconds (collectives themselves time out after
`collective_timeout`), and every process it started is stopped.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, outdir: str,
           collective_timeout: float, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
           collective_timeout: float = 30.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank.

    `fn` must be importable by name from a module on sys.path (spawned processes re-import it).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="nrc-dist-") as outdir:
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), outdir, collective_timeout, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed workers did not finish within {timeout:.0f} s (hang?)")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        return [torch.load(Path(outdir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]

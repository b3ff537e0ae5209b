"""The stop request of trainer/preemption.py with real signals in a real child process (issue 23, item 1).

The child runs the trainer loop's shape (`agreed()` after each step; no torch.distributed: one process) and exits
with `EXIT_PREEMPTED` after the first signal, writing `$NRC_EXIT_CODE_FILE`; a second signal during its (slow)
"checkpoint" exits at once with 128 + the signal number. The multi-rank agreement is tested on gloo in
tests/distributed/test_preemption_agreement.py; the CLI end to end in tests/integration/test_cluster_grade_cli.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_rollout_correction.trainer import preemption

CHILD = textwrap.dedent("""
    import sys, time
    from nemo_rollout_correction.trainer import preemption

    stop = preemption.install()
    step, stopping = 0, stop.agreed()
    while step < 1000 and not stopping:
        step += 1
        time.sleep(0.1)
        print("step", step, flush=True)
        stopping = stop.agreed()
    print("stopping after", step, stop.signal_name, flush=True)
    time.sleep(float(sys.argv[1]))  # the checkpoint
    stop.release()
    preemption.write_exit_code(preemption.EXIT_PREEMPTED)
    sys.exit(preemption.EXIT_PREEMPTED)
""")


def _child(tmp_path: Path, checkpoint_s: float) -> tuple[subprocess.Popen[str], Path]:
    code_file = tmp_path / "exit_code"
    env = {**os.environ, "NRC_EXIT_CODE_FILE": str(code_file)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(checkpoint_s)], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("step 1")
    return proc, code_file


@pytest.mark.parametrize("sig", preemption.STOP_SIGNALS)
def test_a_stop_signal_ends_the_loop_at_a_step_boundary_with_exit_75(tmp_path: Path, sig: signal.Signals) -> None:
    proc, code_file = _child(tmp_path, 0.0)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == preemption.EXIT_PREEMPTED == 75
    assert "stopping after" in out and sig.name in out
    assert code_file.read_text().strip() == "75"


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc, code_file = _child(tmp_path, 120.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout is not None
    while not (line := proc.stdout.readline()).startswith("stopping after"):
        assert line, "the child ended without stopping"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + signal.SIGTERM
    assert code_file.read_text().strip() == str(128 + signal.SIGTERM)


def test_release_restores_the_previous_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    outer = preemption.install()
    inner = preemption.install()  # the CLI and the trainer share one request
    assert inner is outer and signal.getsignal(signal.SIGTERM) == outer._handle
    inner.release()
    assert signal.getsignal(signal.SIGTERM) == outer._handle
    outer.release()
    assert signal.getsignal(signal.SIGTERM) == before

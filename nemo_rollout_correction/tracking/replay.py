"""Deliver a run's leftover tracking journal later, without the trainer or the `nrc` CLI.

When a run ends while the tracking server is down, `MlflowTracker.close()` leaves
`<run_dir>/tracking/journal.jsonl`. Once a server is reachable again:

    python -m nemo_rollout_correction.tracking.replay <run_dir> --tracking-uri http://host:5000

or `replay_buffer(run_dir, tracking_uri)` from Python. Records go out in their original order with
their original timestamps (so a replay after a partial delivery duplicates nothing); the run ends with
the status the trainer gave it. Needs only `mlflow` and this module's siblings (stdlib otherwise).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from nemo_rollout_correction.tracking.delivery import TrackingUnavailableError, replay_buffer


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m nemo_rollout_correction.tracking.replay RUN_DIR --tracking-uri URI`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's output directory (holds tracking/journal.jsonl)")
    parser.add_argument("--tracking-uri", required=True, help="MLflow tracking URI to deliver to")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to keep retrying an unreachable server")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        result = replay_buffer(args.run_dir, args.tracking_uri, timeout_s=args.timeout)
    except (TrackingUnavailableError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"delivered {result.delivered} records, {result.rejected} refused")
    return 0 if result.rejected == 0 else 2


if __name__ == "__main__":
    sys.exit(main())

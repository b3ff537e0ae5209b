"""`python -m nemo_rollout_correction.cli ...` (what torchrun launches): the same as `nrc ...`."""

import sys

from nemo_rollout_correction.cli import main

if __name__ == "__main__":
    sys.exit(main())

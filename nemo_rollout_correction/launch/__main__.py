"""`python -m nemo_rollout_correction.launch`: see `nemo_rollout_correction.launch.main`."""

import sys

from nemo_rollout_correction.launch.main import main

if __name__ == "__main__":
    sys.exit(main())

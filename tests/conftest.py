"""Shared test configuration.

Hypothesis: the default profile is derandomized so a CI run is reproducible (the same examples
every time; a property failure is a real regression, not a dice roll). Explore new examples
locally with `HYPOTHESIS_PROFILE=explore bash ci/test.sh`.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=500, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

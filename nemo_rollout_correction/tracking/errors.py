"""Errors raised by the tracking layer."""

from __future__ import annotations


class TrackingUnavailableError(RuntimeError):
    """The MLflow tracking store could not be reached when it had to be (at start, or during a replay).

    Raised only where waiting is the wrong answer: `MlflowTracker.start()` (a run must not train for hours
    believing it is tracked when the URI is wrong) and `replay_buffer()`. During training an outage is
    never an error: records are buffered on disk and delivered later.
    """

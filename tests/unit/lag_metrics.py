"""Step metrics with the mismatch by token staleness, as the trainer reports them (`rollout_corr/lag_<L>/*`), for the
mismatch alarm's unit tests."""

from __future__ import annotations


def lagged(lag_k3: dict[int, float], overall: float | None = None, dlogp: float = 0.3) -> dict[str, float]:
    """A step's metrics with the mismatch by token staleness (`rollout_corr/lag_<L>/*`, 100 tokens per lag); the
    whole step's k3 is `overall`, or the largest lag's when None."""
    k3 = overall if overall is not None else max(lag_k3.values())
    out = {"rollout_corr/k3_kl": k3, "rollout_corr/kl": k3, "rollout_corr/token_log_ratio_max": dlogp,
           "rollout_corr/token_log_ratio_min": -dlogp}
    for lag, value in lag_k3.items():
        out[f"rollout_corr/lag_{lag}/k3_kl"] = value
        out[f"rollout_corr/lag_{lag}/num_tokens"] = 100.0
    return out

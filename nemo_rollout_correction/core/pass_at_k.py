"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With `n` samples of a problem of which `c` are correct, the probability that at least one of `k` samples
drawn without replacement is correct is `1 - C(n - c, k) / C(n, k)`. The binomials overflow for
moderate `n`; the ratio equals `prod_{i = n - c + 1}^{n} (1 - k / i)`, summed here in log space
(`log1p`), in float64. When `n - c < k` every draw of `k` holds a correct sample: pass@k = 1.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pass_at_k(num_samples: Tensor, num_correct: Tensor, k: int) -> Tensor:
    """Unbiased pass@k of each problem.

    Args:
        num_samples: `[num_problems]` integer n >= k (samples drawn per problem).
        num_correct: `[num_problems]` integer c in [0, n] (correct samples per problem).
        k: the number of attempts, >= 1.

    Returns:
        `[num_problems]` float64 in [0, 1]: `1 - C(n - c, k) / C(n, k)`.

    Raises:
        ValueError: k < 1, a count outside its range, or shapes that differ.
    """
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    n = num_samples.to(torch.int64)
    c = num_correct.to(torch.int64)
    if n.shape != c.shape:
        raise ValueError(f"num_samples {tuple(n.shape)} and num_correct {tuple(c.shape)} must have the same shape")
    if n.numel() == 0:
        return torch.zeros(n.shape, dtype=torch.float64)
    if bool((n < k).any()):
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem, got n={int(n.min())}")
    if bool((c < 0).any() or (c > n).any()):
        raise ValueError("num_correct must lie in [0, num_samples] for every problem")
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64)  # [max_n]
    # factors (1 - k / i) for i in (n - c, n]; where i <= k they are <= 0, but those problems have n - c < k
    in_range = (i > (n - c).unsqueeze(-1)) & (i <= n.unsqueeze(-1))  # [num_problems, max_n]
    log_factor = torch.log1p(-k / i).nan_to_num(neginf=0.0)  # i == k gives -inf: masked below by `certain`
    log_ratio = torch.where(in_range & (i > k), log_factor, torch.zeros((), dtype=torch.float64)).sum(-1)
    certain = (n - c) < k
    return torch.where(certain, torch.ones_like(log_ratio), -torch.expm1(log_ratio))


def pass_at_k_mean(num_samples: Tensor, num_correct: Tensor, k: int) -> float:
    """Mean unbiased pass@k over problems (NaN for no problems)."""
    if num_samples.numel() == 0:
        return float("nan")
    return float(pass_at_k(num_samples, num_correct, k).mean())


__all__ = ["pass_at_k", "pass_at_k_mean"]

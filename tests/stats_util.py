"""Goodness-of-fit for the sampling tests: ``chi_square_p(counts, probs)``."""
from __future__ import annotations

import torch

__all__ = ["chi_square_p"]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 0.0) -> float:
    """Pearson's chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (cells with
    zero probability must have zero counts and are left out). Cells expecting fewer than
    ``min_expected`` draws are pooled into one, where the chi-square law would not hold for them."""
    assert counts[probs == 0].sum() == 0, "a zero-probability token was drawn"
    n, keep = counts.sum(), probs > 0
    expected, observed = probs[keep].double() * n, counts[keep].double()
    small = expected < min_expected
    if bool(small.any()):
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))

"""Retention, gap recovered (PGR), paired bootstrap CIs, the sign test (definitions: docs/arena.md), and
the score interval of one rate's excess over another (the shadow checks' divergence over their control).

All resampling is paired: one draw of sample indices is applied to every array, so each
resample compares the methods on the same samples. Deterministic for a given seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# PGR is undefined when the oracle beats the floor by no more than this (docs/arena.md).
PGR_MIN_GAP = 1e-3
# Resamples are drawn in blocks of this many, bounding memory at _BLOCK × n indices.
_BLOCK = 500


def retention(method_score: float, full_score: float) -> float | None:
    """method / full-prefill score; None when the full-prefill score is 0."""
    if full_score == 0:
        return None
    return method_score / full_score


def pgr(method: float, floor: float, oracle: float) -> float | None:
    """Gap recovered, (method − floor) / (oracle − floor); None when oracle − floor ≤ 1e-3.

    Not clipped: below the floor is negative, above the oracle is more than 1.
    """
    gap = oracle - floor
    if gap <= PGR_MIN_GAP:
        return None
    return (method - floor) / gap


def _paired(*arrays: Sequence[float]) -> np.ndarray:
    if len({len(array) for array in arrays}) != 1:
        raise ValueError("paired score arrays must all have the same length")
    data = np.asarray(arrays, dtype=np.float64)
    if data.shape[1] == 0:
        raise ValueError("no samples to bootstrap")
    return data


def _resampled_means(data: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Means of each row of `data` (k × n) over `n_resamples` paired resamples: (k, n_resamples)."""
    if n_resamples < 1:
        raise ValueError("n_resamples must be positive")
    rng = np.random.default_rng(seed)
    n = data.shape[1]
    out = np.empty((data.shape[0], n_resamples))
    for start in range(0, n_resamples, _BLOCK):
        count = min(_BLOCK, n_resamples - start)
        idx = rng.integers(0, n, size=(count, n))
        out[:, start : start + count] = data[:, idx].mean(axis=-1)
    return out


def _percentile_ci(values: np.ndarray, alpha: float) -> tuple[float, float]:
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def paired_bootstrap_pgr_ci(
    method_scores: Sequence[float],
    floor_scores: Sequence[float],
    oracle_scores: Sequence[float],
    n_resamples: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    min_defined: float = 0.5,
) -> tuple[float, float] | None:
    """Percentile (1 − alpha) CI of the PGR of the means, over paired resamples of the samples.

    Each resample draws n sample indices with replacement, takes the three means on them and
    computes ``pgr`` of the means. A resample whose oracle − floor gap is ≤ 1e-3 has no PGR and
    is left out; the CI is the percentile interval of the others. The answer is None when the
    PGR of the full-sample means is itself undefined, or when fewer than ``min_defined`` (half,
    by default) of the resamples have a PGR — a CI over a minority of resamples would describe
    a conditional quantity, not the estimate.
    """
    data = _paired(method_scores, floor_scores, oracle_scores)
    method_mean, floor_mean, oracle_mean = data.mean(axis=1)
    if pgr(float(method_mean), float(floor_mean), float(oracle_mean)) is None:
        return None
    method, floor, oracle = _resampled_means(data, n_resamples, seed)
    gap = oracle - floor
    defined = gap > PGR_MIN_GAP
    if defined.mean() < min_defined:
        return None
    return _percentile_ci((method[defined] - floor[defined]) / gap[defined], alpha)


def paired_bootstrap_retention_ci(
    method_scores: Sequence[float],
    full_scores: Sequence[float],
    n_resamples: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float] | None:
    """Percentile (1 − alpha) CI of the retention of the means, mean(method) / mean(full), over paired
    resamples; resamples where full prefill scores 0 have no retention and are left out. None when
    the retention of the full-sample means is undefined or most resamples have none."""
    data = _paired(method_scores, full_scores)
    if retention(*map(float, data.mean(axis=1))) is None:
        return None
    method, full = _resampled_means(data, n_resamples, seed)
    defined = full > 0
    if defined.mean() < 0.5:
        return None
    return _percentile_ci(method[defined] / full[defined], alpha)


def paired_bootstrap_diff_ci(
    a: Sequence[float],
    b: Sequence[float],
    n_resamples: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float]:
    """Percentile (1 − alpha) CI of mean(a − b) over paired resamples of the samples."""
    data = _paired(a, b)
    diffs = (data[0] - data[1])[None, :]
    return _percentile_ci(_resampled_means(diffs, n_resamples, seed)[0], alpha)


def bootstrap_mean_ci(values: Sequence[float], n_resamples: int = 2000, seed: int = 0, alpha: float = 0.05):
    """Percentile (1 − alpha) CI of mean(values) over resamples of the samples."""
    return _percentile_ci(_resampled_means(_paired(values), n_resamples, seed)[0], alpha)


def sign_test(a: Sequence[float], b: Sequence[float], tol: float = 0.0) -> dict:
    """Paired sign test of a against b.

    A sample is a win when a − b > tol, a loss when b − a > tol, else a tie; ties are dropped.
    The p-value is the exact two-sided binomial one under p = ½ on n = wins + losses:
    min(1, 2 · Σ_{k ≤ min(wins, losses)} C(n, k) / 2ⁿ), and 1.0 when n = 0.
    Returns {"wins", "losses", "ties", "n", "p_value"}.
    """
    if len(a) != len(b):
        raise ValueError("paired score arrays must have the same length")
    wins = sum(1 for x, y in zip(a, b, strict=True) if x - y > tol)
    losses = sum(1 for x, y in zip(a, b, strict=True) if y - x > tol)
    ties = len(a) - wins - losses
    n = wins + losses
    if n == 0:
        p_value = 1.0
    else:
        tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1))
        p_value = min(1.0, 2 * tail / 2**n)  # exact integers, one correctly rounded division
    return {"wins": wins, "losses": losses, "ties": ties, "n": n, "p_value": p_value}


# == one rate's excess over another's: the shadow checks' divergence over their control group =====


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion (sensible at 0 and n successes)."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Excess:
    """A kind's divergence rate minus the control group's, with Newcombe's 95% interval (the hybrid
    score interval for a difference of two independent proportions: Wilson's on each, combined)."""

    rate: float
    control_rate: float
    excess: float
    low: float
    high: float

    @classmethod
    def of(cls, diverged: int, checks: int, control_diverged: int, control_checks: int) -> Excess | None:
        """None where either side has no checks."""
        if checks <= 0 or control_checks <= 0:
            return None
        p1, p2 = diverged / checks, control_diverged / control_checks
        l1, u1 = wilson(diverged, checks)
        l2, u2 = wilson(control_diverged, control_checks)
        d = p1 - p2
        return cls(
            p1, p2, d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
        )

"""The statistics the pipeline's decisions rest on, in one place: Student t intervals over seeds, paired
differences with their noise pooled over several comparisons, and the rule every verdict follows (an interval
that excludes the line decides; one that straddles it does not). The screen's keep/drop
(screen/score.py) and compare.py's better/worse both use them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ABOVE, BELOW, WITHIN = "above", "below", "within"


def t_quantile(p: float, df: float) -> float:
    """Student t's p-quantile with `df` degrees of freedom (inf without any)."""
    from scipy import stats

    return float(stats.t.ppf(p, df)) if df > 0 else math.inf


def pooled_spread(groups: list) -> tuple[float, int]:
    """(sum of squares, degrees of freedom) of the values around each group's own mean, pooled over the groups
    (a group of one value adds nothing): one noise estimate from several groups whose means differ."""
    ss, df = 0.0, 0
    for values in groups:
        v = np.asarray(values, dtype=np.float64)
        if len(v) >= 2:
            ss += float(((v - v.mean()) ** 2).sum())
            df += len(v) - 1
    return ss, df


def half_width(ss: float, df: int, n: int, tail: float) -> float:
    """The half-width of the t interval of a mean of n values whose spread is pooled_spread's (ss, df), with
    `tail` in each tail (a two-sided (1 - alpha) interval: tail = alpha / 2); inf without degrees of freedom."""
    if df < 1:
        return math.inf
    return t_quantile(1 - tail, df) * math.sqrt(ss / df) / math.sqrt(n)


def mean_interval(values: list[float], alpha: float) -> float:
    """The half-width of the mean's two-sided (1 - alpha) Student t interval (nan under two values)."""
    if len(values) < 2:
        return float("nan")
    return half_width(*pooled_spread([values]), len(values), alpha / 2)


def side(low: float, high: float, line: float = 0.0) -> str:
    """Where an interval lies against a line: ABOVE or BELOW when it excludes it, else WITHIN."""
    return ABOVE if low > line else BELOW if high < line else WITHIN


def paired_noise(base: list[float], others: list[list[float]]) -> tuple[float, int]:
    """The spread of the per-seed differences from the base, pooled over the comparisons that ran the base's seeds
    (each around its own mean difference, so their effects do not count): (sum of squares, degrees of freedom).
    A comparison whose runs are the base's, bit for bit (a difference of 0 on every seed), tells nothing of the
    noise and is left out."""
    diffs = [np.subtract(values, base) for values in others]
    return pooled_spread([d for d in diffs if np.any(d != 0)])


@dataclass
class Difference:
    delta: float  # the other's mean minus the base's
    half: float  # the half-width of its interval (nan: no interval)
    side: str  # ABOVE or BELOW 0 (the interval excludes it), WITHIN, or why there is no verdict (NO_INTERVAL, ...)


NO_INTERVAL = "no interval (1 seed)"
# Seeds that differ by exactly the same amount, every one: a spread of 0 would make a zero-width interval, and any
# difference at all a verdict. No noise estimate is not no noise.
ZERO_SPREAD = "no verdict (zero spread)"


def failed_seed(values: list[float], seeds: list[int]) -> int | None:
    """The first seed whose value is NaN or infinite (a diverged or broken run), or None. Such a value would make
    every spread it enters NaN, and every interval with it say nothing: a row with one gets no verdict."""
    return next((seed for seed, v in zip(seeds, values) if not math.isfinite(v)), None)


def difference(base: list[float], other: list[float], alpha: float, noise: tuple[float, int] | None = None) -> Difference:
    """The other's difference from the base over seeds, with its two-sided (1 - alpha) interval. With `noise`
    (paired_noise: the other ran the base's seeds), Student t over the per-seed differences with that pooled
    spread; without, Welch's t over the two groups of seeds."""
    delta = float(np.mean(other) - np.mean(base))
    if noise is not None:
        diffs = np.subtract(other, base)
        if len(diffs) and not np.any(diffs != 0):
            return Difference(0.0, 0.0, WITHIN)  # the same runs
        ss, df = noise
        if df < 1:
            return Difference(delta, float("nan"), NO_INTERVAL)
        if ss == 0:
            return Difference(delta, float("nan"), ZERO_SPREAD)
        half = half_width(ss, df, len(diffs), alpha / 2)
    else:
        if min(len(base), len(other)) < 2:
            return Difference(delta, float("nan"), NO_INTERVAL)
        va, vb = np.var(other, ddof=1) / len(other), np.var(base, ddof=1) / len(base)
        se = float(np.sqrt(va + vb))
        if se == 0:
            return Difference(delta, float("nan"), ZERO_SPREAD)
        df = (va + vb) ** 2 / (va ** 2 / (len(other) - 1) + vb ** 2 / (len(base) - 1))
        half = t_quantile(1 - alpha / 2, df) * se
    return Difference(delta, half, side(delta - half, delta + half))

"""The statistics the pipeline's decisions rest on, in one place: Student t intervals over seeds, a spread pooled
over groups (the screen's), the difference of two groups of seeds (compare.py's), and the rule every verdict follows (an interval
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


@dataclass
class Difference:
    delta: float  # the other's mean minus the base's
    half: float  # the half-width of its interval (nan: no interval)
    side: str  # ABOVE or BELOW 0 (the interval excludes it), WITHIN, or why there is no verdict (not enough seeds, ...)


# A verdict needs this many seeds on each side (paired: this many shared seeds). With two, the interval's t-quantile
# has one degree of freedom: at the table's family-wise level (0.05 over 26 comparisons) it is about 330, and an
# interval of +-100 bits per byte says nothing that "not enough seeds" does not say more plainly.
MIN_SEEDS = 3
# Seeds that differ by exactly the same amount, every one: a spread of 0 would make a zero-width interval, and any
# difference at all a verdict. No noise estimate is not no noise.
ZERO_SPREAD = "no verdict (zero spread)"


def not_enough_seeds(n: int) -> str:
    return f"not enough seeds ({n}; {MIN_SEEDS} decide)"


def failed_seed(values: list[float], seeds: list[int]) -> int | None:
    """The first seed whose value is NaN or infinite (a diverged or broken run), or None. Such a value would make
    every spread it enters NaN, and every interval with it say nothing: a row with one gets no verdict."""
    return next((seed for seed, v in zip(seeds, values) if not math.isfinite(v)), None)


def difference(base: list[float], other: list[float], alpha: float, paired: bool) -> Difference:
    """The other's difference from the base over seeds, with its two-sided (1 - alpha) interval.

    Paired (the two ran the same seeds, in the same order): Student t over the per-seed differences, with their
    own spread and n - 1 degrees of freedom. Nothing is pooled with other comparisons: an ablation noisier than
    the rest (a shorter run, a smaller subset) is judged by its own noise, and two ablations that share the base's
    deviations do not count as independent evidence of the noise (both made a pooled rule's verdicts wrong up to
    8 times more often than stated: docs/benchmarks.md). Unpaired: Welch's t over the two groups of seeds. Under
    MIN_SEEDS on either side: no verdict."""
    delta = float(np.mean(other) - np.mean(base))
    if paired:
        diffs = np.subtract(other, base)
        if len(diffs) and not np.any(diffs != 0):
            return Difference(0.0, 0.0, WITHIN)  # the same runs, bit for bit
        if len(diffs) < MIN_SEEDS:
            return Difference(delta, float("nan"), not_enough_seeds(len(diffs)))
        ss, df = pooled_spread([diffs])  # the differences' own spread: n - 1 degrees of freedom
        if ss == 0:
            return Difference(delta, float("nan"), ZERO_SPREAD)
        half = half_width(ss, df, len(diffs), alpha / 2)
    else:
        if min(len(base), len(other)) < MIN_SEEDS:
            return Difference(delta, float("nan"), not_enough_seeds(min(len(base), len(other))))
        va, vb = np.var(other, ddof=1) / len(other), np.var(base, ddof=1) / len(base)
        se = float(np.sqrt(va + vb))
        if se == 0:
            return Difference(delta, float("nan"), ZERO_SPREAD)
        df = (va + vb) ** 2 / (va ** 2 / (len(other) - 1) + vb ** 2 / (len(base) - 1))
        half = t_quantile(1 - alpha / 2, df) * se
    return Difference(delta, half, side(delta - half, delta + half))

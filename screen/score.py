"""How spiky a proxy run's gradient norms are, and the rule that drops a subset.

OPT dropped the Pile subsets that "increased the risk of instabilities, as measured by tendency
to cause spikes in gradient norms" but did not say how it measured that. Ours, stated exactly:

- The first `burn_in` steps are not scored: every run's grad norm falls steeply from its start.
- A step's excess is how far its grad norm is above the median of the `window` steps centred on
  it (fewer at the ends of the run), relative to that median: max(0, g / median - 1). The median follows the run's trend and is not
  moved by a spike, so a smooth curve scores ~0 whatever its level or slope, and a step that
  jumps 40% above its neighbours scores 0.4. A spike is a step with excess > `spike_ratio`.
- growth = the relative change of the grad norm over the scored steps, from a least-squares fit
  of log(grad norm) against the step: a run whose gradients keep growing is unstable even
  without single spikes (early in training they fall, so this is usually 0).
- score = 100 * mean excess per scored step + 100 * max(0, growth): percent.

The rule: a subset is dropped when the mean of its scores over the seeds exceeds the mean of the
baseline mix's scores over the same seeds by more than `margin`, and by more than `sigmas`
standard deviations of the baseline's scores (each proxy run uses the same seeds, data order
and hyperparameters, so the comparison is paired).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SpikeScore:
    score: float
    spikes: int  # steps more than spike_ratio above their neighbourhood's median
    excess: float  # the sum of every scored step's relative excess over its neighbourhood's median
    growth: float  # relative change of the grad norm over the scored steps (fit)
    scored_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def read_grad_norms(metrics_file: Path) -> list[float | None]:
    """A run's grad-norm series from its metrics.jsonl, one value per step in step order (a step redone
    after a rollback or restart: its last value). Steps the fp16 loss scaler skipped for an overflow
    are left out: their gradients overflowed in the scaled fp16 copy, which says how high the loss
    scale was, not how the run behaves (DeepSpeed reports their norm as inf; one would make a
    candidate's score infinite, or a baseline seed's, and with it the limit)."""
    by_step: dict[int, float | None] = {}
    for line in Path(metrics_file).read_text().splitlines():
        row = json.loads(line)
        if "grad_norm" in row:
            if row.get("overflow"):
                by_step.pop(row["step"], None)
            else:
                by_step[row["step"]] = row["grad_norm"]
    return [by_step[s] for s in sorted(by_step)]


def spike_score(grad_norms: list[float | None], *, window: int = 9, spike_ratio: float = 0.25,
                burn_in: int = 10) -> SpikeScore:
    """The score of one run's grad-norm series (one value per step, in step order)."""
    g = np.asarray([math.nan if v is None else v for v in grad_norms], dtype=np.float64)
    scored = g[burn_in:]
    if not np.all(np.isfinite(scored)):  # a non-finite grad norm: as unstable as a run gets
        return SpikeScore(math.inf, int(np.sum(~np.isfinite(scored))), math.inf, math.inf, len(scored))
    half = window // 2
    last = len(scored) - 1
    # Centered windows, narrower at the ends (the first and last steps are their own reference).
    excess = np.array([max(0.0, v / np.median(scored[t - h: t + h + 1]) - 1.0)
                       for t, v in enumerate(scored) for h in [min(half, t, last - t)]])
    growth = 0.0
    if len(scored) >= 2:
        slope = np.polyfit(np.arange(len(scored), dtype=np.float64), np.log(np.maximum(scored, 1e-12)), 1)[0]
        growth = float(math.expm1(slope * (len(scored) - 1)))
    n = max(1, len(scored))
    score = 100.0 * float(excess.sum()) / n + 100.0 * max(0.0, growth)
    return SpikeScore(score, int(np.sum(excess > spike_ratio)), float(excess.sum()), growth, len(scored))


@dataclass(frozen=True)
class Verdict:
    subset: str
    score: float  # mean over seeds
    baseline: float  # the baseline's mean over the same seeds
    limit: float  # the score above which a subset is dropped
    dropped: bool

    @property
    def reason(self) -> str:
        return (f"screened out: spike score {self.score:.2f} > limit {self.limit:.2f} "
                f"(baseline {self.baseline:.2f})")


def limit(baseline_scores: list[float], margin: float, sigmas: float) -> float:
    """The baseline's mean plus the larger of `margin` and `sigmas` of its standard deviations over seeds."""
    base = np.asarray(baseline_scores, dtype=np.float64)
    spread = float(base.std(ddof=1)) if len(base) > 1 else 0.0
    return float(base.mean()) + max(margin, sigmas * spread)


def judge(scores: dict[str, list[float]], baseline_scores: list[float], margin: float, sigmas: float) -> list[Verdict]:
    """One verdict per subset (in the order given)."""
    line = limit(baseline_scores, margin, sigmas)
    base = float(np.mean(baseline_scores))
    out = []
    for subset, values in scores.items():
        mean = float(np.mean(values))
        out.append(Verdict(subset, mean, base, line, bool(mean > line)))
    return out


RULE = ("dropped when the mean spike score over seeds exceeds the baseline mix's mean by more than "
        "max(margin, sigmas x the baseline's standard deviation over seeds)")

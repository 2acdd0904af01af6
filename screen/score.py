"""How spiky a run's gradient norms are, and the rule that drops a subset from the corpus.

OPT dropped the Pile subsets that "increased the risk of instabilities, as measured by tendency
to cause spikes in gradient norms" but did not say how it measured that. Ours, stated exactly.

The screen's score (`roughness`): how far a proxy run's grad norm jumps from step to step beyond
what its trend and its batches' composition explain.
- The first `burn_in` steps are not scored: every run's grad norm falls steeply from its start.
- ln(grad norm) is fitted by least squares with a quadratic in the step (the run's trend) and, for
  a candidate's mixture, the share of the batch's tokens that came from the candidate subset. A
  subset whose text is merely different (DM Mathematics' sums) moves the grad norm with how much
  of it a batch holds; that is composition, not instability, and the fit takes it out (on the
  power benchmark, 12 draws, it took a clean DM Mathematics from 3.57x the baseline's roughness
  to 1.11x).
  A subset with documents that make training jump is rough whatever its share.
- score = 100 x the mean absolute residual: the typical jump in percent.

The decision (`decide`, `adaptive`): each subset against the baseline mix under the same seed
(same initialisation and batch order), as the paired effect ln(subset's score / baseline's score).
Per seed these effects have about the same noise for every subset (the benchmark: sd 0.25 for
clean subsets, a pooled within-subset sd of 0.27 for clean and planted alike), so the noise is
pooled over the screen's subsets (a one-way layout's error term, sum of (n_s - 1) degrees of
freedom), and each subset's mean effect gets a Student-t interval. With line = ln(ratio):
- drop when the lower bound is above the line, keep when the upper bound is below it, else
  inconclusive;
- the subsets are first judged after `seeds` seeds, and the inconclusive ones get more seeds (and
  the baseline with them: one each per round, or as many as fill the round's parallel slots)
  until decided or at `max_seeds`. A subset once decided stays so.
- Each look uses alpha / looks (Bonferroni over the max_seeds - seeds + 1 looks), so that a
  subset whose true effect is on the line is wrongly decided with probability at most alpha over
  the whole sequence, however many looks it takes.

A run's grad norms come from train/spikes.py's `read_run`, which also holds `spike_score`, the older,
unadjusted measure (steps far above their neighbourhood's median) that the training stage and
`pipelines/compare.py` report for a whole training run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from core import stats

BASELINE = "baseline"  # the baseline mix's name (a subset may not be called this)


@dataclass(frozen=True)
class Roughness:
    score: float  # 100 x mean |residual of ln(grad norm)|: the typical unexplained jump, in percent
    composition: float  # the fit's change of ln(grad norm) from a batch with none of the subset to one all of it
    spikes: int  # scored steps more than spike_ratio above the fit
    scored_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def roughness(batches, grad_norms, shares=None, *, burn_in: int = 10, spike_ratio: float = 0.25) -> Roughness:
    """The screen's score of one run: `batches` the global batch of each step, `shares` the fraction of each
    step's batch tokens from the candidate subset (None or constant: the baseline mix, no composition term)."""
    x = np.asarray(batches, dtype=np.float64)
    g = np.asarray(grad_norms, dtype=np.float64)
    s = np.zeros_like(g) if shares is None else np.asarray(shares, dtype=np.float64)
    scored = x >= burn_in
    x, g, s = x[scored], g[scored], s[scored]
    if len(g) < 4:
        raise ValueError(f"{len(g)} scored steps: too few to fit a trend (steps must exceed burn_in + 3)")
    if not np.all(np.isfinite(g)) or np.any(g <= 0):  # a non-finite grad norm: as unstable as a run gets
        return Roughness(math.inf, 0.0, int(np.sum(~np.isfinite(g))), len(g))
    t = 2 * (x - x.min()) / max(1.0, x.max() - x.min()) - 1  # the step on [-1, 1]
    columns = [np.ones_like(t), t, t * t]
    with_share = bool(np.ptp(s) > 0)
    if with_share:
        columns.append(s)
    design, y = np.stack(columns, axis=1), np.log(g)
    fit, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ fit
    return Roughness(100.0 * float(np.abs(residual).mean()), float(fit[3]) if with_share else 0.0,
                     int(np.sum(residual > math.log1p(spike_ratio))), len(g))


DROP, KEEP, INCONCLUSIVE = "drop", "keep", "inconclusive"


@dataclass(frozen=True)
class Decision:
    subset: str
    outcome: str  # DROP, KEEP or INCONCLUSIVE
    seeds: int  # the seeds it was judged on
    effect: float  # mean over those seeds of ln(its score / the baseline's score under the same seed)
    low: float  # the one-sided lower bound of the effect (1 - alpha / looks) ...
    high: float  # ... and the upper one
    line: float  # ln(ratio)
    noise: float  # the pooled standard deviation of one seed's effect
    df: int  # its degrees of freedom

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def reason(self) -> str:
        what = {DROP: "screened out", KEEP: "kept", INCONCLUSIVE: "inconclusive"}[self.outcome]
        return (f"{what}: roughness {math.exp(self.effect):.2f}x the baseline mix's over {self.seeds} seeds "
                f"(bounds {math.exp(self.low):.2f}x-{math.exp(self.high):.2f}x, line {math.exp(self.line):.2f}x)")


def effects(scores: dict[str, dict[int, float]], baseline: dict[int, float]) -> dict[str, list[float]]:
    """{subset: [ln(its score / the baseline's score) for each seed both have, in seed order]}."""
    if any(not math.isfinite(v) for v in baseline.values()):
        raise ValueError("the baseline mix's own proxy run diverged (a non-finite grad norm): the proxy is "
                         "unstable on any data; lower screen.proxy.lr or raise warmup_steps")
    floor = 1e-9
    return {subset: [math.log(max(values[k], floor) / max(baseline[k], floor)) for k in sorted(values) if k in baseline]
            for subset, values in scores.items()}


def decide(effects_by_subset: dict[str, list[float]], *, ratio: float, alpha: float, looks: int = 1) -> dict[str, Decision]:
    """The outcome of every subset now, from its paired effects (a non-finite effect: dropped outright): the
    one-sided bounds at alpha / looks with the noise pooled over every subset (core/stats.py) against ln(ratio)."""
    line = math.log(ratio)
    finite = [v for v in effects_by_subset.values() if np.all(np.isfinite(v))]
    ss, df = stats.pooled_spread(finite)
    noise = math.sqrt(ss / df) if df > 0 else math.inf
    out = {}
    for subset, values in effects_by_subset.items():
        v = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(v)):
            out[subset] = Decision(subset, DROP, len(v), math.inf, math.inf, math.inf, line, noise, df)
            continue
        mean = float(v.mean())
        half = stats.half_width(ss, df, len(v), alpha / looks)
        outcome = {stats.ABOVE: DROP, stats.BELOW: KEEP, stats.WITHIN: INCONCLUSIVE}[stats.side(mean - half, mean + half, line)]
        out[subset] = Decision(subset, outcome, len(v), mean, mean - half, mean + half, line, noise, df)
    return out


def adaptive(subsets: list[str], run, *, seeds: int, max_seeds: int, ratio: float, alpha: float,
             first_seed: int = 0, slots: int = 1) -> tuple[dict[str, Decision], list[list[tuple[str, int]]]]:
    """The screen's sequence of rounds: `run([(mixture, seed), ...])` runs those proxies and returns
    {(mixture, seed): score}; the baseline's mixture is called BASELINE. Round one runs `seeds` seeds
    of the baseline and of every subset; each later round more seeds of the baseline and of every
    subset still inconclusive, until none is or all have max_seeds: one seed each, or as many as fill
    `slots` proxy runs that run side by side (those cost no more time than one, where another round
    costs a run's time again; the looks stay bounded by max_seeds - seeds + 1).
    (decisions, the rounds' runs)."""
    looks = max_seeds - seeds + 1
    scores: dict[str, dict[int, float]] = {name: {} for name in [BASELINE, *subsets]}
    final: dict[str, Decision] = {}
    rounds: list[list[tuple[str, int]]] = []
    wanted = {name: range(first_seed, first_seed + seeds) for name in [BASELINE, *subsets]}
    while True:
        todo = [(name, k) for name, ks in wanted.items() for k in ks if k not in scores[name]]
        rounds.append(todo)
        for (name, k), value in run(todo).items():
            scores[name][k] = value
        found = decide(effects({s: scores[s] for s in subsets}, scores[BASELINE]), ratio=ratio, alpha=alpha, looks=looks)
        open_ = []
        for subset in subsets:
            if subset in final:
                continue
            if found[subset].outcome != INCONCLUSIVE or found[subset].seeds >= max_seeds:
                final[subset] = found[subset]
            else:
                open_.append(subset)
        if not open_:
            return {s: final[s] for s in subsets}, rounds
        done = found[open_[0]].seeds  # every open subset has run as many seeds as the others
        more = max(1, min(slots // (len(open_) + 1), max_seeds - done))
        wanted = {name: range(first_seed + done, first_seed + done + more) for name in [BASELINE, *open_]}

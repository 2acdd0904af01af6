"""A training run's gradient norms, read from its metrics.jsonl, and how spiky they are (`spike_score`): what the
training stage and `pipelines/compare.py` report for a whole run, and what the screen's score (screen/score.py)
reads its proxy runs with. Here, below both the training stage and the screen, so that neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from train import records


@dataclass(frozen=True)
class SpikeScore:
    score: float
    spikes: int  # steps more than spike_ratio above their neighbourhood's median
    excess: float  # the sum of every scored step's relative excess over its neighbourhood's median
    growth: float  # relative change of the grad norm over the scored steps (fit)
    scored_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def read_run(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(global batch numbers, grad norms) of the steps of the run in `folder`, in step order (a step
    redone after a rollback or restart: its last value; a missing norm: NaN). Steps the fp16 loss scaler
    skipped for an overflow are left out: their gradients overflowed in the scaled fp16 copy, which says
    how high the loss scale was, not how the run behaves (DeepSpeed reports their norm as inf; one would
    make a candidate's score infinite, or a baseline seed's)."""
    if not (Path(folder) / records.METRICS).exists():
        raise FileNotFoundError(f"{Path(folder) / records.METRICS}: the run in {folder} recorded no step")
    by_step: dict[int, tuple[int, float]] = {}
    for row in records.read(folder, records.STEP):
        if row.get("overflow"):
            by_step.pop(row["step"], None)
        else:
            by_step[row["step"]] = (row.get("batch", row["step"] - 1), row["grad_norm"])
    rows = [by_step[s] for s in sorted(by_step)]
    batches = np.asarray([b for b, _ in rows], dtype=np.int64)
    return batches, np.asarray([math.nan if g is None else g for _, g in rows], dtype=np.float64)


def read_grad_norms(folder: Path) -> list[float | None]:
    """read_run's grad norms alone, as a list (None where a step had none), for `spike_score`."""
    return [None if math.isnan(g) else float(g) for g in read_run(folder)[1]]


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

"""OPT's LR schedule: a linear warm-up, then a linear decay to `final_ratio` of its peak at `total_steps`, held
there (opt-facts.md).

A pure function of the step, so a restart needs no scheduler state; `factor` is where the stability autopilot's
"lower the LR" goes (a multiplier on the whole schedule from then on). Apart from the optimizer (train/optim.py),
so free of torch: the pipeline's driver imports every stage's loop config, this schedule with it, and imports
no torch until a stage trains (1 s of a corpus-only run's start).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Schedule:
    peak: float
    warmup_steps: int
    total_steps: int
    final_ratio: float = 0.1
    factor: float = 1.0
    rewarm_from: int | None = None  # after the autopilot resets Adam: warm up again from this step
    rewarm_steps: int = 0

    def lr(self, step: int) -> float:
        """The LR for optimizer step `step` (1-based: step 1 is the first update)."""
        if step <= self.warmup_steps:
            base = self.peak * step / max(1, self.warmup_steps)
        else:
            done = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            base = self.peak * (1.0 - (1.0 - self.final_ratio) * done)
        if self.rewarm_from is not None and step > self.rewarm_from:
            base *= min(1.0, (step - self.rewarm_from) / max(1, self.rewarm_steps))
        return base * self.factor

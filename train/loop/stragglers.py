"""Which rank is slow: in synchronous training one slow GPU sets the pace of all, and the step time alone
cannot say which (every rank waits the same in the gradient all-reduce).

Each rank times its own compute, apart from its waits in collectives: the forward passes of its
micro-batches, which hold no collective on the data-parallel path (ZeRO 0-2; the all-reduce and the
optimizer come after). On a GPU the time comes from CUDA events, read once the step has synchronized. On
a pipeline, the schedule interleaves compute with the stages' sends and receives inside DeepSpeed, so
there the whole step is timed and a slow stage cannot be told from the ones that wait for it.

Every `window` steps the ranks all-gather their mean, and rank 0 compares each with the median of the
others'. A rank over it by `margin` in `patience` windows in a row is named, once per attempt: an
incident, a logbook entry with its node, and `stragglers.jsonl` (the stage tags the MLflow run with it).
"""

from __future__ import annotations

import json
import statistics
import time

from train.autopilot_policy import Logbook
from train.loop.context import Context, incident
from train.parallel.collectives import all_gather_float


class Stragglers:
    def __init__(self, ctx: Context, window: int, margin: float, patience: int):
        self.ctx, self.window, self.margin, self.patience = ctx, window, margin, patience
        self.total, self.count = 0.0, 0
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()

    def observe(self, step: int, compute_seconds: float) -> list[int]:
        """This rank's compute in step `step`; at the end of a window (a collective: every rank calls this at
        every step), the ranks named now."""
        if not self.window:
            return []
        self.total, self.count = self.total + compute_seconds, self.count + 1
        if step % self.window:
            return []
        means = all_gather_float(self.total / max(1, self.count))
        self.total, self.count = 0.0, 0
        slow = self.slower(means)
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        named = [r for r in slow if self.streak[r] >= self.patience and r not in self.named]
        self.named.update(named)
        if self.ctx.leader:
            for rank in named:
                self._name(step, rank, means)
        return named

    def slower(self, means: list[float]) -> list[int]:
        """The ranks slower than the median of the others by more than the margin."""
        if len(means) < 2:
            return []
        return [r for r, t in enumerate(means)
                if t > (1 + self.margin) * statistics.median(means[:r] + means[r + 1:])]

    def _name(self, step: int, rank: int, means: list[float]) -> None:
        others = statistics.median(means[:rank] + means[rank + 1:])
        where = self._node_of(rank)
        what = (f"straggler: rank {rank} on {where['host']} (node {where['node']}) computes {means[rank] * 1e3:.0f} ms "
                f"a step against {others * 1e3:.0f} ms on the others' median, {self.patience} windows of "
                f"{self.window} steps in a row")
        incident(self.ctx, step, what)
        record = {"time": time.time(), "step": step, "rank": rank, **where, "seconds": means[rank],
                  "others_seconds": others}
        with open(self.ctx.run_dir / "stragglers.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        Logbook(self.ctx.run_dir).append({"time": record["time"], "step": step, "kind": "straggler", "detail": what,
                                          "actions": ["named"], "why": "one slow rank sets the pace of all"})

    def _node_of(self, rank: int) -> dict:
        path = self.ctx.run_dir / "ranks" / f"rank-{rank}.json"
        return json.loads(path.read_text()) if path.exists() else {"node": None, "host": None}

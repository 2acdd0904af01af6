"""Which rank is slow: in synchronous training one slow GPU sets the pace of all, and the step time alone
cannot say which (every rank waits the same in the gradient all-reduce).

Each rank times its own compute, apart from its waits in collectives: the forward passes of its
micro-batches, which hold no collective on the data-parallel path (ZeRO 0-2; the all-reduce and the
optimizer come after). On a GPU the time comes from CUDA events, read once the step has synchronized. On
a pipeline, the schedule interleaves compute with the stages' sends and receives inside DeepSpeed, so
there the whole step is timed and a slow stage cannot be told from the ones that wait for it.

Every `window` steps the ranks all-gather their median step, and rank 0 compares each with the median of
the others'. A median, not a mean: a straggler is slow at most of its steps, while one stalled step (a
fresh process's warm-up, a host's hiccup) is not a slow GPU; on short steps one such stall moved a window's
mean enough to hide a rank four times slower. A rank over the others by `margin` in `patience` windows in
a row is named, once per attempt: an incident, a logbook entry with its node, and `stragglers.jsonl` (the
stage tags the MLflow run with it).
With `train.stragglers.exclude`, its node is drained at the next checkpoint, once that is published, and every
rank ends the attempt (`PlannedRestart`): Ray Train starts the group again on the other nodes and the ones the
autoscaler brings, and the run resumes from that checkpoint, exactly (`replace`; a row with `drained` in
stragglers.jsonl, the logbook, and goodput's `planned_restart`).
"""

from __future__ import annotations

import json
import statistics
import time

from train import records
from train.config import StragglerConfig
from train.loop.context import Context, incident
from train.parallel.collectives import all_gather_float, all_ok


class Stragglers:
    def __init__(self, ctx: Context, settings: StragglerConfig):
        self.ctx, self.window, self.margin, self.patience = ctx, settings.window, settings.margin, settings.patience
        self.seconds: list[float] = []  # this rank's compute at each step of the window so far
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()

    def observe(self, step: int, compute_seconds: float) -> list[int]:
        """This rank's compute in step `step`; at the end of a window (a collective: every rank calls this at
        every step), the ranks named now."""
        if not self.window:
            return []
        self.seconds.append(compute_seconds)
        if step % self.window:
            return []
        medians = all_gather_float(statistics.median(self.seconds))
        self.seconds = []
        slow = self.slower(medians)
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        named = [r for r in slow if self.streak[r] >= self.patience and r not in self.named]
        self.named.update(named)
        if self.ctx.leader:
            for rank in named:
                self._name(step, rank, medians)
        return named

    def slower(self, medians: list[float]) -> list[int]:
        """The ranks slower than the median of the others by more than the margin."""
        if len(medians) < 2:
            return []
        return [r for r, t in enumerate(medians)
                if t > (1 + self.margin) * statistics.median(medians[:r] + medians[r + 1:])]

    def _name(self, step: int, rank: int, medians: list[float]) -> None:
        others = statistics.median(medians[:rank] + medians[rank + 1:])
        where = self._node_of(rank)
        what = (f"straggler: rank {rank} on {where['host']} (node {where['node']}) computes {medians[rank] * 1e3:.0f} ms "
                f"a step against {others * 1e3:.0f} ms on the others' median, {self.patience} windows of "
                f"{self.window} steps in a row")
        incident(self.ctx, step, what)
        record = {"time": time.time(), "step": step, "rank": rank, **where, "seconds": medians[rank],
                  "others_seconds": others}
        records.append(self.ctx.run_dir, records.STRAGGLER, record)
        records.log_entry(self.ctx.run_dir, time=record["time"], step=step, kind="straggler", detail=what,
                          actions=["named"], why="one slow rank sets the pace of all")

    def replace(self, step: int, ranks: set[int], limits, worker: tuple[float, float]) -> str | None:
        """At a published checkpoint, with `train.stragglers.exclude`: the named ranks' nodes drained, within the
        run's limit on drains (`limits`, the HealthConfig: max_excluded_fraction of the nodes training can use
        within window_seconds, health checks' drains included); past it, a drain refused and written down. On
        every rank: why the attempt ends here (a planned restart from this checkpoint), or None to train on."""
        from train import goodput, health

        why = None
        if self.ctx.leader:
            nodes = {self._node_of(r)["node"]: r for r in sorted(ranks)}
            population = len(health.trainable_nodes(*worker))
            for node, rank in nodes.items():
                limit = health.drain_limit(self.ctx.run_dir, population, limits)
                refused = ("its node is not known" if not node else None if not limit.refuses(1) else
                           f"the run has drained {limit.done} of the {limit.allowed} nodes it may within "
                           f"health.window_seconds ({limits.window_seconds:g})")
                accepted = refused is None and health.exclude(node, f"rank {rank} a straggler", by="straggler check")
                record = {"time": time.time(), "step": step, "rank": rank, **self._node_of(rank), "drained": accepted,
                          "refused": refused}
                records.append(self.ctx.run_dir, records.DRAIN, record)
                what = (f"straggler rank {rank}'s node {node} drained at the checkpoint of step {step}: "
                        "a planned restart from it" if accepted else
                        f"straggler rank {rank}'s node {node} not drained: {refused or 'Ray refused the drain'}")
                incident(self.ctx, step, what)
                records.log_entry(self.ctx.run_dir, time=record["time"], step=step,
                                  kind="straggler_replaced" if accepted else "straggler_kept", detail=what,
                                  actions=["drain", "restart"] if accepted else ["none"],
                                  why="one slow rank sets the pace of all; the checkpoint makes the restart exact")
                if accepted:
                    why = what
            if why:
                goodput.mark(self.ctx.run_dir, "planned")
        restart = not all_ok(why is None)
        return (why or "a straggler's node was drained") if restart else None

    def _node_of(self, rank: int) -> dict:
        path = records.rank_file(self.ctx.run_dir, rank)
        return json.loads(path.read_text()) if path.exists() else {"node": None, "host": None}

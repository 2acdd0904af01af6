"""Elastic data parallelism on the workers (`train.elastic`): a run that has lost nodes goes on with fewer replicas,
and grows back once they return, without losing a step.

Ray Train picks the group's size: with `train.elastic`, the stage gives it a range (train/stage.py `workers`), and it
starts and restarts the group with as many workers as the cluster's live nodes can host. Gradient accumulation makes
up the missing replicas (LoopConfig.accumulation_at; where they do not divide the global batch's micro-batches,
some ranks pad: train/loop/step.py `Feed`), and a checkpoint written at one size loads at another
(train/checkpoint_files.py), so the global batch, the schedule and the loader's position are the run's own.

What this object adds, called by the loop at two fixed points:
- `start`, after the checkpoint load: a group started short waits up to `replacement_wait_seconds` for its
  missing nodes (an autoscaler's replacements take minutes), and ends the attempt if they join, so that Ray Train
  starts the whole group; otherwise the run goes on short, and the change of size is written down (resizes.jsonl,
  the logbook, an incident on the console; the stage tags MLflow with them).
- `grow`, at each published checkpoint of a short run: when the nodes can host more replicas, every rank ends the
  attempt there (a planned restart, exact), and Ray Train starts the larger group. Ray Train's own resize of a
  running group would restart it at any step, losing the steps since the last checkpoint: it is off.

Both ask Ray Train's own count: the resources Ray's autoscaling coordinator reserves for this run's group, each node
by itself (`hostable`), recomputed against a fresh view of the cluster first. The coordinator otherwise refreshes
its view every 20 s; a count of our own (`ray.nodes()`) saw a node join before it did, and restarted the run for a
size Ray Train then did not start.
"""

from __future__ import annotations

import time

from train import goodput, records
from train.loop.config import LoopConfig
from train.loop.context import Context, incident, log
from train.parallel.collectives import all_ok

POLL_SECONDS = 2.0  # between looks at the cluster while a group started short waits for its nodes


def hostable(reserved: dict[str, dict[str, float]], cpus: float, gpus: float) -> int:
    """Training workers of `cpus` CPUs and `gpus` GPUs that the resources reserved on each node hold, each node by
    itself, as Ray Train's elastic policy counts them (ElasticScalingPolicy._count_possible_workers)."""
    need = {r: n for r, n in (("CPU", cpus), ("GPU", gpus)) if n > 0}
    return sum(int(min(have.get(r, 0.0) // n for r, n in need.items())) for have in reserved.values())


def reserved() -> dict[str, dict[str, float]]:
    """What Ray's autoscaling coordinator reserves for this run's worker group now ({node: resources}), after a
    fresh look at the cluster: what Ray Train's elastic policy sizes the next group by. Its requester is named as
    Ray Train's scaling policy names it (ScalingPolicy.after_controller_start)."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator)
    from ray.train.v2._internal.execution.context import get_train_context

    requester = f"train-{get_train_context().train_run_context.run_id}"
    return ray.get(get_or_create_autoscaling_coordinator().get_reserved_resources.remote(requester, recompute=True),
                   timeout=60)


class Elastic:
    def __init__(self, cfg: LoopConfig, ctx: Context):
        t = cfg.train
        self.ctx, self.enabled, self.wait = ctx, t.elastic.enabled, t.elastic.replacement_wait_seconds
        self.configured, self.replicas = t.data_parallel, ctx.data_world
        self.worker, self.per_replica = (t.cpus_per_worker, t.gpus_per_worker), t.parallel.model_parallel
        self.accumulation = cfg.accumulation_at(self.replicas)
        self.padding = self.replicas * self.accumulation - cfg.micro_batches  # (Feed's) padding slots

    @property
    def short(self) -> bool:
        return self.enabled and self.replicas < self.configured

    def room(self) -> int:
        """The replicas Ray Train would start now, up to the configured ones; this size when Ray's coordinator cannot
        say (unreachable, or moved in another Ray): the run trains on short rather than stop, and its log says why."""
        try:
            workers = hostable(reserved(), *self.worker)
        except Exception as exc:  # Ray's errors, or its private modules moved
            log.warning("train.elastic: Ray's autoscaling coordinator did not say what it reserves (%s: %s); "
                        "training on at %d replicas", type(exc).__name__, str(exc)[:200], self.replicas)
            return self.replicas
        return min(workers // self.per_replica, self.configured)

    def start(self, step: int) -> None:
        """After the checkpoint load (`step`: the one resumed from): a short group waits for its nodes; raises
        PlannedRestart on every rank when they join, or writes the size down and returns."""
        from train.failures import PlannedRestart

        if not self.enabled:
            return
        joined = None
        if self.ctx.leader:
            joined = self._wait() if self.short else None
            if joined is None:
                self._written(step)
        if not all_ok(joined is None):
            raise PlannedRestart(joined or "nodes joined while the group waited")

    def grow(self, step: int) -> str | None:
        """At the published checkpoint of `step`: why every rank ends the attempt to grow, or None to train on."""
        if not self.short:
            return None
        why = None
        if self.ctx.leader and (room := self.room()) > self.replicas:
            why = f"the cluster hosts {room} of the {self.configured} replicas again: a restart from step {step}"
            goodput.mark(self.ctx.run_dir, "planned")
        restart = not all_ok(why is None)
        return (why or "the cluster hosts more replicas") if restart else None

    def _wait(self) -> str | None:
        """Up to `replacement_wait_seconds` for the missing nodes: why the attempt ends (they joined), or None."""
        began = time.monotonic()
        while (room := self.room()) <= self.replicas and time.monotonic() - began < self.wait:
            time.sleep(min(POLL_SECONDS, max(0.0, self.wait - (time.monotonic() - began))))
        seconds = time.monotonic() - began
        goodput.mark(self.ctx.run_dir, "waiting", seconds=seconds)
        if room <= self.replicas:
            return None
        goodput.mark(self.ctx.run_dir, "planned")
        return f"nodes for {room} of the {self.configured} replicas joined after {seconds:.0f} s: a restart on them"

    def _written(self, step: int) -> None:
        """A change of size since the last one written (or the configured size, at the first), written down."""
        before = records.read(self.ctx.run_dir, records.RESIZE)
        was = before[-1]["to"] if before else self.configured
        if was == self.replicas:
            return
        if self.replicas < was:
            why = (f"the cluster hosts {self.replicas} of the {self.configured} replicas (a node lost, or not yet "
                   f"joined), and none joined within replacement_wait_seconds ({self.wait:g} s)")
        else:
            why = f"nodes joined: the cluster hosts {self.replicas} of the {self.configured} replicas"
        what = (f"resized from {was} to {self.replicas} of {self.configured} data-parallel replicas at step {step}: "
                f"{self.accumulation} micro-batches a replica a step, the same global batch" +
                (f" ({self.padding} of the {self.replicas * self.accumulation} padding: the replicas do not divide it)"
                 if self.padding else ""))
        record = {"time": time.time(), "step": step, "from": was, "to": self.replicas, "why": why}
        records.append(self.ctx.run_dir, records.RESIZE, record)
        incident(self.ctx, step, what)
        records.log_entry(self.ctx.run_dir, time=record["time"], step=step, kind="resized", detail=what,
                          actions=["resize"], why=why)

"""The faults a drill injects (`train.inject`), apart from the production loop: the trainer calls one `Drill` at
fixed points and applies the effects it returns, knowing no fault kind.

- `Drill`: each fault fired once, even across restarts; a kill, a hang, an error, a spike, a nan, an overflow
  burst, a straggler, a node that fails its health check, a node lost or one that joins (`request`: the drill's
  cluster does it).
- `SimulatedScaler`: fp16's dynamic loss scale where the run has none, for an overflow burst on a CPU.
- `before_launch`: what the driver does before the first start (a node that fails the first health check).
- `NodeFaults`: the hook at a health check (the stage's, and the controller's at a restart): a node the drill
  has made unhealthy fails it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from train import records
from train.config import InjectConfig

if TYPE_CHECKING:  # a Drill runs in a worker; NodeFaults in Ray Train's controller too, which imports no torch
    from train.loop.context import Context


def before_launch(run_dir, faults: list[InjectConfig]) -> None:
    """On the driver, before the health check that precedes the first start: a node a drill makes unhealthy from
    step 0 is marked (the check fails it: `NodeFaults`)."""
    for fault in faults:
        if fault.kind == "unhealthy" and fault.step == 0:
            mark_unhealthy(run_dir, fault.node)


def mark_unhealthy(run_dir, node: str) -> None:
    """From now on, `node` fails this run's health checks (a marker in the run folder, never removed: the check runs
    on the driver or on Ray Train's controller, the fault fires on rank 0)."""
    request(run_dir, "unhealthy", node)


def request(run_dir, kind: str, node: str) -> Path:
    """A marker in the run folder that a drill's fault acts on elsewhere: `unhealthy` (the health checks fail the
    node: `NodeFaults`), or asking the drill's cluster (benchmarks/chaos.py) for `lost` (remove the node, no
    replacement) or `back` (a node of that name joins), which the cluster removes once done."""
    marker = Path(run_dir) / records.INJECT / f"{kind}-{node}"
    marker.parent.mkdir(exist_ok=True)
    marker.touch()
    return marker


def requested(run_dir, kind: str) -> list[tuple[str, Path]]:
    """The drill's cluster's side of `request`: each node a `kind` request names, with its marker (to remove once
    done)."""
    return [(m.name.removeprefix(f"{kind}-"), m) for m in sorted((Path(run_dir) / records.INJECT).glob(f"{kind}-*"))]


@dataclasses.dataclass(frozen=True)
class NodeFaults:
    """A drill's hook at the run's health checks (train/health.py's `check`): the nodes it marked unhealthy fail,
    whatever their probe measured. `for_run` gives none to a run whose drill has no such fault."""

    run_dir: str

    @classmethod
    def for_run(cls, run_dir, faults: list[InjectConfig]) -> NodeFaults | None:
        return cls(str(run_dir)) if any(f.kind == "unhealthy" for f in faults) else None

    def failing(self, nodes: list[str]) -> dict[str, str]:
        marked = {node for node, _ in requested(self.run_dir, "unhealthy")}
        return {node: "marked unhealthy by a drill" for node in nodes if node in marked}


class SimulatedScaler:
    """fp16's dynamic loss scale where there is no fp16 (CPU): halves on an overflow, doubles after
    `window` clean steps, as DeepSpeed's does, so a loss-scale collapse can be staged and handled."""

    def __init__(self, initial: float = 2.0 ** 16, window: int = 1000):
        self.initial, self.window = initial, window
        self.scale, self.clean = initial, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean = self.scale / 2, 0
        else:
            self.clean += 1
            if self.clean >= self.window:
                self.scale, self.clean = self.scale * 2, 0

    def reset(self) -> None:
        self.scale, self.clean = self.initial, 0


@dataclasses.dataclass
class Effects:
    """What this step's injected faults do to it."""

    lr_factor: float = 1.0
    nan: bool = False
    overflow: bool = False
    slow: float = 1.0  # this rank's compute stretched by this factor (an injected straggler)

    @property
    def poison(self) -> float:
        """The factor on the step's gradients: an injected nan or overflow poisons them; the loss reported is the true one."""
        return float("nan") if self.nan else 1e38 if self.overflow else 1.0


class Drill:
    """`train.inject` as one object the training loop calls at fixed points: `start_up` (before the checkpoint
    load), `before_step` (what this step's faults do to it), `rolled_back` (the autopilot undid steps). Each fault
    fires once, even across restarts: fired ones are recorded in the run folder first. Without faults every
    call does nothing."""

    def __init__(self, faults: list[InjectConfig], ctx: Context, *, hang_seconds: float, startup_seconds: float):
        self.ctx, self.path = ctx, ctx.run_dir / records.INJECTED
        self.hang_seconds, self.startup_seconds = hang_seconds, startup_seconds
        self.faults = [dict(dataclasses.asdict(f), factor=f.times, index=i) for i, f in enumerate(faults)]
        self.overflow_until = 0  # the last step of an overflow burst under way

    def loss_scaler(self, precision: str) -> SimulatedScaler | None:
        """fp16's dynamic loss scale, simulated, for a run without fp16 that the drill floods with overflows (so a
        collapse of the scale can be staged on a CPU); None otherwise: the run's own scaler, if any, is DeepSpeed's."""
        overflows = any(f["kind"] == "overflow" for f in self.faults)
        return SimulatedScaler() if overflows and precision != "fp16" else None

    def start_up(self) -> None:
        """Start-up's faults (step 0), under the start-up limit."""
        self._fire(0, self.startup_seconds)

    def before_step(self, step: int) -> Effects:
        """Fire this step's faults; returns their effects on the step."""
        return self._fire(step, self.hang_seconds)

    def rolled_back(self) -> None:
        """The autopilot rolled back: an injected overflow burst belongs to the steps that were undone."""
        self.overflow_until = 0

    def _fired(self) -> set[int]:
        try:
            return set(json.loads(self.path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return set()

    def _record(self, index: int) -> None:
        fired = sorted(self._fired() | {index})
        tmp = self.path.with_suffix(f".{self.ctx.rank}.tmp")
        tmp.write_text(json.dumps(fired))
        os.replace(tmp, self.path)

    def _fire(self, step: int, hang_seconds: float) -> Effects:
        from train.loop.context import incident
        from train.parallel.collectives import barrier

        slow = math.prod(f["factor"] for f in self.faults if f["kind"] == "slow" and step >= f["step"] and self._here(f))
        # (an unhealthy node at step 0 was marked by the stage, before the check that precedes the first start)
        due = [f for f in self.faults if f["step"] == step and f["kind"] != "slow" and (f["kind"], step) != ("unhealthy", 0)]
        if not due:
            return Effects(overflow=step <= self.overflow_until, slow=slow)
        fired = self._fired()
        barrier()  # every rank has read the same record before rank 0 adds to it
        effects = Effects()
        for fault in due:
            if fault["index"] in fired:
                continue
            if fault["kind"] in ("spike", "nan", "overflow"):  # on every rank alike
                self._on_every_rank(fault, step, effects)
                continue
            if fault["kind"] == "unhealthy":  # the node's next health check fails (`NodeFaults`)
                if self.ctx.leader:
                    self._record(fault["index"])
                    mark_unhealthy(self.ctx.run_dir, fault["node"])
                    incident(self.ctx, step, f"injected unhealthy: node {fault['node']}")
                continue
            if fault["kind"] == "back":  # a node joins: the drill's cluster starts it
                if self.ctx.leader:
                    self._record(fault["index"])
                    incident(self.ctx, step, f"injected back: node {fault['node']} joins")
                    self._served(request(self.ctx.run_dir, "back", fault["node"]))
                continue
            if not self._here(fault):
                continue
            rank = self.ctx.rank
            if fault["kind"] == "error":  # a bug: on every attempt, never recorded as fired
                incident(self.ctx, step, f"injected error on rank {rank}")
                raise RuntimeError(f"injected error at step {step}")
            self._record(fault["index"])
            incident(self.ctx, step, f"injected {fault['kind']} on rank {rank}")
            if fault["kind"] == "kill":
                os._exit(1)  # the worker process dies, as on a lost GPU or an ECC error
            if fault["kind"] == "lost":  # the drill's cluster removes the node, this process with it
                request(self.ctx.run_dir, "lost", fault["node"])
                time.sleep(10 * hang_seconds)  # (if it never does, the watchdog ends the process)
            if fault["kind"] == "hang":
                time.sleep(10 * hang_seconds)  # stalls until the watchdog ends the process
        barrier()
        effects.slow = slow
        return effects

    def _served(self, marker: Path) -> None:
        """Waits, under the start-up limit, until the drill's cluster has done what `marker` asked (it removes it)."""
        deadline = time.monotonic() + self.startup_seconds
        while marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _here(self, fault: dict) -> bool:
        """Whether a fault of one worker happens on this one: the rank named, every rank on the node named,
        or the last rank."""
        if fault["node"] is not None:
            return fault["node"] == self.ctx.node
        return self.ctx.rank == (self.ctx.world - 1 if fault["rank"] is None else fault["rank"])

    def _on_every_rank(self, fault: dict, step: int, effects: Effects) -> None:
        from train.loop.context import incident

        if self.ctx.leader:
            self._record(fault["index"])
            incident(self.ctx, step, f"injected {fault['kind']}" +
                     {"spike": f" (LR x {fault['factor']:g})", "nan": "",
                      "overflow": f" ({fault['count']} steps)"}[fault["kind"]])
        if fault["kind"] == "spike":
            effects.lr_factor = fault["factor"]
        elif fault["kind"] == "nan":
            effects.nan = True
        else:
            self.overflow_until = step + fault["count"] - 1
            effects.overflow = True

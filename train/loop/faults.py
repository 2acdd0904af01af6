"""What keeps a run from hanging or looping forever, and the faults the tests inject.

- `Watchdog`: a hang becomes a restart (the worker process exits; Ray Train restarts the group).
- `restarts_without_progress`: a fault that comes back before the next checkpoint every time stops the run.
- `Faults`: `train.inject`, each fault fired once, even across restarts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import time

from train.config import InjectConfig
from train import goodput, records
from train.failures import write_exit
from train.health import mark_unhealthy
from train.loop.context import Context, incident
from train.parallel.collectives import barrier


class Watchdog:
    """Ends this worker process when what is under way runs past its limit: a hang becomes a restart.

    It starts with the worker, so start-up (building the model, DeepSpeed's initialize, the
    checkpoint load, where OPT-175B's runs hung on storage) has a limit of its own; `beat` then
    starts each step's clock, with the step limit from the first step on."""

    def __init__(self, seconds: float, on_hang):
        self.seconds, self.on_hang = seconds, on_hang
        self.beat_at, self.step, self.started = time.monotonic(), 0, False
        self.owner = threading.get_ident()  # the training thread (under Ray Train, not the process's main thread)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def beat(self, step: int, seconds: float | None = None) -> None:
        """Step `step` is done (0: start-up is); `seconds`: the limit from now on."""
        self.beat_at, self.step, self.started = time.monotonic(), step, True
        if seconds is not None:
            self.seconds = seconds

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):  # at most a second late, whatever the limit was
            stalled = time.monotonic() - self.beat_at
            if stalled > self.seconds:
                self.on_hang(self.step, stalled, self.started, waiting_in_collective(self.owner))
                os._exit(3)


def waiting_in_collective(thread_id: int) -> bool:
    """Whether the thread is stuck inside a torch.distributed call: waiting for a peer, which is then the one
    that hangs (every rank's watchdog fires on a hang; only the culprit's is not in a collective). On a GPU,
    a wait for NCCL can also sit in a CUDA synchronize, which this does not see."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def watchdog_for(ctx: Context, hang_seconds: float, startup_seconds: float) -> Watchdog:
    """A watchdog whose last word is an incident naming what ran too long and the setting it outlasted."""

    def on_hang(done: int, stalled: float, started: bool, waiting: bool) -> None:
        if started:
            what = f"step {done + 1} has run {stalled:.0f} s (train.hang_seconds={hang_seconds})"
        else:
            what = (f"start-up (model build, DeepSpeed initialize, checkpoint load) has run {stalled:.0f} s "
                    f"(train.startup_seconds={startup_seconds})")
        what += ", waiting in a collective for a peer" if waiting else ""
        incident(ctx, done + started, f"{what}: ending this worker")
        write_exit(ctx.run_dir, ctx.rank, "hang", done + 1 if started else None, what, waiting)
        goodput.mark(ctx.run_dir, "hang", seconds=stalled, rank=ctx.rank)

    return Watchdog(startup_seconds, on_hang)


def restarts_without_progress(ctx: Context, resumed_step: int | None, limit: int) -> str | None:
    """Why to stop instead of training, when this start-up is the (limit + 1)-th in a row from the same
    checkpoint: a fault that comes back before the next checkpoint every time is not bad luck, and
    restarting forever would burn the cluster. Every start-up is appended to the run's `starts.json`
    (the step it resumed from, 0 for a fresh start); every rank reads it before rank 0 appends, so all
    reach the same answer. 0: never stop."""
    path = ctx.run_dir / records.STARTS
    starts = json.loads(path.read_text()) if path.exists() else []
    barrier()
    starts.append(resumed_step or 0)
    if ctx.leader:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(starts))
        os.replace(tmp, path)
    in_a_row = next((i for i, s in enumerate(reversed(starts)) if s != starts[-1]), len(starts))
    if limit and in_a_row - 1 > limit:
        why = (f"{in_a_row - 1} restarts in a row from step {starts[-1]} without reaching another checkpoint "
               f"(train.max_stalled_restarts={limit}): see incidents.jsonl for the faults")
        if ctx.leader:
            incident(ctx, starts[-1], why)
        return why
    return None


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


class Faults:
    """`train.inject`: each fault fires once; fired ones are recorded in the run folder first."""

    def __init__(self, faults: list[InjectConfig], ctx: Context):
        self.ctx, self.path = ctx, ctx.run_dir / records.INJECTED
        self.faults = [dict(dataclasses.asdict(f), factor=f.times, index=i) for i, f in enumerate(faults)]
        self.overflow_until = 0  # the last step of an overflow burst under way

    @property
    def simulates_overflow(self) -> bool:
        return any(f["kind"] == "overflow" for f in self.faults)

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

    def before_step(self, step: int, hang_seconds: float) -> Effects:
        """Fire this step's faults (step 0: start-up, before the checkpoint load); returns their effects on the step."""
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
            if fault["kind"] == "unhealthy":  # the node's next health check fails (train/health.py reads the mark)
                if self.ctx.leader:
                    self._record(fault["index"])
                    mark_unhealthy(self.ctx.run_dir, fault["node"])
                    incident(self.ctx, step, f"injected unhealthy: node {fault['node']}")
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
            if fault["kind"] == "hang":
                time.sleep(10 * hang_seconds)  # stalls until the watchdog ends the process
        barrier()
        effects.slow = slow
        return effects

    def _here(self, fault: dict) -> bool:
        """Whether a fault of one worker happens on this one: the rank named, every rank on the node named,
        or the last rank."""
        if fault["node"] is not None:
            return fault["node"] == self.ctx.node
        return self.ctx.rank == (self.ctx.world - 1 if fault["rank"] is None else fault["rank"])

    def _on_every_rank(self, fault: dict, step: int, effects: Effects) -> None:
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

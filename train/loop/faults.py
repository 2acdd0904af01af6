"""What keeps a run from hanging or looping forever (the faults a drill injects are train/loop/drill.py's).

- `Watchdog`: a hang becomes a restart (the worker process exits; Ray Train restarts the group).
- `restarts_without_progress`: a fault that comes back before the next checkpoint every time stops the run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from train import goodput, records
from train.failures import write_exit
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

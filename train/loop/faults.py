"""What keeps a run from hanging or looping forever (the faults a drill injects are train/loop/drill.py's).

- `Watchdog`: a hang becomes a restart (the worker process exits; Ray Train restarts the group).
- `start_attempt`: each attempt's start in the run's ledger, and the decision to give up instead (train/failures.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from train import goodput, records
from train.checkpoint_files import newest_step
from train.failures import GiveUp, give_up, write_exit
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


def start_attempt(ctx: Context, launched_at: float, max_stalled_restarts: int, last_step: int) -> GiveUp | None:
    """This attempt's start in the run's ledger (rank 0: the newest published checkpoint, the one it resumes
    from unless that fails to verify), and `give_up`'s answer over the ledger since the launch, before the model
    is built: a stop costs no build. Every rank reads the ledger before rank 0 appends, so all reach the same
    answer; a relaunch (after a fix) starts its counts again. A run whose newest checkpoint is its `last_step`
    has nothing left to stall on: the job's restarts are then for the further seeds' runs, which count their own."""
    ledger = [r for r in records.read(ctx.run_dir, records.START, records.FAILURE) if r["time"] >= launched_at]
    start = {"resumes": newest_step(ctx.ckpt_dir), "time": time.time()}
    barrier()
    if ctx.leader:
        records.append(ctx.run_dir, records.START, start)
    limit = 0 if start["resumes"] >= last_step else max_stalled_restarts
    return give_up(ledger + [{"record": records.START.name, **start}], limit)

"""Following training runs from the driver while Ray Train runs them: their steps for a progress
bar, their incidents (restarts, hangs, skipped checkpoints, autopilot interventions) as lines a
person sees, and their metrics to MLflow.

The workers append to metrics.jsonl (rank 0, a line per step) and incidents.jsonl (any rank) in
each run folder (train/loop/metrics.py, train/loop/context.py). A thread of the driver reads what was appended since its last
look; on a cluster the run folders are on shared storage, so the driver's node sees them too.
Nothing here talks to the workers: a run that is followed is not slowed down.

The metrics reach MLflow from here, not from the workers: the driver has MLflow's store open already, and a worker
that opened its own spent about 2.5 s of its CPU doing so beside its first steps (docs/benchmarks.md, issue 62's
seventh step). They go every FLUSH_SECONDS in one batch a run, and when the runs end.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from core.console import Bar, note
from train import records

if TYPE_CHECKING:
    from core.tracking import StageRun

FLUSH_SECONDS = 2.0  # one batch a run to MLflow at most this often, not a call a step (a write to its store each)


class _Tail:
    """The complete lines appended to a file since the last call (a line being written waits), from
    where the file ended when the tail was made: a resumed run's earlier lines were seen by the
    driver that ran it."""

    def __init__(self, folder: Path, file: str):
        self.path, self.file = Path(folder) / file, file
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def lines(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # not ours to judge here: the stage reads these files again when the run is over
            out.append({**row, "record": records.classify(self.file, row)})
        return out


class Follower:
    """`runs`: {label: run folder}; label "" for a stage's single run, else it prefixes the run's notes
    ("HackerNews seed 0"). The bar's count is the sum of each run's latest step. `tracked`: {label: MLflow run id}
    of the runs whose metrics go to MLflow, through `stage_run` (core.tracking.StageRun)."""

    def __init__(self, stage: str, runs: dict[str, Path], bar: Bar, every: float = 0.5,
                 stage_run: StageRun | None = None, tracked: dict[str, str] | None = None):
        self.stage, self.bar, self.every = stage, bar, every
        self.runs = {label: (_Tail(d, records.METRICS), _Tail(d, records.INCIDENTS)) for label, d in runs.items()}
        self.steps = {label: 0 for label in runs}
        self.loss: float | None = None
        self.stage_run = stage_run
        self.tracked = dict(tracked or {}) if stage_run is not None else {}  # nothing to send to without a stage run
        self.unsent: dict[str, list[dict]] = {label: [] for label in self.tracked}
        self.sent_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"follow-{stage}")

    def poll(self, last: bool = False) -> None:
        for label, (metrics, incidents) in self.runs.items():
            rows = metrics.lines()
            for row in rows:
                if row["record"] == records.STEP.name:
                    self.steps[label], self.loss = row["step"], row["loss"]
            if label in self.unsent:
                self.unsent[label] += rows
            for row in incidents.lines():
                where = f"{label}: " if label else ""
                note(self.stage, f"{where}step {row['step']}: {row['what']}")
        self.bar.update_to(sum(self.steps.values()), f"loss {self.loss:.4f}" if self.loss is not None else "")
        if last or time.monotonic() - self.sent_at >= FLUSH_SECONDS:
            self.send()

    def send(self) -> None:
        """What came in since the last send, to each tracked run. A failed send is said, once a run and call; its
        rows stay in metrics.jsonl, which the stage reads when the run is over."""
        self.sent_at = time.monotonic()
        for label, rows in self.unsent.items():
            self.unsent[label] = []
            if rows:
                try:
                    self.stage_run.log_rows(self.tracked[label], rows)
                except Exception as exc:  # MLflow's store or server: the run goes on, its rows are on disk
                    where = f"{label}: " if label else ""
                    note(self.stage, f"{where}{len(rows)} metric records not sent to MLflow ({type(exc).__name__}: {exc})")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def __enter__(self) -> "Follower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll(last=True)  # what came in after the last look, and every metric not yet sent

"""Following training runs from the driver while Ray Train runs them: their steps for a progress
bar, their incidents (restarts, hangs, skipped checkpoints, autopilot interventions) as lines a
person sees.

The workers append to metrics.jsonl (rank 0, a line per step) and incidents.jsonl (any rank) in
each run folder (train/loop/metrics.py, train/loop/context.py). A thread of the driver reads what was appended since its last
look; on a cluster the run folders are on shared storage, so the driver's node sees them too.
Nothing here talks to the workers: a run that is followed is not slowed down.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from core.console import Bar, note
from train import records


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
    ("HackerNews seed 0"). The bar's count is the sum of each run's latest step."""

    def __init__(self, stage: str, runs: dict[str, Path], bar: Bar, every: float = 0.5):
        self.stage, self.bar, self.every = stage, bar, every
        self.runs = {label: (_Tail(d, records.METRICS), _Tail(d, records.INCIDENTS)) for label, d in runs.items()}
        self.steps = {label: 0 for label in runs}
        self.loss: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"follow-{stage}")

    def poll(self) -> None:
        for label, (metrics, incidents) in self.runs.items():
            for row in metrics.lines():
                if row["record"] == records.STEP.name:
                    self.steps[label], self.loss = row["step"], row["loss"]
            for row in incidents.lines():
                where = f"{label}: " if label else ""
                note(self.stage, f"{where}step {row['step']}: {row['what']}")
        self.bar.update_to(sum(self.steps.values()), f"loss {self.loss:.4f}" if self.loss is not None else "")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def __enter__(self) -> "Follower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # what came in after the last look

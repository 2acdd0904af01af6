"""A training run's folder: every file a run writes there, named once, and one writer and one reader for its rows.

The run folder outlives an attempt: the driver, every rank, Ray Train's controller and its watchdogs append
to it, and the stage, the goodput account, the health checks, the console and the benchmarks read it back.
Each kind of row (a `Kind`) says which file it lives in and which fields every row of it has; `append`
refuses a row without them, and stamps each with its kind (`record`), so that a reader asks for the rows
it wants (`read(folder, STEP)`) instead of telling them apart by which keys are present. Three files hold
more than one kind: metrics.jsonl (a step, an evaluation, a checkpoint save), stragglers.jsonl (a
straggler named, its node's drain) and attempts.jsonl (an attempt's start, a rank's failure). Rows written before the kinds were stamped are classified once, in
`classify`, so run folders of earlier versions still read.

The logbook (what the autopilot and the health and straggler checks saw and did, with LOGBOOK.md beside it),
the incidents and summary.json are written here too: each file of the run folder has this one owner.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

# Rows, a JSON object a line, appended across attempts.
METRICS = "metrics.jsonl"  # rank 0: a row per step, evaluation and checkpoint save
TIMELINE = "timeline.jsonl"  # the driver, rank 0 and the watchdogs: events for the goodput account
INCIDENTS = "incidents.jsonl"  # any rank and the controller: what happened to the run, a line a person reads
LOGBOOK = "logbook.jsonl"  # what was seen, what was done and why (LOGBOOK_MD: the same, readable)
ATTEMPTS = "attempts.jsonl"  # the ledger of attempts: rank 0 as each starts, the controller as one fails
STRAGGLERS = "stragglers.jsonl"  # rank 0: stragglers named, and their nodes' drains
HEALTH = "health.jsonl"  # the health checks: a row per node probed
RESIZES = "resizes.jsonl"  # rank 0: each change of an elastic run's data-parallel size (train.elastic)
# Whole files.
LOGBOOK_MD = "LOGBOOK.md"
SUMMARY = "summary.json"  # rank 0, at the end: steps, the final loss, why the run stopped (if it did)
LOOP_CONFIG = "loop_config.json"  # the driver: what every worker runs with
INJECTED = "injected.json"  # rank 0: the drill's faults that have fired
AUTOPILOT = "autopilot.json"  # rank 0: the autopilot's state, written before each intervention
TRAIN_LOG = "train.log"  # rank 0's log
# Folders.
CHECKPOINTS = "checkpoints"  # train/checkpoint_files.py owns what is inside
RANKS = "ranks"  # each rank's node and host, written as it starts (rank-R.json)
EXITS = "exits"  # why a rank's watchdog ended its process (rank-R.json)
INJECT = "inject"  # the drill's markers of an unhealthy node
# Files of earlier versions, under their former names: still read, with the rows of the file that replaced them
# (failures.jsonl held the failure rows alone; the start-ups were in a starts.json, not read: its count of
# restarts without progress starts again).
FORMERLY = {ATTEMPTS: "failures.jsonl"}
# What the stage copies into its output folder, for MLflow and a reader of the stage's output.
COPIED = (METRICS, INCIDENTS, ATTEMPTS, STRAGGLERS, HEALTH, RESIZES, LOOP_CONFIG, LOGBOOK, LOGBOOK_MD, TRAIN_LOG)


@dataclass(frozen=True)
class Kind:
    """A kind of row: its name (each row's `record`), its file, and the fields every row of it has."""

    name: str
    file: str
    fields: tuple[str, ...]


STEP = Kind("step", METRICS, ("step", "loss", "lr", "grad_norm", "seconds", "time"))
EVALUATION = Kind("evaluation", METRICS, ("step", "eval_seconds", "time"))
CHECKPOINT = Kind("checkpoint", METRICS, ("step", "checkpoint.blocked_seconds", "checkpoint.write_seconds", "time"))
EVENT = Kind("event", TIMELINE, ("event", "time"))
INCIDENT = Kind("incident", INCIDENTS, ("time", "step", "rank", "what"))
ENTRY = Kind("entry", LOGBOOK, ("time", "step", "kind", "detail", "actions", "why"))
START = Kind("start", ATTEMPTS, ("resumes", "time"))  # an attempt starts, from checkpoint `resumes` (0: none)
FAILURE = Kind("failure", ATTEMPTS, ("attempt", "rank", "kind", "type", "message", "time"))
STRAGGLER = Kind("straggler", STRAGGLERS, ("time", "step", "rank", "node", "host", "seconds", "others_seconds"))
DRAIN = Kind("drain", STRAGGLERS, ("time", "step", "rank", "node", "drained", "refused"))
PROBE = Kind("probe", HEALTH, ("node", "time", "failed", "drained"))
RESIZE = Kind("resize", RESIZES, ("time", "step", "from", "to", "why"))  # replicas before and after
KINDS = {k.name: k for k in (STEP, EVALUATION, CHECKPOINT, EVENT, INCIDENT, ENTRY, START, FAILURE, STRAGGLER, DRAIN, PROBE, RESIZE)}
_OF_FILE = {file: [k for k in KINDS.values() if k.file == file] for file in {k.file for k in KINDS.values()}}


def classify(file: str, row: dict) -> str:
    """The kind of a row of `file`: its own `record`, or, for a row written before rows were stamped, the one
    kind its file holds, or (metrics.jsonl, stragglers.jsonl) what its keys say. The only place keys are read
    to tell kinds apart."""
    if "record" in row:
        return row["record"]
    if file == METRICS:
        return STEP.name if "loss" in row else CHECKPOINT.name if "checkpoint.blocked_seconds" in row else EVALUATION.name
    if file == STRAGGLERS:
        return DRAIN.name if "drained" in row else STRAGGLER.name
    if file == ATTEMPTS:
        return FAILURE.name  # an unstamped row of the ledger is one of failures.jsonl's
    return _OF_FILE[file][0].name


def append(folder: Path | str, kind: Kind, *rows: dict) -> None:
    """Rows of `kind` appended to its file in `folder`, each stamped with its kind, in one write (several
    processes append to the same files: a line is never split between two writers' lines)."""
    lines = []
    for row in rows:
        missing = [f for f in kind.fields if f not in row]
        if missing:
            raise ValueError(f"a {kind.name} row of {kind.file} needs {', '.join(missing)}: {sorted(row)}")
        lines.append(json.dumps({"record": kind.name, **row}) + "\n")
    if lines:
        with open(Path(folder) / kind.file, "a") as f:
            f.write("".join(lines))


def read(folder: Path | str, *kinds: Kind) -> list[dict]:
    """The rows of `kinds` (all of one file) in `folder`, in the order written (a file's rows under its former
    name first), each with its `record`; [] when the file is not there yet."""
    files = {k.file for k in kinds}
    if len(files) != 1:
        raise ValueError(f"read one file's kinds at a time, not {sorted(files)}")
    file = files.pop()
    paths = [Path(folder) / name for name in (FORMERLY.get(file), file) if name]
    names = {k.name for k in kinds}
    rows = (json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines() if line.strip())
    return [{**row, "record": kind} for row in rows for kind in [classify(file, row)] if kind in names]


def without_record(row: dict) -> dict:
    """A row's own fields, for a reader that builds an object of them."""
    return {k: v for k, v in row.items() if k != "record"}


def rank_file(folder: Path | str, rank: int, kind: str = RANKS) -> Path:
    """ranks/rank-R.json (or exits/rank-R.json, `kind` EXITS)."""
    return Path(folder) / kind / f"rank-{rank}.json"


def incident(folder: Path | str, step: int, rank: int, what: str) -> None:
    """One line of incidents.jsonl: what happened to the run, and when."""
    append(folder, INCIDENT, {"time": time.time(), "step": step, "rank": rank, "what": what})


def log_entry(folder: Path | str, **entry) -> None:
    """One entry of the logbook (time, step, kind, detail, actions, why, and what else the entry says), and
    LOGBOOK.md written again from all of them."""
    append(folder, ENTRY, entry)
    (Path(folder) / LOGBOOK_MD).write_text(render_logbook(read(folder, ENTRY)))


def render_logbook(entries: list[dict]) -> str:
    lines = ["# Logbook", "", "What the autopilot and the run's checks saw and did, in order. (Written by train/records.py.)", ""]
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["time"]))
        lines += [f"## Step {e['step']}: {e['kind']} ({when} UTC)", "", f"- Seen: {e['detail']}",
                  f"- Done: {', '.join(e['actions']) or 'nothing'}", f"- Why: {e['why']}"]
        for key in ("rolled_back_to", "skipped_batches", "lr_factor", "clip"):
            if e.get(key) is not None:
                lines.append(f"- {key.replace('_', ' ')}: {e[key]}")
        lines.append("")
    return "\n".join(lines)


def write_summary(folder: Path | str, steps: int, final_loss: float | None, stopped: str | None) -> None:
    """summary.json: how the run ended (the stage reads it when the workers are done)."""
    (Path(folder) / SUMMARY).write_text(json.dumps({"steps": steps, "final_loss": final_loss, "stopped": stopped}))


def read_summary(folder: Path | str) -> dict:
    """summary.json; {} when the run has not ended."""
    path = Path(folder) / SUMMARY
    return json.loads(path.read_text()) if path.exists() else {}

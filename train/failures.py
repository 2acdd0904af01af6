"""Every failed attempt of a training run, recorded with where and why it failed, and the policy that stops
a run whose failure is deterministic.

Ray Train restarts the worker group after any failure (`train.max_failures`, no limit by default). That
is right for a lost GPU and wrong for a bug: OPT-175B's team stopped by hand when the same error came back.
Here:

- each worker says who it is (`ranks/rank-R.json`: node, host, pid) when it starts, and a worker whose
  training function raises attaches where it was (step, phase, node) and its traceback to the exception
  (`describe_exception`); a worker its own watchdog ends says so in `exits/rank-R.json` first;
- `FailureRecorder`, a Ray Train callback on the controller, turns each failed attempt's exceptions into
  `Failure` rows in the run's ledger of attempts, `attempts.jsonl` (attempt, rank, node, step, phase, class,
  the exception), before Ray Train restarts the group; `RestartHealthCheck` probes every node that can host
  a worker (or, with `train.health.restart_probe: implicated`, the nodes the failures implicate) once that
  group is gone;
- as each attempt starts, before the model is built, rank 0 adds a `start` row to the same ledger (the
  checkpoint it resumes from), and every rank asks `give_up` the one question over the ledger since the
  run's launch: the same software exception at the same step (or in start-up) on two attempts in a row
  (`repeated_error`), or more than `train.max_stalled_restarts` restarts in a row from the same checkpoint
  (`stalled`), stops the run with why, instead of another try.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import traceback
from pathlib import Path

from ray.train import UserCallback
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from train import records

# What a failure was, judged from the exception: a restart on other hardware may help (hardware, hang,
# preemption), fewer sequences per GPU may (oom), or nothing will but a fix (software).
HARDWARE = re.compile(r"CUDA error|NCCL|ECC|uncorrectable|Xid|illegal memory access|device-side assert|"
                      r"timed out|timeout|Connection (reset|closed)|Broken pipe|gloo", re.IGNORECASE)
OOM = re.compile(r"out of memory|OutOfMemoryError|MemoryError", re.IGNORECASE)
# A collective that broke because a peer went away: a consequence, not a cause, when a peer failed itself.
PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker crash|Broken pipe", re.IGNORECASE)
PROCESS_LOST = ("ActorDiedError", "RayActorError", "NodeDiedError", "WorkerCrashedError", "WorkerHealthCheckFailedError")


@dataclasses.dataclass
class Failure:
    attempt: int  # 1 for the run's first failed attempt; every attempt but the last running one ends in one
    rank: int
    kind: str  # hardware, software, oom, preemption, hang, planned (the run restarts itself: train.stragglers.exclude)
    type: str  # the exception's class ("ActorDiedError": the process died without one)
    message: str
    step: int | None = None  # the step under way; None: during start-up
    phase: str = "start-up"  # start-up, step, validation, checkpoint, export
    node: str | None = None  # Ray's node id
    host: str | None = None
    where: str | None = None  # the innermost frame: file:line in function
    traceback: str = ""
    primary: bool = True  # False: a collective broken by a peer that failed in the same attempt
    time: float = dataclasses.field(default_factory=time.time)

    def signature(self) -> tuple:
        """What makes two failures the same error: the exception, where it was raised, and the step."""
        return (self.type, self.message, self.where, self.step, self.phase)

    def line(self) -> str:
        at = "start-up" if self.step is None else f"step {self.step} ({self.phase})"
        return f"rank {self.rank} on {self.host or self.node or 'an unknown node'}, {at}: {self.kind}: {self.type}: {self.message}"


class PlannedRestart(RuntimeError):
    """Every rank ends its attempt at a checkpoint so that Ray Train restarts the group without a drained node."""


def classify(type_name: str, message: str) -> str:
    if "PlannedRestart" in type_name:
        return "planned"
    if "Preemption" in type_name:
        return "preemption"
    if OOM.search(type_name) or OOM.search(message):
        return "oom"
    if type_name in PROCESS_LOST or HARDWARE.search(message):
        return "hardware"  # a process or node lost, or an error of the device or the network
    return "software"


def describe_exception(error: BaseException, step: int | None, phase: str, rank: int, node: str | None) -> dict:
    """Where a worker was when `error` left its training function; attached to the exception (its attributes
    travel with it to Ray Train's controller)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    return {"rank": rank, "step": step, "phase": phase, "node": node, "host": socket.gethostname(), "where": where,
            "traceback": "".join(traceback.format_exception(error))[-8000:]}


def write_identity(run_dir: Path, rank: int, node: str | None) -> None:
    """ranks/rank-R.json: the node this rank runs on, for failures that leave no exception behind, and what its
    speed depends on beside its device: torch's threads and glibc's malloc arenas (train/stage.py WORKER_ENV)."""
    import torch

    path = records.rank_file(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"node": node, "host": socket.gethostname(), "threads": torch.get_num_threads(),
                                "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX")}))


def write_exit(run_dir: Path, rank: int, kind: str, step: int | None, message: str, waiting: bool = False) -> None:
    """exits/rank-R.json: why this process is about to end itself (its watchdog: a hang; `waiting`: in a
    collective, for a peer)."""
    path = records.rank_file(run_dir, rank, records.EXITS)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"kind": kind, "step": step, "message": message, "waiting": waiting}))


def history(run_dir: Path) -> list[Failure]:
    return [Failure(**records.without_record(row)) for row in records.read(run_dir, records.FAILURE)]


def failure_of(rank: int, error: Exception, attempt: int, run_dir: Path) -> Failure:
    """One rank's failure, from its exception and what it wrote before it ended."""
    said = getattr(error, "train_failure", None) or {}
    exit_file, identity = records.rank_file(run_dir, rank, records.EXITS), records.rank_file(run_dir, rank)
    exited = json.loads(exit_file.read_text()) if exit_file.exists() else None
    who = json.loads(identity.read_text()) if identity.exists() else {}
    type_name, message = type(error).__name__, str(error).strip().splitlines()[0][:500] if str(error).strip() else ""
    kind = classify(type_name, message)
    if exited is not None:
        exit_file.unlink()
        kind, message = exited["kind"], exited["message"]
    step, phase = (said["step"], said["phase"]) if said else (exited["step"], "step") if exited else \
        last_step_since(run_dir, identity.stat().st_mtime if identity.exists() else time.time())
    return Failure(attempt=attempt, rank=rank, kind=kind, type=type_name, message=message, step=step, phase=phase,
                   primary=not (exited or {}).get("waiting", False),
                   node=said.get("node") or who.get("node"), host=said.get("host") or who.get("host"),
                   where=said.get("where"), traceback=said.get("traceback", ""))


def last_step_since(run_dir: Path, since: float) -> tuple[int | None, str]:
    """The step under way on a process that died without a word: the one after the last step rank 0 logged in
    this attempt (since the rank started), or start-up if it logged none."""
    path = run_dir / records.METRICS
    if not path.exists():
        return None, "start-up"
    with open(path, "rb") as f:
        start = max(0, path.stat().st_size - 65536)  # the tail: the file has a line per step of the whole run
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()[1 if start else 0:]
    rows = [json.loads(line) for line in lines if line.strip()]
    steps = [r["step"] for r in rows if records.classify(records.METRICS, r) == records.STEP.name and r["time"] >= since]
    return (steps[-1] + 1, "step") if steps else (None, "start-up")


class FailureRecorder(UserCallback):
    """On Ray Train's controller: each failed attempt's failures into the ledger and incidents.jsonl,
    before the controller decides to restart."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        run_dir = Path(self.run_dir)
        attempt = max((f.attempt for f in history(run_dir)), default=0) + 1
        failures = [failure_of(rank, error, attempt, run_dir) for rank, error in sorted(worker_exceptions.items())]
        if any(f.primary and not PEER_LOST.search(f.message) for f in failures):
            for f in failures:
                f.primary = f.primary and not PEER_LOST.search(f.message)
        records.append(run_dir, records.FAILURE, *map(dataclasses.asdict, failures))
        records.append(run_dir, records.INCIDENT, *({"time": f.time, "step": f.step or 0, "rank": f.rank,
                                                    "what": f"attempt {attempt} failed: {f.line()}"} for f in failures))


class RestartHealthCheck(WorkerGroupCallback):
    """On Ray Train's controller, as the next attempt starts: the nodes `to_probe` names probed (by default every
    node that can host a worker), the ones that fail drained (within the guard: past it the restart goes on with
    every node, written down).

    Not in `after_exception`: Ray Train reports a failed attempt while the group's surviving ranks still hold
    their node's GPUs, and the probe would measure a GPU shared with them. The controller tears the old group
    down before it starts the next (controller.py `_shutdown_worker_group`, then `_start_worker_group`), and
    the new group calls `before_worker_group_start` before its placement group is made
    (worker_group.py `_start`). A Ray Train internal hook: RunConfig passes callbacks that are not a
    `UserCallback` to the controller as they are (data_parallel_trainer.py `_create_default_callbacks`)."""

    def __init__(self, run_dir: str, health, worker: tuple[float, float] = (1.0, 0.0), drill=None):
        self.run_dir = run_dir
        self.health = health  # a HealthConfig (train/health.py)
        self.worker = worker  # (CPUs, GPUs) of a training worker: which nodes training can use
        self.drill = drill  # a drill's hook at health checks (train/loop/drill.py's NodeFaults), or None

    def before_worker_group_start(self, worker_group_context) -> None:
        from train import health

        run_dir = Path(self.run_dir)
        trainable = health.trainable_nodes(*self.worker)
        suspects = to_probe(self.health, history(run_dir), health.last_checked(run_dir), trainable,
                            health.drained_nodes(run_dir))
        if suspects:
            health.check(run_dir, suspects, self.health, population=len(trainable), drill=self.drill)


def to_probe(health, failures: list[Failure], checked: dict[str, float], trainable: list[str],
             drained: list[str]) -> list[str]:
    """The nodes to probe as an attempt starts (`health`: a HealthConfig). `restart_probe: all`: after a failure
    that no probe has followed yet (a restart, not the first start, which the stage probes itself), every node
    that can host a worker (`trainable`) and this run has not drained: a node that turned unhealthy without
    failing is found at the next restart, whichever node that restart was for, while the group is down and
    every GPU free. `implicated`: only nodes with `health.failures` failures of their own (`implicated`)."""
    if health.restart_probe == "implicated":
        return implicated(failures, health.failures, health.window_seconds, checked)
    last = max(checked.values(), default=0.0)
    if not any(f.time > last for f in failures):
        return []
    return sorted(node for node in trainable if node not in drained)


def implicated(failures: list[Failure], count: int, window_seconds: float, checked: dict[str, float]) -> list[str]:
    """Nodes with `count` failures (each a cause, not a peer's broken collective; not a bug in the code) within
    the last `window_seconds` and since the node's last health check (`checked`: node -> time): to probe now."""
    now = time.time()
    by_node: dict[str, int] = {}
    for f in failures:
        if f.primary and f.kind not in ("software", "planned") and f.node and now - f.time <= window_seconds \
                and f.time > checked.get(f.node, 0.0):
            by_node[f.node] = by_node.get(f.node, 0) + 1
    return sorted(node for node, n in by_node.items() if n >= count)


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Why a run stops instead of starting another attempt: the rule, the step it stops at, what was seen (for
    the console and the logbook) and why stopping is right."""

    rule: str  # repeated-error, stalled-restarts
    step: int
    detail: str
    why: str


def give_up(ledger: list[dict], max_stalled_restarts: int) -> GiveUp | None:
    """The one decision to stop a run rather than try again, over its ledger of attempts since it was launched
    (`records.START` and `records.FAILURE` rows, this attempt's start the last): a bug that a restart repeats,
    or a fault that comes back before the next checkpoint every time. None: go on."""
    failures = [Failure(**records.without_record(r)) for r in ledger if r["record"] == records.FAILURE.name]
    repeated = repeated_error(failures)
    if repeated is not None:
        return GiveUp("repeated-error", 0, repeated, "a restart would fail the same way")
    return stalled(unplanned_resumes(ledger), max_stalled_restarts)


def unplanned_resumes(ledger: list[dict]) -> list[int]:
    """Each start's checkpoint step, less the starts after an attempt the run ended itself (every primary failure
    `planned`: a straggler's node left, an elastic group grown at a checkpoint, or restarted whole once its missing
    nodes joined): those are no fault coming back, and an elastic run's may follow one another from one checkpoint."""
    resumes, ended = [], []
    for row in ledger:
        if row["record"] == records.FAILURE.name:
            ended.append(row)
        elif row["record"] == records.START.name:
            primary = [f for f in ended if f.get("primary", True)]
            if not (primary and all(f["kind"] == "planned" for f in primary)):
                resumes.append(row["resumes"])
            ended = []
    return resumes


def stalled(resumes: list[int], limit: int) -> GiveUp | None:
    """Stop when this start (the last of `resumes`, each start's checkpoint step) is the (limit + 1)-th in a row
    from the same checkpoint: a fault that comes back before the next checkpoint every time is not bad luck,
    and restarting forever would burn the cluster. 0: never."""
    in_a_row = next((i for i, s in enumerate(reversed(resumes)) if s != resumes[-1]), len(resumes)) if resumes else 0
    if not limit or in_a_row - 1 <= limit:
        return None
    return GiveUp("stalled-restarts", resumes[-1],
                  f"{in_a_row - 1} restarts in a row from step {resumes[-1]} without reaching another checkpoint "
                  f"(train.max_stalled_restarts={limit}): see incidents.jsonl for the faults",
                  "a fault that comes back before the next checkpoint every time is not bad luck")


def repeated_error(failures: list[Failure]) -> str | None:
    """Why to stop: the same software exception at the same step on the last two failed attempts (a bug, which
    a restart repeats), with its traceback; None otherwise."""
    attempts = sorted({f.attempt for f in failures})
    if len(attempts) < 2:
        return None
    last, before = ([f for f in failures if f.attempt == a and f.kind == "software" and f.primary]
                    for a in attempts[-1:-3:-1])
    same = [f for f in last if f.signature() in {b.signature() for b in before}]
    if not same:
        return None
    f = same[0]
    at = "in start-up" if f.step is None else f"at step {f.step} ({f.phase})"
    return (f"the same error {at} on attempts {attempts[-2]} and {attempts[-1]}, rank {f.rank} on "
            f"{f.host or f.node}: {f.type}: {f.message} ({f.where}); a restart would repeat it, so the run "
            f"stops here.\n{f.traceback}")

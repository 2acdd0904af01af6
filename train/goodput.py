"""Where a training run's wall time went, and the share of it that trained steps the model kept (ETTR).

Llama 3 and MegaScale report effective training time (the time of the steps kept over the wall time)
above 90%; OPT-175B, by hand, did not say. The run's records give every term:

- `timeline.jsonl` (run folder): the driver's `launch` and `finish`; `health` (node probes, before the
  first start or between attempts, train/health.py); rank 0's `start` (the worker's first line), `built`
  (model and DeepSpeed engine), `ready` (checkpoint loaded: the first step starts), `export`, `seed_runs`
  (the evaluation-only runs of other seeds, `train.seeds`, after the run on the same workers); a watchdog's
  `hang` (with how long the step had stalled); rank 0's `planned` (the run ends its attempt at a checkpoint
  to leave a straggler's drained node, or to grow an elastic run: the gap to the next start is `planned_restart`,
  not `restart`); rank 0's `waiting` (an elastic group started short, waiting for its nodes: `replacement_wait`),
  and each `ready` says the attempt's replicas and the configured ones (the kept time at a reduced size,
  `kept_reduced_seconds`, a share of `kept`);
- `metrics.jsonl`: each step's end time and seconds, each validation's seconds, each checkpoint's
  blocked seconds.

A step logged more than once (redone after a restart or a rollback) is kept only in its last occurrence:
the earlier ones are lost work. What no record covers (a step cut short by a crash, the time until Ray
Train noticed, tearing down and scheduling the next attempt) is `restart`; from the launch to the first
worker's start is `scheduling`.
"""

from __future__ import annotations

import time
from pathlib import Path

from train import records

PARTS = ("kept", "lost", "scheduling", "health_check", "startup_build", "startup_load", "replacement_wait", "restart",
         "planned_restart", "hang",
         "checkpoint_blocked", "evaluation", "export", "seed_runs", "other")


def mark(run_dir: Path | str, event: str, **fields) -> None:
    """One event on the run's timeline (a line appended: the driver, rank 0 and any watchdog write here)."""
    records.append(run_dir, records.EVENT, {"event": event, "time": time.time(), **fields})


def account(run_dir: Path | str) -> dict:
    """The breakdown in seconds (PARTS), `wall_seconds` and `ettr`, over the driver launches so far; the
    intervals behind it in `spans` for the chart."""
    run_dir = Path(run_dir)
    events = records.read(run_dir, records.EVENT)
    rows = records.read(run_dir, records.STEP, records.EVALUATION, records.CHECKPOINT)
    seconds = dict.fromkeys(PARTS, 0.0)
    spans: list[tuple[str, float, float]] = []
    steps = [r for r in rows if r["record"] == records.STEP.name]
    last_of = {r["step"]: i for i, r in enumerate(steps)}
    for i, r in enumerate(steps):
        part = "kept" if last_of[r["step"]] == i else "lost"
        seconds[part] += r["seconds"]
        spans.append((part, r["time"] - r["seconds"], r["time"]))
    waits = {records.EVALUATION.name: ("eval_seconds", "evaluation"),
             records.CHECKPOINT.name: ("checkpoint.blocked_seconds", "checkpoint_blocked")}
    for r in rows:
        if r["record"] in waits:
            key, part = waits[r["record"]]
            seconds[part] += r[key]
            spans.append((part, r["time"] - r[key], r["time"]))
    wall = _walk(events, rows, seconds, spans)
    seconds["other"] = max(0.0, wall - sum(v for k, v in seconds.items() if k != "other"))
    return {**{f"{k}_seconds": round(v, 3) for k, v in seconds.items()}, "wall_seconds": round(wall, 3),
            "kept_reduced_seconds": round(reduced(events, steps, last_of), 3),
            "ettr": round(seconds["kept"] / wall, 4) if wall > 0 else 0.0, "spans": spans}


def reduced(events: list[dict], steps: list[dict], last_of: dict[int, int]) -> float:
    """Of the kept steps' time, what an elastic run trained with fewer replicas than configured: each step belongs to
    the attempt whose `ready` (which says its `replicas` and the configured ones, `of`) came last before it."""
    readies = sorted((e["time"], e.get("replicas", 0) < e.get("of", 0)) for e in events if e["event"] == "ready")
    total, k, short = 0.0, 0, False
    for i, r in sorted(enumerate(steps), key=lambda pair: pair[1]["time"]):
        while k < len(readies) and readies[k][0] <= r["time"]:
            short, k = readies[k][1], k + 1
        if short and last_of[r["step"]] == i:
            total += r["seconds"]
    return total


def _walk(events: list[dict], rows: list[dict], seconds: dict, spans: list) -> float:
    """The timeline's events in order: start-ups, the gaps between attempts, hangs, exports; the wall time."""
    wall, launched, last, started, built, hang_until, checking, planned = 0.0, None, None, None, None, 0.0, 0.0, False
    latest = None  # the launch's last record, health checks included (a run stopped by its first check ends there)
    times = sorted([(e["time"], e) for e in events] + [(r["time"], {"event": "row"}) for r in rows],
                   key=lambda pair: pair[0])
    for t, e in times:
        kind = e["event"]
        if kind == "launch":
            if launched is not None:  # the previous driver died: count up to its last record
                wall += latest - launched
            launched, last, latest, started, checking = t, t, t, None, 0.0
            continue
        if launched is None:
            continue
        latest = t
        if kind == "start":  # the gap before it: scheduling (the launch's first) or restart, less health checks
            gap = "scheduling" if started is None else "planned_restart" if planned else "restart"
            seconds[gap] += t - last - checking
            spans.append((gap, last, t))
            started = built = t
            checking, planned = 0.0, False
        elif kind == "planned":  # the run ends its attempt itself (a straggler's node drained): the restart is planned
            planned = True
        elif kind == "built" and started is not None:
            seconds["startup_build"] += t - started
            spans.append(("startup_build", started, t))
            built = t
        elif kind == "ready" and built is not None:
            seconds["startup_load"] += t - built
            spans.append(("startup_load", built, t))
        elif kind == "hang":  # the peers of a hung rank may say so too: the same stall counts once
            begin = max(t - e["seconds"], hang_until)
            seconds["hang"] += max(0.0, t - begin)
            spans.append(("hang", begin, t))
            hang_until = max(hang_until, t)
        elif kind == "waiting":  # an elastic group started short, waiting for its missing nodes (train.elastic)
            seconds["replacement_wait"] += e["seconds"]
            spans.append(("replacement_wait", t - e["seconds"], t))
        elif kind == "health":  # probes between attempts (or before the first): not counted in the gap
            seconds["health_check"] += e["seconds"]
            checking += e["seconds"]
            spans.append(("health_check", t - e["seconds"], t))
            continue  # the gap runs on to the next start
        elif kind in ("export", "seed_runs"):
            seconds[kind] += e["seconds"]
            spans.append((kind, t - e["seconds"], t))
        last = t
        if kind == "finish":
            wall += t - launched
            launched = None
    if launched is not None:
        wall += latest - launched
    return wall


COLORS = {"kept": "tab:green", "lost": "tab:red", "scheduling": "tab:gray", "health_check": "tab:pink", "startup_build": "tab:blue",
          "startup_load": "tab:cyan", "replacement_wait": "lightgray", "restart": "tab:orange", "planned_restart": "gold", "hang": "tab:purple", "checkpoint_blocked": "black",
          "evaluation": "tab:olive", "export": "tab:brown",
          "seed_runs": "tab:cyan"}


def plot(report: dict, out: Path) -> Path:
    """The run's wall time as one bar per part, each interval where it happened: a restart, a hang and the work
    lost to them are where they were."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = report["spans"]
    t0 = min((s for _, s, _ in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    parts = [p for p in PARTS if any(name == p for name, _, _ in spans)]
    for y, part in enumerate(parts):
        ax.broken_barh([(s - t0, max(e - s, 1e-3)) for name, s, e in spans if name == part], (y - 0.4, 0.8),
                       color=COLORS.get(part, "gray"))
    ax.set_yticks(range(len(parts)), [f"{p} {report[p + '_seconds']:.1f} s" for p in parts], fontsize=8)
    ax.set_xlabel("seconds since the launch")
    ax.set_title(f"goodput: ETTR {report['ettr']:.1%} of {report['wall_seconds']:.0f} s", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(report: dict) -> str:
    """The breakdown as a Markdown section for LOGBOOK.md."""
    wall = report["wall_seconds"] or 1.0
    lines = ["## Goodput", "", f"Effective training time (ETTR): {report['ettr']:.1%} of {report['wall_seconds']:.1f} s "
             "of wall time went into steps the model kept.", "", "| part | seconds | share |", "|---|---:|---:|"]
    lines += [f"| {p} | {report[p + '_seconds']:.1f} | {report[p + '_seconds'] / wall:.1%} |" for p in PARTS]
    if report["kept_reduced_seconds"]:
        lines += ["", f"Of the kept time, {report['kept_reduced_seconds']:.1f} s trained on fewer replicas than configured "
                      "(train.elastic: resizes.jsonl says when and why)."]
    return "\n".join(lines) + "\n"

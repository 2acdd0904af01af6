"""The chronicles replay: OPT-175B's logbook of failures, injected into one tiny run on CPU.

    python benchmarks/replay.py [--steps 400] [--out /tmp/replay]

Two runs of `pipelines/full.py` on the sample corpus (configs/local.yaml: tiny model, 2 Ray
workers, ZeRO-0, fp32), same seed, same number of steps, the autopilot on in both:
- clean: no injection (its logbook should be empty: false alarms);
- replay: three loss spikes (the LR times 300 for one step), a loss-scale collapse (12
  overflowing steps; a simulated dynamic scaler, as there is no fp16 on CPU), NaN gradients, a
  worker killed and a hung step (train.hang_seconds 10).
Reports each injected failure, whether it was detected and what was done (logbook and
incidents), whether the run finished with no human action, its final loss against the clean
run's, and the steps lost (steps computed beyond the requested number, redone after rollbacks
and restarts).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)
from train import records  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def scenario(steps: int) -> list[dict]:
    at = lambda fraction: max(1, int(steps * fraction))  # noqa: E731
    return [
        {"kind": "spike", "step": at(0.30), "factor": 300},
        {"kind": "overflow", "step": at(0.375), "count": 12},
        {"kind": "spike", "step": at(0.50), "factor": 300},
        {"kind": "nan", "step": at(0.625)},
        {"kind": "spike", "step": at(0.725), "factor": 300},
        {"kind": "kill", "step": at(0.825)},
        {"kind": "hang", "step": at(0.90)},
    ]


def run(out: Path, steps: int, inject: list[dict]) -> dict:
    """One run; its results read from its run folder (written even when the stage stops)."""
    runs = out / "work" / "train" / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--workdir", str(out / "work"),
           "--set", f"train.max_steps={steps}", "--set", "train.hang_seconds=10",
           "--set", f"train.inject={json.dumps(inject)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    (folder,) = set(runs.iterdir()) - before
    return {"rc": proc.returncode, "summary": records.read_summary(folder), "logbook": records.read(folder, records.ENTRY),
            "incidents": records.read(folder, records.INCIDENT), "metrics": records.read(folder, records.STEP),
            "folder": folder}


def skipped_at(metrics: list[dict], step: int) -> bool:
    """Whether the update of `step` was skipped (its row says overflow) on any pass through it: a rollback
    runs a step again, and the later pass has no fault."""
    return any(m.get("overflow") for m in metrics if m.get("step") == step and "loss" in m)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default="/tmp/replay")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    clean = run(out, args.steps, [])
    faults = scenario(args.steps)
    replay = run(out, args.steps, faults)

    print(f"tiny model, {args.steps} steps, 2 CPU workers, ZeRO-0 fp32")
    print()
    print("| injected at step | failure | detected as | actions |")
    print("|---|---|---|---|")
    book = list(replay["logbook"])
    restarts = [i for i in replay["incidents"] if i["what"].startswith("resumed from")]
    for fault in faults:
        if fault["kind"] in ("kill", "hang"):
            what = "worker killed" if fault["kind"] == "kill" else "step hung"
            seen = [i for i in replay["incidents"] if i["step"] >= fault["step"] and
                    ("ending this worker" in i["what"] if fault["kind"] == "hang" else "injected kill" in i["what"])]
            print(f"| {fault['step']} | {what} | {'worker exit, Ray Train restart' if seen else 'not seen'} | "
                  f"restart from the newest checkpoint |")
            continue
        last = fault["step"] + fault.get("count", 1) + 10  # an incident this soon after it is its doing
        match = next((e for e in book if fault["step"] <= e["step"] <= last), None)
        if match is not None:
            book.remove(match)
            seen, done = f"{match['kind']} at step {match['step']}", ", ".join(match["actions"])
        elif skipped_at(replay["metrics"], fault["step"]):
            seen, done = "non-finite gradients: the update skipped", "none needed (weights untouched)"
        else:
            seen, done = "not detected", "-"
        label = {"spike": f"LR x {fault.get('factor')} for one step", "overflow": f"{fault.get('count')} overflowing steps",
                 "nan": "NaN gradients"}[fault["kind"]]
        print(f"| {fault['step']} | {label} | {seen} | {done} |")
    computed = sum(1 for m in replay["metrics"] if "loss" in m)
    clean_loss, replay_loss = clean["summary"].get("final_loss", float("nan")), replay["summary"].get("final_loss", float("nan"))
    print()
    print(f"- finished with no human action: {'yes' if replay['rc'] == 0 else 'no (exit ' + str(replay['rc']) + ')'}; "
          f"interventions: {len(replay['logbook'])}; restarts: {len(restarts)}; unmatched logbook entries: {len(book)}")
    print(f"- final loss: {replay_loss:.4f} against {clean_loss:.4f} for the clean run ({replay_loss / clean_loss - 1:+.1%})")
    print(f"- steps computed: {computed} for {args.steps} steps ({computed - args.steps} lost to rollbacks and restarts)")
    print(f"- false alarms on the clean run: {len(clean['logbook'])}")
    if replay["summary"].get("stopped"):
        print(f"- stopped: {replay['summary']['stopped']}")
    print(f"- logbook: {replay['folder'] / records.LOGBOOK_MD}; chart: the train stage's output/training.png")


if __name__ == "__main__":
    main()

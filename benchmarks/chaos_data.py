"""The data half's drill: a worker node lost in the middle of dedup or of normalize, on a local three-node Ray
cluster, and whether the stage still gives the clean run's output.

    python benchmarks/chaos.py --data dedup|normalize [--at PHASE] [--docs 40000] [--set KEY=VALUE ...] [--json]
                               [--out /tmp/chaos]   (its folder: /tmp/chaos-data)
    python benchmarks/chaos_data.py dedup|normalize [the same options]

The cluster is chaos.py's: a head without CPUs (cluster.yaml's) and two one-CPU nodes. bench_dedup's generator
(10% planted near-duplicates) goes through ingest and normalize once; then the stage runs clean, then again with
a fault: when the stage's partial folder shows that PHASE has begun (a file of that phase's appears), node 2 is
killed (its raylet and every worker on it, no grace) and a fresh node joins in its place, as the autoscaler would
launch one. Each run is `pipelines/full.py --only STAGE --force` in a driver of its own on the cluster
(RAY_ADDRESS), so Ray's task retries and lineage reconstruction are all the stage has. Identical means: the same
counts, and the same rows in the output and in every folder of rows set aside (dedup: duplicates/, near_eval/,
candidates/; normalize: dropped/, eval/). If the faulted run fails, it is run again without a fault, and that
rerun must be identical. `--set` passes a config override to every run: `ray.small_shuffle_mb=0` puts every
groupby on Ray Data's hash shuffle (SHUFFLE_V2), the path of a corpus's large exchanges.

`--json` prints {"stage", "killed_node", "at_phase", "identical", "seconds", "clean_seconds", "first_attempt",
"rerun_identical"}: seconds are the stage's own (its manifest's), a failed attempt's the driver's whole run. Exits 0 when the stage's output is identical, at the first attempt or at the rerun.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

# Where each phase first writes, under the stage's partial folder: the drill kills a node once that file exists.
# The first listed is the default --at (dedup: exact, as the recorded drills ran; decontamination runs before it).
PHASES = {
    "dedup": {"exact": "work/index/*", "decontamination": "work/decontaminated/*", "candidates": "work/bands/*",
              "verification": "work/shingles/*", "assembly": "work/removed-*", "output": "output/*"},
    "normalize": {"tasks": "output/*"},
}
ASIDE = {"dedup": ("duplicates", "near_eval", "candidates"), "normalize": ("dropped", "eval")}


def pipeline(root: Path, stages: str, address: str, overrides: list[str]) -> tuple[int, float, str]:
    """`stages` of the pipeline in a driver of its own on the cluster: (exit code, seconds, the log's tail)."""
    env = {**os.environ, "RAY_ADDRESS": address}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(root / "drill.yaml"),
                           "--only", stages, "--force", *(f"--set={o}" for o in overrides)],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, time.perf_counter() - start, (proc.stdout + proc.stderr)[-3000:]


def outputs(root: Path, stage: str) -> dict:
    """The stage's counts and a digest of the sorted rows of its output and of each folder it set aside."""
    import pyarrow.parquet as pq

    manifest = json.loads((root / "work" / stage / "manifest.json").read_text())
    folder = Path(manifest["output"]).parent
    found = {"counts": manifest["counts"]}
    for name in ("output", *ASIDE[stage]):
        rows = sorted(json.dumps(r, sort_keys=True) for p in sorted((folder / name).glob("*.parquet"))
                      for r in pq.read_table(p).to_pylist())
        found[name] = [len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]]
    return found


def stage_seconds(root: Path, stage: str) -> float:
    """The stage's own seconds, from its manifest (not the driver's start-up)."""
    return json.loads((root / "work" / stage / "manifest.json").read_text())["metrics"]["seconds"]


def kill_at(cluster, root: Path, stage: str, phase: str, done: threading.Event, record: dict) -> None:
    """Waits for `phase`'s first file in the stage's partial folder, then kills node 2 and starts its replacement."""
    pattern = PHASES[stage][phase]
    while not done.is_set():
        if any(any(p.glob(pattern)) for p in (root / "work" / stage).glob(".partial-*")):
            node = cluster.nodes[2]
            record["killed_node"] = cluster.node_id(2)
            cluster.cluster.remove_node(node, allow_graceful=False)
            record["killed_after"] = round(time.perf_counter() - record["start"], 1)
            cluster.start_node("chaos_node_2_replacement")
            return
        time.sleep(0.05)


def drill(stage: str, phase: str, docs: int, out: Path, overrides: list[str]) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_dedup import generate
    from chaos_cluster import Cluster

    out.mkdir(parents=True, exist_ok=True)
    data = out / "gen.jsonl"
    if not data.is_file():
        generate(data, docs, planted=0.1)
    (out / "drill.yaml").write_text(f"workdir: {out / 'work'}\n"
                                    f"sources: [{{name: gen, format: jsonl, id_field: id, paths: ['{data}']}}]\n")
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster()
    try:
        rc, _, log = pipeline(out, "ingest,normalize", cluster.cluster.address, overrides)
        if rc:
            raise SystemExit(f"ingest and normalize failed:\n{log}")
        if stage == "dedup":
            pipeline(out, "dedup", cluster.cluster.address, overrides)
        clean, clean_seconds = outputs(out, stage), stage_seconds(out, stage)
        record = {"start": time.perf_counter(), "killed_node": None}
        done = threading.Event()
        killer = threading.Thread(target=kill_at, args=(cluster, out, stage, phase, done, record), daemon=True)
        killer.start()
        rc, wall, log = pipeline(out, stage, cluster.cluster.address, overrides)
        seconds = stage_seconds(out, stage) if rc == 0 else wall
        done.set()
        killer.join(timeout=120)
        report = {"stage": stage, "killed_node": record["killed_node"], "at_phase": phase if record["killed_node"] else None,
                  "killed_after": record.get("killed_after"), "seconds": round(seconds, 1),
                  "clean_seconds": round(clean_seconds, 1), "first_attempt": "finished" if rc == 0 else f"failed: {log[-600:]}",
                  "rerun_identical": None}
        report["identical"] = rc == 0 and outputs(out, stage) == clean
        if rc:
            rerun, _, _ = pipeline(out, stage, cluster.cluster.address, overrides)
            report["rerun_identical"] = rerun == 0 and outputs(out, stage) == clean
    finally:
        cluster.shutdown()
    return report


def run(stage: str, phase: str | None, docs: int, out: Path, as_json: bool, overrides: list[str]) -> int:
    phase = phase or next(iter(PHASES[stage]))
    if phase not in PHASES[stage]:
        raise SystemExit(f"--at: {stage}'s phases are {', '.join(PHASES[stage])}")
    report = drill(stage, phase, docs, out, overrides)
    if as_json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0 if report["identical"] or report["rerun_identical"] else 1


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=sorted(PHASES))
    p.add_argument("--at", help="the phase at which node 2 dies (default: the stage's first)")
    p.add_argument("--docs", type=int, default=40_000, help="documents in the generated corpus")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, every run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="/tmp/chaos-data")
    return p


def main() -> int:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    return run(args.stage, args.at, args.docs, Path(args.out), args.json, args.set)


if __name__ == "__main__":
    sys.exit(main())

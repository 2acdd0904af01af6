"""What the screen costs on a laptop, and what packing proxy runs into Ray Train jobs saves.

    python benchmarks/bench_screen.py [--out /tmp/bench_screen]

configs/local.yaml on the sample corpus (8 Pile subsets + the baseline, 2 seeds: 18 proxy runs
of the tiny model, 60 steps each, 2 Ray Train jobs at a time). The screen stage runs twice on
the same dedup output, side by side: every proxy run its own Ray Train job (`runs_per_job: 1`,
the cluster configs' setting: the baseline) and 9 runs per job (the laptop config). Reports the
stage's seconds, seconds per proxy run and the ratio, and checks that both made the same
decisions with the same scores (packing changes where runs execute, not what they compute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def full(out: Path, *args: str) -> None:
    cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--workdir", str(out / "work"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def screen(out: Path, runs_per_job: int) -> dict:
    full(out, "--only", "screen", "--force", "--set", f"screen.runs_per_job={runs_per_job}")
    return json.loads((out / "work" / "screen" / "manifest.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/bench_screen")
    args = p.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    full(out, "--only", "ingest,normalize,dedup")
    results = {n: screen(out, n) for n in (1, 9)}
    commit = provenance.commit()
    print(f"commit {commit}; {provenance.machine()}, {os.cpu_count()} CPUs; "
          f"configs/local.yaml, sample corpus")
    runs = len(results[1]["proxy_runs"])
    print(f"{'runs per Ray Train job':<24} {'jobs':>5} {'screen s':>9} {'s per proxy run':>16}")
    for n, m in results.items():
        seconds = m["metrics"]["seconds"]
        print(f"{n:<24} {-(-runs // n):>5} {seconds:>9.1f} {seconds / runs:>16.2f}")
    ratio = results[9]["metrics"]["seconds"] / results[1]["metrics"]["seconds"]
    print(f"packed / one job per run: {ratio:.2f}x the time")
    same = results[1]["scores"] == results[9]["scores"] and results[1]["dropped_subsets"] == results[9]["dropped_subsets"]
    print(f"same scores and decisions: {same}; dropped {results[9]['dropped_subsets']}; "
          f"scores {results[9]['scores']} (baseline {results[9]['baseline_score']}, limit {results[9]['limit']})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

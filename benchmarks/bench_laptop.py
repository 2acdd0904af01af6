"""The laptop path, before and after: `python pipelines/full.py` from a fresh directory with the code of a
baseline commit and with the checked-out code, one after the other on this machine, same venv.

    .venv/bin/python benchmarks/bench_laptop.py [--baseline 82c6e2a] [--out /tmp/bench_laptop]
    .venv/bin/python benchmarks/bench_laptop.py --avx2 [--out /tmp/bench_laptop]

With --avx2 the two sides are the checked-out code on this CPU and on this CPU held to AVX2 (core/cpu.py's
AVX2_ONLY: oneDNN, ATen and MKL in every process, as on most laptops and AVX2-only AMD servers).

Each side: the first run's wall time (sample generation, Ray's start, every stage; what `make run`
costs after the install), each stage's own seconds (its manifest), and the wall time of the same
command again (every stage a cache hit). The baseline's tree is `git archive`d into OUT and put
first on PYTHONPATH, which Ray's workers inherit, so the driver and the workers both run it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402

from core.cpu import AVX2_ONLY  # noqa: E402  (provenance put the project's root on sys.path)

STAGES = ("ingest", "normalize", "dedup", "screen", "tokenize", "train")


def run_side(tree: Path, where: Path, cpu_env: dict[str, str] | None = None) -> dict:
    """Both runs of the default command with the code in `tree`, in the fresh directory `where`."""
    where.mkdir(parents=True)
    env = {**os.environ, **(cpu_env or {}), "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "pipelines" / "full.py")]
    t0 = time.perf_counter()
    first = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    t1 = time.perf_counter()
    second = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    t2 = time.perf_counter()
    for proc in (first, second):
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    stages = {s: json.loads((where / "work" / s / "manifest.json").read_text())["metrics"]["seconds"] for s in STAGES}
    return {"first": t1 - t0, "cached": t2 - t1, "stages": stages,
            "terminal_lines": len((first.stdout + first.stderr).splitlines())}


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="82c6e2a", help="the commit to compare with (default: before issue 20)")
    p.add_argument("--out", default="/tmp/bench_laptop")
    p.add_argument("--avx2", action="store_true", help="compare this CPU with itself held to AVX2, not two commits")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    if args.avx2:
        names = ("this CPU", "held to AVX2")
        results = {"baseline": run_side(ROOT, out / "native"), "now": run_side(ROOT, out / "avx2", AVX2_ONLY)}
        print(f"commit {provenance.commit()}; held to AVX2 by {' '.join(f'{k}={v}' for k, v in AVX2_ONLY.items())}")
    else:
        names = (f"baseline {args.baseline}", "now")
        base_tree = out / "baseline-tree"
        base_tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        results = {"baseline": run_side(base_tree, out / "baseline"), "now": run_side(ROOT, out / "now")}
        print(f"commit {provenance.commit()} against {args.baseline}")
    print()
    print(f"| | {names[0]} (s) | {names[1]} (s) | {names[1]} / {names[0]} |")
    print("|---|---|---|---|")
    b, n = results["baseline"], results["now"]
    rows = [(f"stage {s}", b["stages"][s], n["stages"][s]) for s in STAGES]
    rows += [("all stages", sum(b["stages"].values()), sum(n["stages"].values())),
             ("first run, wall (sample, Ray start, stages)", b["first"], n["first"]),
             ("rerun, all cache hits, wall", b["cached"], n["cached"])]
    for name, before, now in rows:
        print(f"| {name} | {before:.1f} | {now:.1f} | {now / before:.2f}x |")
    print(f"| lines on the terminal, first run | {b['terminal_lines']} | {n['terminal_lines']} | |")


if __name__ == "__main__":
    main()

"""The laptop path, before and after: `python pipelines/full.py` from a fresh directory with the code of a
baseline commit and with the checked-out code, one after the other on this machine, same venv.

    .venv/bin/python benchmarks/bench_laptop.py [--baseline 82c6e2a] [--rounds 1] [--out /tmp/bench_laptop]
    .venv/bin/python benchmarks/bench_laptop.py --avx2 [--out /tmp/bench_laptop]

With --avx2 the two sides are the checked-out code on this CPU and on this CPU held to AVX2 (core/cpu.py's
AVX2_ONLY: oneDNN, ATen and MKL in every process, as on most laptops and AVX2-only AMD servers).

Each side: the first run's wall time (sample generation, Ray's start, every stage; what `make run`
costs after the install), each stage's own seconds (its manifest) and the share of the machine's cores it
kept busy (/proc/stat), and the wall time of the same command again (every stage a cache hit). With
`--rounds N` the sides take turns N times (baseline, now, baseline, ...) and the table has each side's median:
a 2-core cloud machine's speed drifts by 15% and more over minutes, and turns spread that over both sides. The
baseline's tree is `git archive`d into OUT and put first on PYTHONPATH, which Ray's workers inherit, so the
driver and the workers both run it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402

from core.cpu import AVX2_ONLY  # noqa: E402  (provenance put the project's root on sys.path)

STAGES = ("ingest", "normalize", "dedup", "screen", "tokenize", "train", "downstream")


class CpuSampler:
    """The machine's busy and total CPU time (Linux's /proc/stat), sampled every half second in a thread: how much
    of the cores a stage kept busy. Idle is idle plus iowait; steal counts as busy, as the run could not have it."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
            self.samples.append((time.time(), sum(ticks) - ticks[3] - ticks[4], sum(ticks)))
            self.stop.wait(0.5)

    def __enter__(self) -> "CpuSampler":
        if Path("/proc/stat").is_file():
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def busy(self, start: float, end: float) -> float | None:
        """The share of all cores busy from `start` to `end` (seconds since the epoch), None without samples."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def run_side(tree: Path, where: Path, cpu_env: dict[str, str] | None = None) -> dict:
    """Both runs of the default command with the code in `tree`, in the fresh directory `where`."""
    where.mkdir(parents=True)
    env = {**os.environ, **(cpu_env or {}), "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "pipelines" / "full.py")]
    t0 = time.perf_counter()
    with CpuSampler() as cpu:
        first = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    t1 = time.perf_counter()
    second = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    t2 = time.perf_counter()
    for proc in (first, second):
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    manifests = {s: json.loads((where / "work" / s / "manifest.json").read_text()) for s in STAGES
                 if (where / "work" / s / "manifest.json").is_file()}  # an older baseline has fewer stages
    when = {s: [datetime.fromisoformat(m[k]).timestamp() for k in ("started", "finished")] for s, m in manifests.items()}
    return {"first": t1 - t0, "cached": t2 - t1, "stages": {s: m["metrics"]["seconds"] for s, m in manifests.items()},
            "busy": {s: cpu.busy(*when[s]) for s in manifests},  # the manifests' times are to the second
            "terminal_lines": len((first.stdout + first.stderr).splitlines())}


def median_of(runs: list[dict]) -> dict:
    """Each figure's median over a side's turns."""
    median = statistics.median
    return {"first": median([r["first"] for r in runs]), "cached": median([r["cached"] for r in runs]),
            "stages": {s: median([r["stages"][s] for r in runs]) for s in runs[0]["stages"]},
            "busy": {s: median(b) if (b := [r["busy"][s] for r in runs if r["busy"][s] is not None]) else None
                     for s in runs[0]["stages"]},
            "all": median([sum(r["stages"].values()) for r in runs]),
            "terminal_lines": median([r["terminal_lines"] for r in runs])}


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="82c6e2a", help="the commit to compare with (default: before issue 20)")
    p.add_argument("--out", default="/tmp/bench_laptop")
    p.add_argument("--avx2", action="store_true", help="compare this CPU with itself held to AVX2, not two commits")
    p.add_argument("--rounds", type=int, default=1, help="turns each side takes, one after the other (medians reported)")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    if args.avx2:
        names = ("this CPU", "held to AVX2")
        sides = {"baseline": (ROOT, None), "now": (ROOT, AVX2_ONLY)}
        print(f"commit {provenance.commit()}; held to AVX2 by {' '.join(f'{k}={v}' for k, v in AVX2_ONLY.items())}")
    else:
        names = (f"baseline {args.baseline}", "now")
        base_tree = out / "baseline-tree"
        base_tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        sides = {"baseline": (base_tree, None), "now": (ROOT, None)}
        print(f"commit {provenance.commit()} against {args.baseline}")
    turns: dict[str, list[dict]] = {side: [] for side in sides}
    for k in range(args.rounds):
        for side, (tree, cpu_env) in sides.items():
            turns[side].append(run_side(tree, out / f"{side}-{k}", cpu_env))
            print(f"round {k + 1} {side}: all stages {sum(turns[side][-1]['stages'].values()):.1f} s, "
                  f"first run {turns[side][-1]['first']:.1f} s", flush=True)
    results = {side: median_of(runs) for side, runs in turns.items()}
    print()
    print(f"| | {names[0]} (s) | {names[1]} (s) | {names[1]} / {names[0]} | cores busy, {names[0]} | cores busy, {names[1]} |")
    print("|---|---|---|---|---|---|")
    b, n = results["baseline"], results["now"]
    share = lambda side, s: "" if side["busy"].get(s) is None else f"{100 * side['busy'][s]:.0f}%"  # noqa: E731
    rows = [(f"stage {s}", b["stages"][s], n["stages"][s], share(b, s), share(n, s))
            for s in STAGES if s in b["stages"] and s in n["stages"]]
    rows += [("all stages", b["all"], n["all"], "", ""),
             ("first run, wall (sample, Ray start, stages)", b["first"], n["first"], "", ""),
             ("rerun, all cache hits, wall", b["cached"], n["cached"], "", "")]
    for name, before, now, busy_before, busy_now in rows:
        print(f"| {name} | {before:.1f} | {now:.1f} | {now / before:.2f}x | {busy_before} | {busy_now} |")
    print(f"| lines on the terminal, first run | {b['terminal_lines']} | {n['terminal_lines']} | | | |")


if __name__ == "__main__":
    main()

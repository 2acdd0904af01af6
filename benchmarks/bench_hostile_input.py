"""One ingest reader's peak memory on hostile input, against a normal file, and against the readers of a baseline
commit: a zstd bomb (zeros, about 32,000 to 1) and a file of one very long line.

    .venv/bin/python benchmarks/bench_hostile_input.py [--baseline e6c038c] [--bomb-gb 10] [--line-mb 1024]
                                                       [--baseline-bomb-gb 2] [--baseline-line-mb 64]

Each case reads the file with `read_jsonl` in a fresh process and reports its peak resident memory (ru_maxrss)
and what the reader yielded. The baseline's readers (`git show BASELINE:corpus/readers.py`) read smaller
versions of the same files: at full size they would hold the whole bomb, and re-split the whole line at
every chunk.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402

READ = """
import importlib.util, json, resource, sys, time
sys.path.insert(0, {root!r})
spec = importlib.util.spec_from_file_location("readers_under_test", {module!r})
readers = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = readers  # its dataclasses look their module up there
spec.loader.exec_module(readers)
began = time.perf_counter()
rows = [(r["reason"] or "document")[:60] for r in readers.read_jsonl({path!r}, "web", "x")]
print(json.dumps({{"rows": rows, "seconds": time.perf_counter() - began,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def zstd_file(path: Path, pieces, level: int = 3) -> Path:
    """A .zst file written piece by piece (never whole in memory here)."""
    import zstandard

    with open(path, "wb") as f, zstandard.ZstdCompressor(level=level).stream_writer(f) as writer:
        for piece in pieces:
            writer.write(piece)
    return path


def random_words(rng, n: int) -> str:
    """Words of 2-9 random letters: they compress less than text (about 1.7 to 1), so a file takes many reads."""
    import numpy as np

    letters = rng.integers(97, 123, n * 6, dtype=np.uint8).tobytes().decode()
    cuts = np.cumsum(rng.integers(2, 10, n))
    return " ".join(letters[a:b] for a, b in zip([0, *cuts[:-1]], cuts) if b <= len(letters))


def cases(folder: Path, bomb_gb: float, line_mb: int) -> dict[str, Path]:
    """A normal file, a bomb and a file whose second line is `line_mb` MiB of random letters (which compress
    little, so the line arrives over hundreds of reads, as a real long line does)."""
    import numpy as np

    mib, rng = 1 << 20, np.random.default_rng(0)
    normal = (json.dumps({"text": random_words(rng, 150)}).encode() + b"\n" for _ in range(50_000))
    line = itertools.chain([b'{"text": "before"}\n{"text": "'],
                           (rng.integers(97, 123, mib, dtype=np.uint8).tobytes() for _ in range(line_mb)),
                           [b'"}\n{"text": "after"}\n'])
    return {"normal (50k documents)": zstd_file(folder / "normal.jsonl.zst", normal),
            f"zstd bomb ({bomb_gb:g} GB of zeros)": zstd_file(folder / "bomb.jsonl.zst",
                                                              (b"\0" * (64 * mib) for _ in range(int(bomb_gb * 16)))),
            f"one line of {line_mb} MiB": zstd_file(folder / "line.jsonl.zst", line)}


def measure(module: Path, path: Path) -> dict:
    code = READ.format(root=str(ROOT), module=str(module), path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout)


def describe(result: dict) -> str:
    if "error" in result:
        return f"failed: {result['error'][:80]}"
    rows = result["rows"]
    kinds = sorted(set(rows), key=rows.index)
    return "; ".join(f"{rows.count(k)} x {k}" for k in kinds)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="e6c038c")
    p.add_argument("--bomb-gb", type=float, default=10)
    p.add_argument("--line-mb", type=int, default=1024)
    p.add_argument("--baseline-bomb-gb", type=float, default=2)
    p.add_argument("--baseline-line-mb", type=int, default=64)
    return p


def main() -> int:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        baseline = folder / "baseline_readers.py"
        baseline.write_text(subprocess.run(["git", "show", f"{args.baseline}:corpus/readers.py"], cwd=ROOT,
                                           capture_output=True, text=True, check=True).stdout)
        (folder / "now").mkdir()
        (folder / "then").mkdir()
        began = time.perf_counter()
        now = cases(folder / "now", args.bomb_gb, args.line_mb)
        then = cases(folder / "then", args.baseline_bomb_gb, args.baseline_line_mb)
        print(f"(files written in {time.perf_counter() - began:.0f} s)\n")
        print("| file | compressed | readers | peak memory (MB) | seconds | what it yielded |")
        print("|---|---:|---|---:|---:|---|")
        for (label, path), (then_label, then_path) in zip(now.items(), then.items()):
            for name, module, file, shown in (("now", ROOT / "corpus" / "readers.py", path, label),
                                               (f"baseline {args.baseline}", baseline, then_path, then_label)):
                result = measure(module, file)
                peak = f"{result['peak_mb']:,.0f}" if "peak_mb" in result else "-"
                seconds = f"{result['seconds']:.1f}" if "seconds" in result else "-"
                print(f"| {shown} | {file.stat().st_size:,} B | {name} | {peak} | {seconds} | {describe(result)} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

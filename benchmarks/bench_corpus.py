"""Ingest and normalize throughput: MB/s per core, and the Ray Data stage against a bare loop.

    python benchmarks/bench_corpus.py [--mb 200] [--out /tmp/bench_corpus]

Generates a Pile-format corpus of about `--mb` MB of text (`*.jsonl.zst`, 16 files, 5% of the
documents with mojibake or messy whitespace, as the sample corpus plants them), then measures,
in one run on this machine:

- baseline, one process, no Ray: for ingest, the stage's own task function over every file
  (readers + Parquet writes); for normalize, a bare loop of `normalize_text` (ftfy + regexes)
  over ingest's documents, writing nothing;
- the stages as `pipelines/full.py --only ingest,normalize --force` runs them, on a local Ray
  limited to 1 CPU and then to all cores. Stage time is the manifest's `seconds` (Ray start-up
  is not counted; writing the Parquet output is, and so is the first Ray Data execution's
  start of its worker processes, about 1.5 s, which lands on ingest).

It prints a Markdown table (for docs/benchmarks.md): MB/s, MB/s per core, and each stage's time
as a ratio to the bare loop (the overhead of the stage: < 1.3x on 1 core is the target, and
below 1x with more cores).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corpus.ingest import read_task, read_task_for  # noqa: E402
from corpus.normalize import normalize_text  # noqa: E402
from corpus.parts import iter_rows, parquet_files  # noqa: E402
from corpus.readers import relative_names  # noqa: E402
from corpus.sample import PILE_SUBSETS_KEPT_BY_OPT, _rng, messy, prose  # noqa: E402
from corpus.config import NormalizeConfig, SourceConfig  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

FILES = 16


def generate(out: Path, mb: int) -> int:
    """~mb MB of Pile documents in FILES .jsonl.zst files; returns the bytes of text."""
    out.mkdir(parents=True, exist_ok=True)
    per_file, total = mb * 1_000_000 // FILES, 0
    for f in range(FILES):
        buf, size, i = io.BytesIO(), 0, 0
        with zstandard.ZstdCompressor(level=3).stream_writer(buf, closefd=False) as w:
            while size < per_file:
                rng = _rng(7, f, i)
                text = prose(rng, (4, 12))
                if i % 20 == 0:
                    text = messy(rng, text, "mojibake" if i % 40 == 0 else "whitespace")
                subset = PILE_SUBSETS_KEPT_BY_OPT[i % len(PILE_SUBSETS_KEPT_BY_OPT)]
                w.write(json.dumps({"text": text, "meta": {"pile_set_name": subset}}).encode() + b"\n")
                size += len(text.encode())
                i += 1
        (out / f"{f:02d}.jsonl.zst").write_bytes(buf.getvalue())
        total += size
    return total


def bare_ingest(files: list[str], scratch: Path) -> float:
    """The ingest task's own function over every file in this process: readers + Parquet writes."""
    folders = {k: str(scratch / k) for k in ("output", "rejected", "subset_not_kept", "records")}
    source = SourceConfig(name="pile", format="pile", paths=files)
    sizes = {f: os.path.getsize(f) for f in files}
    task = read_task_for(source, files, relative_names(files), sizes, "bare", folders, fail_on_bad_input=False)
    t0 = time.perf_counter()
    read_task(task)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(scratch)
    return elapsed


def bare_normalize(docs_folder: str) -> float:
    config = NormalizeConfig()
    t0 = time.perf_counter()
    for path in parquet_files(docs_folder):
        for row in iter_rows(path, columns=["text"]):
            normalize_text(row["text"], config)
    return time.perf_counter() - t0


def run_stages(config: Path, cpus: int) -> dict[str, float]:
    cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(config),
           "--only", "ingest,normalize", "--force", "--set", f"ray.num_cpus={cpus}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workdir = config.parent / "work"
    return {s: json.loads((workdir / s / "manifest.json").read_text())["metrics"]["seconds"] for s in ("ingest", "normalize")}


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--out", default="/tmp/bench_corpus")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    text_bytes = generate(out / "pile", args.mb)
    mb = text_bytes / 1e6
    config = out / "bench.yaml"
    config.write_text(f"workdir: {out}/work\n"
                      f"sources: [{{name: pile, format: pile, paths: ['{out}/pile/*.jsonl.zst']}}]\n")

    cores = os.cpu_count() or 1
    stage = {1: run_stages(config, 1), cores: run_stages(config, cores)}
    ingest_docs = json.loads((out / "work" / "ingest" / "manifest.json").read_text())["output"]
    files = sorted(str(p) for p in (out / "pile").glob("*.zst"))
    bare = {"ingest": bare_ingest(files, out / "bare"), "normalize": bare_normalize(ingest_docs)}

    print(f"{mb:.0f} MB of text in {FILES} files")
    print()
    print("| stage | run | seconds | MB/s | MB/s per core | time vs bare loop |")
    print("|---|---|---|---|---|---|")
    for name in ("ingest", "normalize"):
        print(f"| {name} | bare loop, 1 process | {bare[name]:.1f} | {mb / bare[name]:.1f} | {mb / bare[name]:.1f} | 1.00x |")
        for cpus in sorted(stage):
            s = stage[cpus][name]
            print(f"| {name} | stage, Ray on {cpus} CPU{'s' if cpus > 1 else ''} | {s:.1f} | {mb / s:.1f} | {mb / s / cpus:.1f} | {s / bare[name]:.2f}x |")


if __name__ == "__main__":
    main()

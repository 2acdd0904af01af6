"""Tokenize stage throughput against a bare encode_batch loop, and the loader against a training step.

    python benchmarks/bench_tokenize.py [--mb 100] [--out /tmp/bench_tokenize] [--reuse] [--skip-stage] [--skip-loader]

Stage: generates a Pile-format corpus of about `--mb` MB (bench_corpus's generator), runs
ingest, normalize and dedup once, then `pipelines/full.py --only tokenize --force` on a local Ray
limited to 1 CPU and then to all cores (seq_len 2048, a BPE of up to 8192 ids trained on a 16 MB
sample). Stage time is the manifest's `seconds` (all of it: tokenizer training, encode, the
shuffle, packing and writing the shards), split into its phases. The baseline, in this process:
the stage's own tokenizer, `Tokenizer.encode_batch` over the same documents (in memory) in
chunks of 1024, one thread (TOKENIZERS_PARALLELISM=false), nothing written.

Loader: token shards of random ids at seq_len 2048 (uint16), of two sizes 10x apart; 2000
global batches of 8 sequences each from a seeded epoch order; batches per second and the
process's anonymous memory (RssAnon: what the loader holds, as opposed to the page cache of
the memory-mapped shards) before and after. Baseline: one training step of OPT-125M on this
CPU (forward + backward + AdamW, one sequence of 2048 tokens), fp32, torch only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_corpus import generate  # noqa: E402
from corpus import tokenizer  # noqa: E402
from corpus.parts import parquet_files  # noqa: E402
from corpus.tokenize import FORMAT, INDEX, write_rows  # noqa: E402
from train.loader import Loader  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

SEQ_LEN = 2048


def full(config: Path, *args: str) -> None:
    cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(config), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def manifest(workdir: Path, stage: str) -> dict:
    return json.loads((workdir / stage / "manifest.json").read_text())


def bare_encode(tok_path: str, docs_folder: str) -> tuple[float, int]:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tokenizer.load(tok_path)
    texts = [t for p in parquet_files(docs_folder) for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()]
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(texts), 1024):
        tokens += sum(len(e.ids) + 1 for e in tok.encode_batch([t.rstrip() for t in texts[start:start + 1024]],
                                                              add_special_tokens=False))
    return time.perf_counter() - t0, tokens


def stage(args: argparse.Namespace, out: Path, cores: int) -> None:
    config = out / "bench.yaml"
    if args.reuse and (out / "work" / "dedup" / "manifest.json").is_file():
        text_bytes = sum(len(t.encode()) for p in parquet_files(manifest(out / "work", "dedup")["output"])
                         for t in pq.read_table(p, columns=["text"]).column("text").to_pylist())
    else:
        shutil.rmtree(out, ignore_errors=True)
        text_bytes = generate(out / "pile", args.mb)
    config.write_text(
        f"workdir: {out}/work\n"
        f"sources: [{{name: pile, format: pile, paths: ['{out}/pile/*.jsonl.zst']}}]\n"
        "tokenize: {seq_len: 2048, tokenizer: {kind: train, vocab_size: 8192, train_bytes: 16000000}}\n")
    if not (out / "work" / "dedup" / "manifest.json").is_file():
        full(config, "--only", "ingest,normalize,dedup")
    runs = {}
    for cpus in sorted({1, cores}):
        full(config, "--only", "tokenize", "--force", "--set", f"ray.num_cpus={cpus}")
        runs[cpus] = manifest(out / "work", "tokenize")["metrics"]
    output = manifest(out / "work", "tokenize")["output"]
    bare, tokens = bare_encode(str(Path(output) / tokenizer.FILE), manifest(out / "work", "dedup")["output"])
    index = json.loads((Path(output) / INDEX).read_text())
    assert tokens == index["train"]["tokens"]  # dedup's output: the evaluation set left at normalize

    print(f"{text_bytes / 1e6:.0f} MB of text, {tokens / 1e6:.1f}M tokens (seq_len {SEQ_LEN}, vocab {index['tokenizer_vocab_size']})")
    print()
    print("| run | seconds | tokens/s | tokens/s per core | time vs bare loop | tokenizer | encode + shuffle | pack |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| bare encode_batch loop, 1 thread | {bare:.1f} | {tokens / bare:,.0f} | {tokens / bare:,.0f} | 1.00x | | | |")
    for cpus, m in runs.items():
        s = m["seconds"]
        print(f"| stage, Ray on {cpus} CPU{'s' if cpus > 1 else ''} | {s:.1f} | {tokens / s:,.0f} | {tokens / s / cpus:,.0f} | "
              f"{s / bare:.2f}x | {m['seconds.tokenizer']:.1f} | {m['seconds.encode_shuffle']:.1f} | {m['seconds.pack']:.1f} |")
    print()


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_shards(folder: Path, sequences: int, seq_len: int = SEQ_LEN, vocab: int = 50272) -> None:
    """Token shards of random ids, as the tokenize stage lays them out (bench_train.py uses them too)."""
    rng = np.random.default_rng(0)
    block, per_shard, shards = seq_len + 1, 8192, []
    for k, first in enumerate(range(0, sequences, per_shard)):
        n = min(per_shard, sequences - first)
        write_rows(folder / "train" / f"{k:05d}.arrow", rng.integers(4, vocab, (n, block), dtype=np.uint16))
        shards.append({"file": f"train/{k:05d}.arrow", "sequences": n})
    (folder / INDEX).write_text(json.dumps({
        "format": FORMAT, "seq_len": seq_len, "block": block, "dtype": "uint16", "vocab_size": vocab, "eos_id": 2,
        "sequences": sequences, "train": {"sequences": sequences, "shards": shards}, "eval": {"units": []}}))


def loader_rate(folder: Path, batches: int, batch: int) -> tuple[float, float, float]:
    before = rss_anon_mb()
    loader = Loader(folder, batch, seed=0)
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - t0
    return batches / elapsed, before, rss_anon_mb()


def step_seconds() -> float:
    import torch

    from model.configs import get
    from model.opt import OPT

    torch.manual_seed(0)
    model = OPT(get("125m"))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.randint(4, 50272, (1, SEQ_LEN + 1))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return min(times[1:])  # the first step allocates Adam's state


def loader(args: argparse.Namespace, out: Path) -> None:
    batch, batches = 8, 2000
    rows = []
    for sequences in (args.loader_sequences, 10 * args.loader_sequences):
        folder = Path(tempfile.mkdtemp(dir=out))
        make_shards(folder, sequences)
        size = sum(f.stat().st_size for f in folder.rglob("*.arrow")) / 1e6
        rate, before, after = loader_rate(folder, batches, batch)
        rows.append((sequences, size, rate, before, after))
        shutil.rmtree(folder)
    step = step_seconds()
    print(f"Loader: {batches} global batches of {batch} sequences x {SEQ_LEN + 1} tokens, seeded epoch order")
    print()
    print("| shards | on disk | batches/s | sequences/s | RssAnon before -> after | OPT-125M CPU step / loading its sequence |")
    print("|---|---|---|---|---|---|")
    for sequences, size, rate, before, after in rows:
        print(f"| {sequences:,} sequences | {size:,.0f} MB | {rate:,.0f} | {rate * batch:,.0f} | {before:.0f} -> {after:.0f} MB | "
              f"{step * rate * batch:,.0f}x |")
    print()
    print(f"OPT-125M training step on this CPU (1 x {SEQ_LEN} tokens, fwd + bwd + AdamW, fp32): {step:.2f} s")


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--loader-sequences", type=int, default=20_000)
    p.add_argument("--out", default="/tmp/bench_tokenize")
    p.add_argument("--skip-stage", action="store_true")
    p.add_argument("--skip-loader", action="store_true")
    p.add_argument("--reuse", action="store_true", help="reuse the corpus and dedup output of a previous run in --out")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    out = Path(args.out)
    if not args.reuse:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    print()
    if not args.skip_stage:
        stage(args, out, cores)
    if not args.skip_loader:
        loader(args, out)


if __name__ == "__main__":
    main()

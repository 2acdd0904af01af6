"""Dedup quality against brute force and datasketch's LSH, and the stage's time and memory at scale.

    python benchmarks/bench_dedup.py quality [--docs 20000]
    python benchmarks/bench_dedup.py scale [--docs 100000 400000]

quality: a generated corpus with duplicates planted at known Jaccard (exact copies, whitespace
variants, one-word edits, chains a~b~c with a and c below the threshold, variants just above
and just below 0.95, far variants at 0.7-0.9) goes through `pipelines/full.py --only
ingest,normalize,dedup`. Ground truth is brute force: the exact Jaccard of every pair of
normalized documents that share at least one shingle (all other pairs have J = 0), from an
inverted index. Reported: recall on pairs >= 0.95 (both ends in one cluster), documents removed
without any partner >= 0.95 (wrong merges), and, on the same signatures' input,
datasketch MinHashLSH(threshold=0.95, num_perm=128)'s candidate recall and its candidates below
the threshold (it has no verification step).

scale: the same generator at 100k and 400k documents: the dedup stage's seconds (manifest),
the driver's peak RSS, and the peak memory of the whole machine while the stage runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corpus.sample import WORDS, _rng, prose  # noqa: E402
from dedup.minhash import MinHasher, jaccard_of_sets  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)


def edit(rng: random.Random, text: str, changes: int) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), changes):
        words[i] = rng.choice([w for w in WORDS if w != words[i]])
    return " ".join(words)


def generate(path: Path, docs: int, seed: int = 5) -> dict:
    """`docs` documents as jsonl; a fifth of them planted variants of the others."""
    rng = random.Random(seed)
    base_count = docs * 4 // 5
    texts = [prose(_rng(seed, i), (2, 4)) for i in range(base_count)]
    kinds: dict[str, int] = {}
    while len(texts) < docs:
        src = texts[rng.randrange(base_count)]
        kind = rng.choice(["exact", "whitespace", "one word", "chain", "just above", "just below", "far"])
        if kind == "exact":
            new = [src]
        elif kind == "whitespace":
            new = [src.replace(" ", "  ", 5).replace(". ", ".\n\n", 2) + "  \n"]
        elif kind == "one word":
            new = [edit(rng, src, 1)]
        elif kind == "chain":
            b = edit(rng, src, 1)
            new = [b, edit(rng, b, 1)]
        elif kind in ("just above", "just below"):
            n = len(src.split(" "))
            # ~5 shingles change per edited word: J ~ (S - 5e) / (S + 5e) with S ~ n shingles
            e = max(1, int(n * 0.05 / 2.05 / 5) + (kind == "just below"))
            new = [edit(rng, src, e)]
        else:
            new = [edit(rng, src, rng.randint(3, 10))]
        kinds[kind] = kinds.get(kind, 0) + len(new)
        texts.extend(new)
    texts = texts[:docs]
    with path.open("w") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"id": f"d{i:07d}", "text": t}) + "\n")
    return kinds


def run_pipeline(root: Path, data: Path) -> tuple[dict, float, float]:
    """The pipeline up to dedup; returns (dedup manifest, driver peak RSS MB, machine peak used MB)."""
    config = root / "bench.yaml"
    config.write_text(f"workdir: {root}/work\n"
                      f"sources: [{{name: gen, format: jsonl, id_field: id, paths: ['{data}']}}]\n")
    cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(config), "--only", "ingest,normalize,dedup", "--force"]
    base = psutil.virtual_memory().used
    peak = [0]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = psutil.Process(proc.pid)
    driver_peak = [0]

    def watch() -> None:
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], psutil.virtual_memory().used - base)
                driver_peak[0] = max(driver_peak[0], driver.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    if proc.wait() != 0:
        raise SystemExit(f"pipeline failed: {' '.join(cmd)}")
    watcher.join()
    manifest = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
    return manifest, driver_peak[0] / 2**20, peak[0] / 2**20


def ground_truth(ids: list[str], texts: list[str], threshold: float) -> tuple[set, set]:
    """Brute force: exact Jaccard of every pair sharing a shingle; (pairs >= threshold, pairs below)."""
    sets = MinHasher().shingle_sets(texts)
    doc = np.repeat(np.arange(len(sets)), [len(s) for s in sets])
    shingle = np.concatenate(sets)
    order = np.argsort(shingle, kind="stable")
    shingle, doc = shingle[order], doc[order]
    starts = np.flatnonzero(np.concatenate([[True], shingle[1:] != shingle[:-1]]))
    ends = np.append(starts[1:], len(shingle))
    pairs = set()
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        members = sorted(set(doc[s:e].tolist()))
        pairs.update((members[i], members[j]) for i in range(len(members)) for j in range(i + 1, len(members)))
    above, below = set(), set()
    for i, j in pairs:
        (above if jaccard_of_sets(sets[i], sets[j]) >= threshold else below).add(tuple(sorted((ids[i], ids[j]))))
    return above, below


def datasketch_candidates(ids: list[str], texts: list[str]) -> set:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=0.95, num_perm=128)
    hashes = MinHash.bulk([[" ".join(w[i : i + 5]).encode() for i in range(max(len(w) - 4, 1))]
                           for w in (t.lower().split() for t in texts)], num_perm=128)
    for i, m in zip(ids, hashes):
        lsh.insert(i, m)
    out = set()
    for i, m in zip(ids, hashes):
        out.update(tuple(sorted((i, j))) for j in lsh.query(m) if j != i)
    return out


def quality(docs: int, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    kinds = generate(root / "gen.jsonl", docs)
    manifest, _, _ = run_pipeline(root, root / "gen.jsonl")
    normalized = pq.read_table(json.loads((root / "work" / "normalize" / "manifest.json").read_text())["output"]).to_pylist()
    ids, texts = [r["id"] for r in normalized], [r["text"] for r in normalized]
    above, below = ground_truth(ids, texts, 0.95)
    folder = Path(manifest["output"]).parent
    dups = {r["id"]: r["kept_id"] for r in pq.read_table(folder / "duplicates").to_pylist()}
    cluster = lambda i: dups.get(i, i)  # noqa: E731
    found = sum(cluster(a) == cluster(b) for a, b in above)
    partners = {x for pair in above for x in pair}
    wrong = [i for i in dups if i not in partners]
    verified = {(r["a"], r["b"]) for r in pq.read_table(folder / "candidates").to_pylist() if r["jaccard"] >= 0.95}
    false_merges = len({tuple(sorted(p)) for p in verified} - above)
    ds = datasketch_candidates(ids, texts)
    commit = provenance.commit()
    print(f"{len(ids)} normalized documents, planted {kinds}; commit {commit}; {platform.machine()}, 2 cores")
    print(f"ground truth: {len(above)} pairs >= 0.95, {len(below)} pairs in (0, 0.95) sharing a shingle")
    print()
    print("| method | recall on pairs >= 0.95 | pairs < 0.95 merged or proposed | removed without a partner >= 0.95 |")
    print("|---|---|---|---|")
    print(f"| dedup stage ({manifest['metrics']['bands']:.0f} bands x {manifest['metrics']['rows']:.0f} rows, verified) "
          f"| {found / max(len(above), 1):.4f} ({found}/{len(above)}) | {false_merges} merged "
          f"| {len(wrong)} |")
    print(f"| datasketch MinHashLSH(threshold=0.95) candidates | {len(ds & above) / max(len(above), 1):.4f} "
          f"({len(ds & above)}/{len(above)}) | {len(ds & below)} proposed (no verification) | - |")
    print(f"\nstage: {manifest['metrics']['candidate_pairs']:.0f} candidate pairs checked, "
          f"{manifest['metrics']['verified_pairs']:.0f} verified, {manifest['counts']['duplicate']} removed, "
          f"{manifest['metrics']['seconds']:.1f} s")


def scale(sizes: list[int], root: Path) -> None:
    commit = provenance.commit()
    print(f"commit {commit}; {platform.machine()}, 2 cores, {psutil.virtual_memory().total / 2**30:.0f} GiB")
    print()
    print("| documents | MB of text | dedup stage seconds | docs/s | driver peak RSS (whole run) | machine peak used (whole run) |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        folder = root / f"scale-{n}"
        folder.mkdir(parents=True, exist_ok=True)
        generate(folder / "gen.jsonl", n)
        mb = (folder / "gen.jsonl").stat().st_size / 1e6
        manifest, driver, machine = run_pipeline(folder, folder / "gen.jsonl")
        s = manifest["metrics"]["seconds"]
        print(f"| {n:,} | {mb:.0f} | {s:.1f} | {n / s:,.0f} | {driver:,.0f} MB | {machine:,.0f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["quality", "scale"])
    parser.add_argument("--docs", type=int, nargs="+")
    parser.add_argument("--out", default="/tmp/bench_dedup")
    args = parser.parse_args()
    if args.what == "quality":
        quality((args.docs or [20000])[0], Path(args.out) / "quality")
    else:
        scale(args.docs or [100000, 400000], Path(args.out))


if __name__ == "__main__":
    main()

"""Dedup quality against brute force, datasketch's LSH and datatrove, and the stage's time, memory and
shuffled bytes at scale against an earlier commit.

    python benchmarks/bench_dedup.py quality [--docs 20000]
    python benchmarks/bench_dedup.py scale [--docs 100000 400000] [--baseline 57f9f91] [--planted 0.2]
    python benchmarks/bench_dedup.py components [--edges 1000000 4000000]

quality: a generated corpus with duplicates planted at known Jaccard (exact copies, whitespace
variants, one-word edits, chains a~b~c with a and c below the threshold, variants just above
and just below 0.95, far variants at 0.7-0.9) goes through `pipelines/full.py --only
ingest,normalize,dedup`. Ground truth is brute force: the exact Jaccard of every pair of
normalized documents that share at least one shingle (all other pairs have J = 0), from an
inverted index. Reported: recall on pairs >= 0.95 (both ends in one cluster), documents removed
without any partner >= 0.95 (wrong merges), and, on the same signatures' input,
datasketch MinHashLSH(threshold=0.95, num_perm=128)'s candidate recall and its candidates below
the threshold (it has no verification step); and datatrove's MinHash pipeline (signatures,
buckets, cluster, filter; the same 10 bands x 12 rows and 5-grams, 2 workers) on the same
normalized documents: its wall time against the stage's, its recall and its merges below 0.95.

scale: the same generator at each size, through `--only ingest,normalize,dedup` with the checked-out
code and with `--baseline`'s (its tree `git archive`d, one after the other on the same corpus): the
dedup stage's seconds (manifest), the driver's peak RSS, the machine's peak memory while the
pipeline runs, and the bytes each phase's groupbys took in (Ray Data's block sizes, measured
the same way on both sides: the baseline's `grouped` is patched to record them). Ingest and
normalize run once per size; each side then runs its dedup stage alone on their output, so the
peaks (driver, largest Ray worker, all workers, the object store in /dev/shm, the machine) are
dedup's own.

components: the stage's two components paths on a generated graph shaped like dedup's (clusters
of Zipf-distributed size, half of them stars as exact copies make, half chains, the worst case
for rounds, on keys in random order): the one-task min-label propagation (its time and its peak
traced allocation) against the large-star/small-star rounds on Ray Data (time, rounds, peak
worker RSS), and that both give the same labels.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
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


def generate(path: Path, docs: int, seed: int = 5, planted: float = 0.2) -> dict:
    """`docs` documents as jsonl; a fraction `planted` of them variants of the others."""
    rng = random.Random(seed)
    base_count = round(docs * (1 - planted))
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


def ray_workers() -> list[tuple[int, str, int]]:
    """(pid, title, RSS) of every Ray worker process on this machine: a worker titles itself `ray::<what it runs>`
    (`ray::MapBatches(verify)`, `ray::IDLE`)."""
    return [(p.pid, p.info["cmdline"][0], p.info["memory_info"].rss)
            for p in psutil.process_iter(["cmdline", "memory_info"])
            if (p.info["cmdline"] or [""])[0].startswith("ray::") and p.info["memory_info"]]


def ray_workers_rss() -> list[int]:
    """The RSS of every Ray worker process on this machine."""
    return [rss for _, _, rss in ray_workers()]


def rss_anon(pid: int) -> int:
    """A process's private resident memory (RssAnon), in bytes; 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) << 10 for line in fh if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def run_pipeline(root: Path, data: Path, tree: Path = ROOT, stages: str = "ingest,normalize,dedup",
                 workdir: Path | None = None, path: tuple[str, ...] = (), samples: list | None = None,
                 config_extra: str = "") -> tuple[dict, dict]:
    """`stages` of the pipeline, with the code in `tree` (and `path` after it on PYTHONPATH); returns (dedup
    manifest, peak MB of memory: the driver's RSS, the largest Ray worker's RSS, all workers' RSS together, the
    object store (/dev/shm) and the machine's used memory, each above what it was before the run). `samples`, if
    given, gets every Ray worker's (seconds, pid, title, RssAnon MB: its private memory, without the object store's
    pages it maps) every 0.5 s, for a caller that attributes them;
    `config_extra`: YAML lines added to the run's config."""
    root.mkdir(parents=True, exist_ok=True)
    workdir = workdir or root / "work"
    config = root / "bench.yaml"
    # No evaluation set: every document is training, as in the ground truth (the quality's recall counts removals
    # in duplicates/; an evaluation document's near-copies would leave as near_eval instead).
    config.write_text(f"workdir: {workdir}\neval: {{fraction: 0}}\n"
                      f"sources: [{{name: gen, format: jsonl, id_field: id, paths: ['{data}']}}]\n{config_extra}")
    cmd = [sys.executable, str(tree / "pipelines" / "full.py"), "--config", str(config), "--only", stages, "--force"]
    base, shm_base = psutil.virtual_memory().used, psutil.disk_usage("/dev/shm").used
    peak = dict.fromkeys(["driver", "worker", "workers", "object store", "machine"], 0)
    # Ray's workers must import the tree's code (they put the driver's directory first on sys.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *path])}
    log = root / "pipeline.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tree)
    driver = psutil.Process(proc.pid)

    samples, began = samples if samples is not None else [], time.time()

    def watch() -> None:
        while proc.poll() is None:
            try:
                titled = ray_workers()
                samples.extend((round(time.time() - began, 1), pid, title, rss_anon(pid) / 2**20) for pid, title, _ in titled)
                workers = [rss for _, _, rss in titled]
                now = {"driver": driver.memory_info().rss, "worker": max(workers, default=0), "workers": sum(workers),
                       "object store": psutil.disk_usage("/dev/shm").used - shm_base,
                       "machine": psutil.virtual_memory().used - base}
                for k, v in now.items():
                    peak[k] = max(peak[k], v)
            except psutil.Error:
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    if proc.wait() != 0:
        raise SystemExit(f"pipeline failed: {' '.join(cmd)} (log: {log})")
    watcher.join()
    manifest = json.loads((workdir / "dedup" / "manifest.json").read_text()) if "dedup" in stages else {}
    return manifest, {k: v / 2**20 for k, v in peak.items()}


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


def datatrove_dedup(ids: list[str], texts: list[str], root: Path) -> tuple[float, dict[str, int], set[str]]:
    """datatrove's MinHash pipeline on these documents (as jsonl, read by its own reader), our banding and
    5-grams, 2 workers: (seconds from its signatures to its filtered output, {id: its cluster} for the
    documents in a cluster, the removed ids)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    data = root / "datatrove-in"
    data.mkdir(parents=True, exist_ok=True)
    shards = 4
    for k in range(shards):
        with (data / f"{k}.jsonl").open("w") as fh:
            for i in range(k, len(ids), shards):
                fh.write(json.dumps({"id": ids[i], "text": texts[i]}) + "\n")
    out = root / "datatrove"
    config = MinhashConfig(n_grams=5, num_buckets=10, hashes_per_bucket=12, hash_config=HashConfig(precision=64))
    logs = str(out / "logs")
    read = lambda: JsonlReader(str(data), text_key="text", id_key="id")  # noqa: E731
    steps = [
        LocalPipelineExecutor([read(), MinhashDedupSignature(str(out / "sigs"), config=config)], tasks=shards, workers=2,
                              logging_dir=f"{logs}/1"),
        LocalPipelineExecutor([MinhashDedupBuckets(str(out / "sigs"), str(out / "buckets"), config=config)],
                              tasks=config.num_buckets, workers=2, logging_dir=f"{logs}/2"),
        LocalPipelineExecutor([MinhashDedupCluster(str(out / "buckets"), str(out / "remove"), config=config,
                                                   save_cluster_id=True)], tasks=1, logging_dir=f"{logs}/3"),
        LocalPipelineExecutor([read(), MinhashDedupFilter(str(out / "remove"), load_cluster_ids=True,
                                                          exclusion_writer=JsonlWriter(str(out / "removed"))),
                               JsonlWriter(str(out / "kept"))], tasks=shards, workers=2, logging_dir=f"{logs}/4"),
    ]
    start = time.perf_counter()
    for step in steps:
        step.run()
    seconds = time.perf_counter() - start
    cluster: dict[str, int] = {}
    removed: set[str] = set()
    for kind in ("removed", "kept"):
        for path in (out / kind).glob("*.jsonl.gz"):
            with gzip.open(path, "rt") as fh:
                for line in fh:
                    row = json.loads(line)
                    if kind == "removed":
                        removed.add(row["id"])
                    if "minhash_cluster_id" in row.get("metadata", {}):
                        cluster[row["id"]] = row["metadata"]["minhash_cluster_id"]
    return seconds, cluster, removed


def quality(docs: int, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    kinds = generate(root / "gen.jsonl", docs)
    manifest, _ = run_pipeline(root, root / "gen.jsonl")
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
    dt_seconds, dt_cluster, dt_removed = datatrove_dedup(ids, texts, root)
    dt_of = lambda i: dt_cluster.get(i, i)  # noqa: E731
    dt_found = sum(dt_of(a) == dt_of(b) for a, b in above)
    dt_below = sum(dt_of(a) == dt_of(b) for a, b in below)
    dt_wrong = [i for i in dt_removed if i not in partners]
    print(f"{len(ids)} normalized documents, planted {kinds}")
    print(f"ground truth: {len(above)} pairs >= 0.95, {len(below)} pairs in (0, 0.95) sharing a shingle")
    print()
    print("| method | recall on pairs >= 0.95 | pairs < 0.95 merged or proposed | removed without a partner >= 0.95 |")
    print("|---|---|---|---|")
    print(f"| dedup stage ({manifest['metrics']['bands']:.0f} bands x {manifest['metrics']['rows']:.0f} rows, verified) "
          f"| {found / max(len(above), 1):.4f} ({found}/{len(above)}) | {false_merges} merged "
          f"| {len(wrong)} |")
    print(f"| datasketch MinHashLSH(threshold=0.95) candidates | {len(ds & above) / max(len(above), 1):.4f} "
          f"({len(ds & above)}/{len(above)}) | {len(ds & below)} proposed (no verification) | - |")
    print(f"| datatrove 0.10 MinHash (10 x 12, no verification) | {dt_found / max(len(above), 1):.4f} "
          f"({dt_found}/{len(above)}) | {dt_below} merged | {len(dt_wrong)} |")
    print(f"\nwall time on the same {len(ids):,} normalized documents, 2 cores: dedup stage "
          f"{manifest['metrics']['seconds']:.1f} s; datatrove (signatures, buckets, cluster, filter) {dt_seconds:.1f} s, "
          f"{len(dt_removed)} removed")
    print(f"\nstage: {manifest['metrics']['candidate_pairs']:.0f} candidate pairs checked, "
          f"{manifest['metrics']['verified_pairs']:.0f} verified, {manifest['counts']['duplicate']} removed, "
          f"{manifest['metrics']['seconds']:.1f} s")


BASELINE_GROUPED = """    def grouped(ds):  # by `part`, which takes `partitions` values; sized by the documents, which the joins carry
        return groupby(ds, "part", nbytes, ctx.config.ray, num_partitions=partitions)
"""
MEASURED_GROUPED = """    def grouped(ds):  # (bench_dedup.py: each groupby's input measured, as the current stage measures its own)
        ds = ds.materialize()
        with open(ctx.folder / "shuffled.txt", "a") as fh:
            fh.write(f"{ds.size_bytes()}\\n")
        return groupby(ds, "part", nbytes, ctx.config.ray, num_partitions=partitions)
"""


def baseline_tree(commit: str, out: Path, measured: bool = True) -> Path:
    """The baseline's tree; `measured`: its dedup stage patched to write each groupby's input bytes beside its
    output (for a baseline from before the stage measured them itself)."""
    tree = out / f"tree-{commit}"
    if not tree.is_dir():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        stage = tree / "dedup" / "stage.py"
        text = stage.read_text()
        if measured and BASELINE_GROUPED not in text:
            raise SystemExit(f"{commit}'s dedup/stage.py has no grouped() to measure")
        stage.write_text(text.replace(BASELINE_GROUPED, MEASURED_GROUPED))
    return tree


def scale(sizes: list[int], root: Path, baseline: str, planted: float) -> None:
    tree = baseline_tree(baseline, root)
    print(f"commit {provenance.commit()} against {baseline}; "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; {planted:.0%} of the documents planted duplicates")
    print()
    print("| documents | MB of text | code | dedup seconds | peak MB: driver / largest worker / all workers / object store / machine "
          "| MB shuffled (by phase) |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        folder = root / f"scale-{n}-{planted}"
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "gen.jsonl").is_file():
            generate(folder / "gen.jsonl", n, planted=planted)
        mb = (folder / "gen.jsonl").stat().st_size / 1e6
        # Ingest and normalize once (their code is the same on both sides), then each side's dedup alone
        # on that output: --force reruns only the selected stage, so the memory peaks are dedup's own.
        run_pipeline(folder, folder / "gen.jsonl", ROOT, "ingest,normalize", folder / "work")
        for name, code in ((baseline, tree), ("now", ROOT)):
            manifest, peak = run_pipeline(folder / name, folder / "gen.jsonl", code, "dedup", folder / "work")
            m = manifest["metrics"]
            if name == baseline:
                sizes_in = [int(x) for x in (Path(manifest["output"]).parent / "shuffled.txt").read_text().split()]
                phases = {"candidates": sizes_in[0], "verification": sum(sizes_in[1:])}  # its three groupbys
            else:
                phases = {k.split(".", 1)[1]: v for k, v in m.items() if k.startswith("shuffled_bytes.")}
            total = sum(phases.values())
            detail = ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in phases.items())
            memory = " / ".join(f"{v:,.0f}" for v in peak.values())
            print(f"| {n:,} | {mb:.0f} | {name} | {m['seconds']:.1f} | {memory} "
                  f"| {total / 1e6:,.1f} ({detail}) |", flush=True)


def dedup_like_graph(edges: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """About `edges` undirected edges (u > v) over int64 keys: clusters of Zipf(2) size up to 100k,
    each a star (exact copies of one text) or a chain (near-duplicates one edit apart)."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.zipf(2.0, size=edges), 100_000)
    sizes = sizes[np.cumsum(sizes) <= edges]  # a cluster of s + 1 documents has s edges
    first = np.concatenate([[0], np.cumsum(sizes + 1)[:-1]])  # each cluster's first node
    cluster = np.repeat(np.arange(len(sizes)), sizes)
    k = np.arange(len(cluster)) - np.repeat(np.cumsum(sizes) - sizes, sizes) + 1  # 1..s within a cluster
    star = rng.random(len(sizes)) < 0.5
    a = first[cluster] + k
    b = np.where(star[cluster], first[cluster], a - 1)
    nodes = int((sizes + 1).sum())
    keys = np.unique(rng.integers(0, 1 << 62, size=int(nodes * 1.01) + 16))[:nodes]
    keys = rng.permutation(keys)  # random key order: chains are then the most rounds
    u, v = keys[a], keys[b]
    return np.maximum(u, v), np.minimum(u, v)


def components(sizes: list[int]) -> None:
    import tracemalloc

    import pyarrow as pa
    import ray
    import ray.data

    from dedup.components import components_in_one_task, components_on_ray
    from dedup.config import DedupConfig
    from core.ray_session import RayConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"{psutil.virtual_memory().total / 2**30:.0f} GiB of memory\n")
    print("| edges | documents | components | largest | one task: s | one task: peak MB | Ray Data: s | rounds "
          "| Ray Data: peak worker MB | same labels |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        u, v = dedup_like_graph(n)
        tracemalloc.start()
        t = time.perf_counter()
        expected = components_in_one_task(u, v)
        one_s, one_peak = time.perf_counter() - t, tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        nbytes = u.nbytes * 2
        ds = ray.data.from_arrow(pa.table({"u": u, "v": v})).repartition(max(2, nbytes // (16 << 20))).materialize()
        peak, done = [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], max(ray_workers_rss(), default=0))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t = time.perf_counter()
        labels, rounds, _ = components_on_ray(ds, nbytes, RayConfig(), bound=DedupConfig().task_documents)  # as in the stage
        got = pa.concat_tables(labels.iter_batches(batch_format="pyarrow"))
        ray_s = time.perf_counter() - t
        done.set()
        watcher.join()
        same = dict(zip(got["node"].to_numpy().tolist(), got["root"].to_numpy().tolist())) == expected
        roots = collections.Counter(expected.values())
        print(f"| {len(u):,} | {len(expected):,} | {len(roots):,} | {max(roots.values()):,} | {one_s:.1f} | {one_peak:,.0f} "
              f"| {ray_s:.1f} | {rounds} | {peak[0] / 2**20:,.0f} | {same} |", flush=True)
    ray.shutdown()


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["quality", "scale", "components"])
    p.add_argument("--edges", type=int, nargs="+", default=[1_000_000, 4_000_000], help="components: graph sizes")
    p.add_argument("--docs", type=int, nargs="+")
    p.add_argument("--out", default="/tmp/bench_dedup")
    p.add_argument("--baseline", default="57f9f91", help="scale: the commit to compare with (default: before issue 19)")
    p.add_argument("--planted", type=float, default=0.2, help="scale: the fraction of documents that are planted duplicates")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    if args.what == "quality":
        quality((args.docs or [20000])[0], Path(args.out) / "quality")
    elif args.what == "components":
        components(args.edges)
    else:
        scale(args.docs or [100000, 400000], Path(args.out), args.baseline, args.planted)


if __name__ == "__main__":
    main()

"""The dedup stage at corpus scale, on its own code path, against an earlier commit in the same run.

    python benchmarks/bench_dedup_scale.py [--docs 400000 1200000 3600000] [--hot 20000] [--hot-at 400000:80000]
                                           [--baseline cb30c0f]
    python benchmarks/bench_dedup_scale.py --groupby
    python benchmarks/bench_dedup_scale.py --references
    python benchmarks/bench_dedup_scale.py --small
    python benchmarks/bench_dedup_scale.py --phases [--task-documents N]
    python benchmarks/bench_dedup_scale.py --driver [--driver-docs 150000 600000] [--repeats 1]

For each size: bench_dedup's generator (10% planted near-duplicates, a tenth of them exact), plus a hot cluster
(one text and `--hot` one-word edits of it: a band bucket of all of them, and one component), through ingest
and normalize with each side's code (each its own workdir: the groupby each runs is part of what is compared);
then each side's dedup alone in a fresh process on that output (`--only dedup --force`). `--hot-at N:H` adds a run at N documents with a hot cluster of H instead, to show
what grows with the largest duplicate cluster.

Recorded per run: the dedup stage's seconds per document; the driver's peak RSS and the peak bytes in its Ray
memory store (`get_local_memory_store_bytes_used`, the counter Ray Data warns on), both sampled inside the
driver every 0.05 s by a sitecustomize on the driver's path; the largest Ray worker's RSS (object-store pages it
maps included) sampled from outside; and, from our code's metrics, the most documents one verification and one
assembly task held, and the most rows of one key (a text, a band bucket, a node) one task of the exact,
candidates and components phases grouped (`-`: the phase grouped none on that path). The driver's growth is reported per document between the smallest and the largest size.

--groupby: the cause of the driver's growth, alone: one sort-path groupby of 96 MB in 60 blocks, against the same
repartitioned to blocks of SORT_BLOCK_BYTES first (core/ray_session.py: groupby).
--references: the hash shuffle's cost on the driver, alone: the references it holds for M map tasks and P
partitions, with the shards in the object store and on disk (`ray.disk_shuffle`).
--small: a small groupby's seconds on each path of core/ray_session.py's groupby (sort; hash on the object store;
hash on disk), alternating in one Ray session: whether the sort path still earns its place for small inputs.
--phases: where a worker's memory goes. For each hot cluster size, ingest, normalize and dedup in one run, then dedup
alone on their output (`--force`); each Ray worker's private memory (RssAnon) and title (`ray::MapBatches(verify)`: the function it
runs) sampled every 0.5 s, and each sample put to the phase whose function the worker runs, or last ran (an idle
worker holds what its last task left). Reports the largest worker per phase, this commit only.
--driver: the driver over ingest, normalize and dedup in one run (`--only ingest,normalize,dedup --force`), at each
of --driver-docs (no hot cluster), the sizes in turn `--repeats` times: its private memory (RssAnon) at each stage's
end and its peak while each stage ran, sampled inside it every 0.05 s; glibc's bytes in use and free (held) at the
end; and the growth of each from the smallest size to each larger one, per document, with each round's growth of
the peak over the three stages (the issue's measure) and their spread. This commit only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)
from bench_dedup import baseline_tree, edit, generate, run_pipeline  # noqa: E402

# Runs in every process with the probe folder on its path; samples only in the pipeline's driver: its peak RSS and
# Ray memory store (every 0.05 s), and its private memory (RssAnon) per stage: at the stage's start and end, its peak
# while the stage ran (stage "start": before the first, Ray's start included; "finish": after the last, the summary
# and MLflow), and glibc's bytes in use and free, held (mallinfo2) at each stage's end.
PROBE = textwrap.dedent('''
    import atexit, ctypes, json, os, sys, threading, time
    if sys.argv and sys.argv[0].endswith("full.py") and os.environ.get("DRIVER_PROBE_OUT"):
        # The driver's one glibc arena (core/heap.py) before this probe's thread first allocates. Started first, the
        # thread got an arena of its own, which the driver's later threads then shared at random: up to 10 MB of
        # the driver's memory in a second arena, from run to run, that the driver without the probe never has.
        try:
            from core.heap import one_arena
        except ImportError:  # a tree from before it (--baseline): its driver keeps glibc's arenas, as it did
            pass
        else:
            one_arena()
        _peak, _lock, _stopped = {"rss": 0, "memory_store": 0, "stages": {}}, threading.Lock(), []
        _now = ["start"]

        class _Mallinfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                            "fsmblks", "uordblks", "fordblks", "keepcost")]

        def _anon():
            with open("/proc/self/status") as fh:
                return next(int(line.split()[1]) << 10 for line in fh if line.startswith("RssAnon:"))

        def _heap():
            try:
                fn = ctypes.CDLL(None).mallinfo2
            except (OSError, AttributeError):
                return {}
            fn.restype = _Mallinfo2
            m = fn()
            return {"glibc_in_use": m.uordblks + m.hblkhd, "glibc_free": m.fordblks}

        def _stage(name):
            return _peak["stages"].setdefault(name, {"peak": 0})

        def _stop_then(shutdown):  # Ray's core worker must not be read once it is shut down (a fatal error)
            def wrapped(*args, **kwargs):
                with _lock:
                    _stopped.append(True)
                return shutdown(*args, **kwargs)
            return wrapped

        def _timed(run_logged):  # core.dag.Runner._run_logged: one stage
            def wrapped(self, tracker, stage, *args, **kwargs):
                _stage(stage.name)["start"] = _anon()
                _now[0] = stage.name
                try:
                    return run_logged(self, tracker, stage, *args, **kwargs)
                finally:
                    _stage(stage.name).update(end=_anon(), **_heap())
                    _now[0] = "finish"
            return wrapped

        def _sample():
            import psutil
            me = psutil.Process()
            while True:
                anon = _anon()
                s = _stage(_now[0])
                s["peak"] = max(s["peak"], anon)
                _peak["rss"] = max(_peak["rss"], me.memory_info().rss)
                dag = sys.modules.get("core.dag")
                if dag is not None and hasattr(dag, "Runner") and not hasattr(dag.Runner._run_logged, "__probe__"):
                    dag.Runner._run_logged = _timed(dag.Runner._run_logged)
                    dag.Runner._run_logged.__probe__ = True
                ray = sys.modules.get("ray")
                if ray is not None and hasattr(ray, "shutdown") and not hasattr(ray.shutdown, "__probe__"):
                    ray.shutdown = _stop_then(ray.shutdown)
                    ray.shutdown.__probe__ = True
                with _lock:
                    worker = sys.modules.get("ray._private.worker")
                    glob = getattr(worker, "global_worker", None) if worker else None
                    if not _stopped and glob is not None and getattr(glob, "connected", False):
                        _peak["memory_store"] = max(_peak["memory_store"], glob.core_worker.get_local_memory_store_bytes_used())
                time.sleep(0.05)

        threading.Thread(target=_sample, daemon=True).start()

        def _write():
            _stage("finish").update(end=_anon(), **_heap())
            open(os.environ["DRIVER_PROBE_OUT"], "w").write(json.dumps(_peak))
        atexit.register(_write)
''')


def corpus(folder: Path, docs: int, hot: int) -> Path:
    """bench_dedup's corpus of `docs` documents, then `hot` one-word edits of one more text (ids h*)."""
    data = folder / "gen.jsonl"
    if not data.is_file():
        generate(data, docs, planted=0.1)
        rng = random.Random(17)
        base = " ".join(json.loads(line)["text"] for _, line in zip(range(4), data.open()))  # ~4 documents long
        with data.open("a") as fh:
            for i in range(hot):
                fh.write(json.dumps({"id": f"h{i:07d}", "text": edit(rng, base, 1)}) + "\n")
    return data


def one_run(folder: Path, data: Path, name: str, tree: Path, probe: Path) -> dict:
    out = folder / f"probe-{name}.json"
    os.environ["DRIVER_PROBE_OUT"] = str(out)
    manifest, peak = run_pipeline(folder / name, data, tree, "dedup", folder / f"work-{name}", path=(str(probe),))
    driver = json.loads(out.read_text())
    m = manifest["metrics"]
    return {"seconds": m["seconds"], "rows": manifest["counts"]["rows_in"], "driver": driver["rss"] / 2**20,
            "store": driver["memory_store"] / 2**20, "worker": peak["worker"],
            "verify": m.get("largest_task_documents.verification"), "assembly": m.get("largest_task_documents.assembly"),
            "keys": [m.get(f"largest_key_rows.{phase}") for phase in ("exact", "candidates", "components")],
            "removed": manifest["counts"]["duplicate"] + manifest["counts"].get("near_eval", 0)}


def peak_while(measure, interval: float, work) -> tuple[float, float]:
    """`work()`, with `measure()` sampled every `interval` s beside it: (its peak above where it started, seconds)."""
    import threading
    import time

    base, peak, stop = measure(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], measure() - base)
            time.sleep(interval)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return peak[0], seconds


def groupby_memory(rows: int = 4_000_000, blocks: int = 60) -> None:
    """One groupby on the sort path (what `core.ray_session.groupby` runs below `ray.small_shuffle_mb`) of `rows` rows
    in `blocks` blocks, as given and repartitioned first to SORT_BLOCK_BYTES blocks (what it does now): the peak
    growth of the driver's Ray memory store, sampled every 10 ms, and the seconds."""
    import numpy as np
    import pyarrow as pa
    import ray
    import ray.data
    from ray.data.context import ShuffleStrategy

    from core.ray_session import SORT_BLOCK_BYTES

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    core = ray._private.worker.global_worker.core_worker
    table = pa.table({"part": np.arange(rows) % 97, "key": np.arange(rows, dtype=np.int64), "h": np.arange(rows, dtype=np.int64)})
    print("| rows | MB | input blocks | groupby's blocks | driver memory store peak MB | seconds |\n|---|---|---|---|---|---|")
    for repartition in (False, True):
        ds = ray.data.from_arrow(table).repartition(blocks).materialize()
        nbytes = ds.size_bytes()
        ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        n = max(1, -(-nbytes // SORT_BLOCK_BYTES)) if repartition else blocks
        src = ds.repartition(n) if repartition else ds
        peak, seconds = peak_while(core.get_local_memory_store_bytes_used, 0.01, lambda: src.groupby("part").map_groups(
            lambda g: g.slice(0, 1), batch_format="pyarrow").materialize())
        print(f"| {rows:,} | {nbytes / 1e6:.0f} | {blocks} | {n} | {peak / 1e6:.1f} | {seconds:.1f} |")


def hash_references(rows: int = 2_000_000, blocks: int = 40, partitions: int = 50) -> None:
    """One groupby on the hash shuffle (SHUFFLE_V2) with each input block its own map task (M = `blocks`) and
    `partitions` partitions (P), on the object store and on disk (`ray.disk_shuffle`): the peak number of object
    references the driver holds (its core worker's reference table, sampled every 5 ms), and the seconds."""
    import numpy as np
    import pyarrow as pa
    import ray
    import ray.data

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    core = ray._private.worker.global_worker.core_worker
    table = pa.table({"part": np.arange(rows) % 997, "key": np.arange(rows, dtype=np.int64)})
    print("| shards on | M x P | driver references, peak | seconds |\n|---|---|---|---|")
    for disk in (False, True):
        ds = ray.data.from_arrow(table).repartition(blocks).materialize()
        ds.context.use_disk_based_hash_shuffle = disk
        ds.context.shuffle_input_batch_bytes = 0  # a map task per input block, as at corpus scale with M = bytes / 1 GiB
        peak, seconds = peak_while(lambda: len(core.get_all_reference_counts()), 0.005, lambda: ds.groupby(
            "part", num_partitions=partitions).map_groups(lambda g: g.slice(0, 1), batch_format="pyarrow").materialize())
        print(f"| {'disk' if disk else 'object store'} | {blocks} x {partitions} | {peak:,} | {seconds:.1f} |")


def small_groupby(rows: int = 60_000, blocks: int = 8, repeats: int = 4) -> None:
    """A small groupby (about 1.5 MB, as the sample's dedup runs), through `core.ray_session.groupby` on each of its
    paths: the sort shuffle (below `ray.small_shuffle_mb`), and the hash shuffle (SHUFFLE_V2) with its shards in the
    object store and on disk. The paths alternate, `repeats` rounds, in one Ray session: each path's first call
    (what a stage pays once) and its median."""
    import statistics
    import time

    import numpy as np
    import pyarrow as pa
    import ray
    import ray.data

    from core.ray_session import RayConfig, groupby

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    table = pa.table({"part": np.arange(rows) % 97, "key": np.arange(rows, dtype=np.int64), "h": np.arange(rows, dtype=np.int64)})
    paths = {"sort": RayConfig(small_shuffle_mb=256), "hash, object store": RayConfig(small_shuffle_mb=0, disk_shuffle=False),
             "hash, disk": RayConfig(small_shuffle_mb=0, disk_shuffle=True)}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    nbytes = 0
    for _ in range(repeats):
        for name, cfg in paths.items():
            ds = ray.data.from_arrow(table).repartition(blocks).materialize()
            nbytes = ds.size_bytes()
            start = time.perf_counter()
            groupby(ds, "part", nbytes, cfg).map_groups(lambda g: g.slice(0, 1), batch_format="pyarrow").materialize()
            seconds[name].append(time.perf_counter() - start)
    print(f"| path ({rows:,} rows, {nbytes / 1e6:.1f} MB, {blocks} blocks) | first s | median s of {repeats} |\n|---|---|---|")
    for name, xs in seconds.items():
        print(f"| {name} | {xs[0]:.2f} | {statistics.median(xs):.2f} |")


# The phase of each function our stages run on Ray (what a worker's title names); the rest are Ray Data's own.
PHASES = {
    "ingest": ("read_task", "split_threads_task", "partial"),
    "normalize": ("normalize_task",),
    "decontamination": ("index_part", "merge_index", "training_part"),
    "exact": ("index_task", "exact_groups", "kept_copies", "heavy_copies"),
    "candidates": ("band_task", "keyed_band_rows", "group_pairs", "unit_rows", "boundary_pairs"),
    "verification": ("candidate_keys", "shingle_rows", "pairs_keyed", "verify"),
    "assembly": ("assemble_in_one_task", "near_edges", "copy_edges", "_undirected", "_directed", "star", "heavy_star",
                 "_star_labels", "node_rows", "nodes_reduced", "label_rows", "component_rows", "components_reduced",
                 "salted", "joined_rows", "leaving_group", "tally_removed", "tally_sizes"),
    "output": ("filter_task",),
}
PHASE_OF = {name: phase for phase, names in PHASES.items() for name in names}
BEFORE = "Ray's own, before any task"


def by_phase(samples: list) -> dict[str, float]:
    """run_pipeline's samples -> the largest worker's RssAnon (MB) seen in each phase: a worker's sample counts for the
    phase of the function its title names, else (idle, reading, shuffling) for the phase of the last it ran."""
    import re

    last: dict[int, str] = {}
    peak: dict[str, float] = {}
    for _, pid, title, mb in sorted(samples):
        named = [PHASE_OF[w] for w in re.findall(r"\w+", title) if w in PHASE_OF]
        phase = last[pid] = named[-1] if named else last.get(pid, BEFORE)
        peak[phase] = max(peak.get(phase, 0.0), mb)
    return peak


def phases(docs: int, hots: list[int], task_documents: int | None, root: Path) -> None:
    extra = f"dedup: {{task_documents: {task_documents}}}\n" if task_documents else ""
    order = [BEFORE, *PHASES]
    print(f"commit {provenance.commit()}; {docs:,} documents (10% planted duplicates) and a hot cluster; dedup.task_documents "
          f"{task_documents or 'default'}; the largest Ray worker's private memory (RssAnon, MB) while each phase ran (or last ran)\n")
    print(f"| hot cluster | stages | {' | '.join(order)} | dedup s | removed |\n|{'---|' * (len(order) + 4)}")
    for hot in hots:
        folder = root / f"n{docs}-hot{hot}"
        folder.mkdir(parents=True, exist_ok=True)
        data, work = corpus(folder, docs, hot), folder / "work"
        for stages in ("ingest,normalize,dedup", "dedup"):
            samples: list = []
            manifest, _ = run_pipeline(folder / stages.replace(",", "-"), data, ROOT, stages, work, samples=samples,
                                       config_extra=extra)
            peak = by_phase(samples)
            removed = manifest["counts"]["duplicate"] + manifest["counts"].get("near_eval", 0)
            print(f"| {hot:,} | {stages} | {' | '.join(f'{peak[p]:,.0f}' if p in peak else '-' for p in order)} "
                  f"| {manifest['metrics']['seconds']:.1f} | {removed:,} |", flush=True)


def driver(sizes: list[int], repeats: int, root: Path) -> None:
    probe = root / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    rows: dict[int, int] = {}
    for _ in range(repeats):
        for n in sizes:
            folder = root / f"n{n}"
            folder.mkdir(parents=True, exist_ok=True)
            out = folder / "probe.json"
            os.environ["DRIVER_PROBE_OUT"] = str(out)
            manifest, _ = run_pipeline(folder / "run", corpus(folder, n, 0), ROOT, "ingest,normalize,dedup",
                                       folder / "work", path=(str(probe),))
            rows[n] = manifest["counts"]["rows_in"]
            runs[n].append(json.loads(out.read_text())["stages"])
    MB = 2**20
    small = min(sizes)

    larger = [n for n in sizes if n != small]

    def per_document(by_size: dict[int, list[int]], n: int) -> float:
        """Bytes per document from the smallest size to `n`, on each size's mean over its runs."""
        return (statistics.mean(by_size[n]) - statistics.mean(by_size[small])) / (rows[n] - rows[small])

    def growths(by_size: dict[int, list[int]]) -> str:
        return " | ".join(f"{per_document(by_size, n):+.1f}" for n in larger)

    print(f"commit {provenance.commit()}; the driver over ingest, normalize and dedup in one run, no hot cluster, "
          f"{repeats} run(s) at each size (a cell: each run's figure); private memory (RssAnon) and glibc's, MB\n")
    print(f"| stage | figure | {' | '.join(f'{rows[n]:,} documents' for n in sizes)} | "
          f"{' | '.join(f'bytes per document, {rows[small]:,} to {rows[n]:,}' for n in larger)} |")
    print("|---|---|" + "---|" * (len(sizes) + len(larger)))
    order = ["start", "ingest", "normalize", "dedup", "finish"]
    figures = [("peak", "peak while it ran"), ("end", "at its end"), ("glibc_in_use", "glibc in use, at its end"),
               ("glibc_free", "glibc free (held), at its end")]
    for stage in order:
        for key, label in figures:
            cells = {n: [r[stage][key] for r in runs[n] if key in r.get(stage, {})] for n in sizes}
            if not all(cells.values()):
                continue
            print(f"| {stage} | {label} | {' | '.join(' / '.join(f'{v / MB:,.0f}' for v in c) for c in cells.values())} "
                  f"| {growths(cells)} |", flush=True)
    peaks = {n: [max(s["peak"] for s in r.values()) for r in runs[n]] for n in sizes}
    print(f"\nThe driver's peak over the run: {' -> '.join('/'.join(f'{v / MB:,.0f}' for v in peaks[n]) for n in sizes)} "
          f"MB; bytes per document from {rows[small]:,}: "
          + ", ".join(f"{per_document(peaks, n):+.1f} to {rows[n]:,}" for n in larger))
    # Two runs of one size differ by up to 8 MB before either reads a document (Ray's start): each run's peak
    # over its own peak then, the growth that the documents can have caused.
    own = {n: [max(s["peak"] for s in r.values()) - r["start"]["peak"] for r in runs[n]] for n in sizes}
    print(f"Each run's peak over its own before the first stage: "
          f"{' -> '.join('/'.join(f'{v / MB:+,.0f}' for v in own[n]) for n in sizes)} MB; bytes per document from "
          f"{rows[small]:,}: " + ", ".join(f"{per_document(own, n):+.1f} to {rows[n]:,}" for n in larger))
    # The measure: the peak while ingest, normalize and dedup ran (the summary and MLflow after them set the
    # run's peak, the same at every size). Each round's own figure too: the sizes ran in turn, so a round's runs
    # share the host's hour, and the rounds' spread is the figure's noise.
    stages = {n: [max(r[s]["peak"] for s in ("ingest", "normalize", "dedup")) for r in runs[n]] for n in sizes}
    for n in larger:
        rounds = [(b - a) / (rows[n] - rows[small]) for a, b in zip(stages[small], stages[n])]
        print(f"The peak over the three stages, {rows[small]:,} to {rows[n]:,} documents: "
              f"{'/'.join(f'{v / MB:,.0f}' for v in stages[small])} -> {'/'.join(f'{v / MB:,.0f}' for v in stages[n])} MB; "
              f"bytes per document, each round: {', '.join(f'{v:+.1f}' for v in rounds)}; "
              f"mean {statistics.mean(rounds):+.1f}" + (f", sd {statistics.stdev(rounds):.1f}" if len(rounds) > 1 else ""))


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, nargs="+", default=[400_000, 1_200_000, 3_600_000])
    p.add_argument("--hot", type=int, default=20_000)
    p.add_argument("--hot-at", default="400000:80000", help="N:H, a run at N documents with a hot cluster of H")
    p.add_argument("--baseline", default="cb30c0f", help="the commit to compare with (default: before issue 44)")
    p.add_argument("--out", default="/tmp/bench_dedup_scale")
    p.add_argument("--groupby", action="store_true", help="only the sort-path groupby's driver memory, as given and "
                                                           "in SORT_BLOCK_BYTES blocks")
    p.add_argument("--references", action="store_true", help="only the hash shuffle's driver references, on the "
                                                              "object store and on disk")
    p.add_argument("--small", action="store_true", help="only a small groupby's seconds on each of its paths: "
                                                         "sort, hash on the object store, hash on disk")
    p.add_argument("--phases", action="store_true", help="only the largest worker per phase, for each of --phase-hot")
    p.add_argument("--phase-docs", type=int, default=20_000, help="--phases: the corpus's documents before its hot cluster")
    p.add_argument("--phase-hot", type=int, nargs="+", default=[4_000, 40_000], help="--phases: the hot clusters' sizes")
    p.add_argument("--task-documents", type=int, help="--phases: dedup.task_documents (default: the config's)")
    p.add_argument("--driver", action="store_true", help="only the driver's memory by stage over ingest, normalize "
                                                          "and dedup, at each of --driver-docs")
    p.add_argument("--driver-docs", type=int, nargs="+", default=[150_000, 600_000])
    p.add_argument("--repeats", type=int, default=1, help="--driver: runs at each size, the sizes in turn")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    if args.groupby:
        return groupby_memory()
    if args.references:
        return hash_references()
    if args.small:
        return small_groupby()
    if args.driver:
        return driver(args.driver_docs, args.repeats, Path(args.out) / "driver")
    if args.phases:
        return phases(args.phase_docs, args.phase_hot, args.task_documents, Path(args.out) / "phases")
    root = Path(args.out)
    probe = root / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    tree = baseline_tree(args.baseline, root, measured=False)
    runs = [(n, args.hot) for n in args.docs]
    if args.hot_at:
        n, h = (int(x) for x in args.hot_at.split(":"))
        runs.append((n, h))
    print(f"commit {provenance.commit()} against {args.baseline}; 10% planted duplicates and a hot cluster\n")
    print("| documents | hot cluster | code | s per 1k docs | driver peak RSS MB | driver Ray memory store peak MB "
          "| largest worker RSS MB | most documents in one task: verification / assembly "
          "| most rows of one key grouped: exact / candidates / components | removed (duplicate + near_eval) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results: dict = {}
    for n, hot in runs:
        folder = root / f"n{n}-hot{hot}"
        folder.mkdir(parents=True, exist_ok=True)
        data = corpus(folder, n, hot)
        for name, code in ((args.baseline, tree), ("now", ROOT)):
            run_pipeline(folder / name, data, code, "ingest,normalize", folder / f"work-{name}")
            r = results[(n, hot, name)] = one_run(folder, data, name, code, probe)
            tasks = f"{r['verify']:,} / {r['assembly']:,}" if r["verify"] is not None else "- (not measured)"
            keys = " / ".join("-" if k is None else f"{k:,}" for k in r["keys"]) if r["keys"][1] is not None \
                else "- (not measured)"
            print(f"| {r['rows']:,} | {hot:,} | {name} | {1000 * r['seconds'] / r['rows']:.2f} | {r['driver']:,.0f} "
                  f"| {r['store']:,.1f} | {r['worker']:,.0f} | {tasks} | {keys} | {r['removed']:,} |", flush=True)
    small, large = min(args.docs), max(args.docs)
    for name in (args.baseline, "now") if small < large else ():
        a, b = results[(small, args.hot, name)], results[(large, args.hot, name)]
        per_doc = (b["driver"] - a["driver"]) * 2**20 / (b["rows"] - a["rows"])
        print(f"\n{name}: the driver grew {b['driver'] - a['driver']:+,.0f} MB from {a['rows']:,} to {b['rows']:,} documents "
              f"({per_doc:+.1f} bytes per document); its Ray memory store {b['store'] - a['store']:+,.1f} MB")


if __name__ == "__main__":
    main()

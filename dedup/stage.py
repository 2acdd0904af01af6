"""The dedup stage: near-duplicates (Jaccard >= threshold) removed across every source, on Ray Data.

1. Band keys: `map_batches` computes each document's MinHash signature and its band keys
   (dedup/minhash.py, dedup/lsh.py): rows (band key, id, source).
2. Candidates: the band rows are grouped by a coarse partition of the key (a Ray Data groupby;
   within a partition, documents that share a band key are found with a sort, not one Python
   call per bucket). A bucket of k <= 32 documents gives all its pairs; a bigger one (copies of
   one text, usually) the pairs of its smallest id with every other and of each neighbour in id
   order, O(k) instead of O(k^2).
3. Verification: every candidate pair's exact Jaccard on the shingle sets, as a join done with
   two groupbys (pairs meet their first document's text, then their second's). A pair below
   the threshold is never merged. Every checked pair is kept in `candidates/` with its Jaccard.
4. Components: the verified pairs, in one Ray task whose memory grows with the number of
   duplicate documents (not the corpus), joined by label propagation to the smallest
   (source priority, id) of each component: that document is kept. Source priority is the
   order of `sources:` in the config, so a document found in the Pile and in CC-News is kept as
   the Pile's when the Pile comes first. Chains a~b~c are one component.
5. Output: the normalized documents minus the removed ones (file tasks over normalize's parts),
   and `duplicates/` with id, source, kept_id, kept_source, jaccard and via (the verified
   neighbour with the highest Jaccard: the evidence).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus.parts import DOCUMENT_SCHEMA, Parts, check_read, check_written, iter_rows, parquet_bytes, parquet_files, run_tasks
from dedup.lsh import band_keys, choose_banding
from dedup.minhash import MinHasher, jaccard_of_sets
from pipelines.config import DedupConfig
from pipelines.console import Bar
from pipelines.dag import StageContext, StageResult
from pipelines.engines import groupby

SMALL_BUCKET = 32  # buckets up to this size give all their pairs
PARTITION_BYTES = 64 << 20  # of documents per groupby partition
DUPLICATE_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("kept_id", pa.string()),
                              ("kept_source", pa.string()), ("jaccard", pa.float64()), ("via", pa.string())])
CANDIDATE_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("a_source", pa.string()),
                              ("b_source", pa.string()), ("jaccard", pa.float64())])
# Rows of the join: a document (kind "doc": key = its id, text) or a pair waiting for its key's text.
JOIN_SCHEMA = pa.schema([("part", pa.int64()), ("kind", pa.string()), ("key", pa.string()), ("key_source", pa.string()),
                         ("other", pa.string()), ("other_source", pa.string()), ("text", pa.string()),
                         ("shingles", pa.binary())])


def part_of(ids: list[str], partitions: int) -> np.ndarray:
    """A stable partition for each id (crc32: the same in every worker, unlike Python's hash)."""
    return np.array([zlib.crc32(i.encode()) % partitions for i in ids], dtype=np.int64)


def hasher(config: DedupConfig) -> MinHasher:
    return MinHasher(num_perm=config.num_perm, ngram=config.ngram, seed=config.seed, lowercase=config.lowercase)


# --------------------------------------------------------------------------- 1-2: bands, candidates


def band_rows(batch: pa.Table, config: dict, bands: int, rows: int, partitions: int) -> pa.Table:
    cfg = DedupConfig(**config)
    keys = band_keys(hasher(cfg).signatures(batch["text"].to_pylist()), bands, rows, seed=cfg.seed)
    flat = keys.ravel()  # document-major: doc 0's bands, doc 1's, ...
    return pa.table({"band": pa.array(flat, pa.uint64()),
                     "part": pa.array((flat % np.uint64(partitions)).astype(np.int64)),
                     "id": pa.array(np.repeat(batch["id"].to_numpy(zero_copy_only=False), bands)),
                     "source": pa.array(np.repeat(batch["source"].to_numpy(zero_copy_only=False), bands))})


def bucket_pairs(members: list[tuple[str, str]]) -> list[tuple[str, str, str, str]]:
    """Candidate pairs (a < b) of one bucket of (id, source)."""
    members = sorted(set(members))
    if len(members) <= SMALL_BUCKET:
        idx = [(i, j) for i in range(len(members)) for j in range(i + 1, len(members))]
    else:
        idx = sorted({(0, j) for j in range(1, len(members))} | {(j, j + 1) for j in range(len(members) - 1)})
    return [(members[i][0], members[j][0], members[i][1], members[j][1]) for i, j in idx]


def candidate_pairs(group: pa.Table) -> pa.Table:
    """One partition of band rows -> the candidate pairs of every bucket in it (a bucket = a band key)."""
    order = np.argsort(group["band"].to_numpy(), kind="stable")
    band = group["band"].to_numpy()[order]
    ids = np.asarray(group["id"].to_pylist(), dtype=object)[order]
    sources = np.asarray(group["source"].to_pylist(), dtype=object)[order]
    starts = np.flatnonzero(np.concatenate([[True], band[1:] != band[:-1]]))
    ends = np.append(starts[1:], len(band))
    out = []
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):  # buckets of 2+ only
        out.extend(bucket_pairs(list(zip(ids[s:e], sources[s:e]))))
    a, b, sa, sb = zip(*out) if out else ([], [], [], [])
    return pa.table({"a": pa.array(a, pa.string()), "b": pa.array(b, pa.string()),
                     "a_source": pa.array(sa, pa.string()), "b_source": pa.array(sb, pa.string())})


# --------------------------------------------------------------------------- 3: verification


def docs_keyed(batch: pa.Table, partitions: int) -> pa.Table:
    n = batch.num_rows
    return pa.table({"part": pa.array(part_of(batch["id"].to_pylist(), partitions)), "kind": pa.array(["doc"] * n),
                     "key": batch["id"], "key_source": batch["source"], "other": pa.nulls(n, pa.string()),
                     "other_source": pa.nulls(n, pa.string()), "text": batch["text"], "shingles": pa.nulls(n, pa.binary())},
                    schema=JOIN_SCHEMA)


def pairs_keyed(batch: pa.Table, partitions: int, by: str) -> pa.Table:
    """Candidate pairs keyed by their `by` side ("a": first, "b": second document)."""
    other = "b" if by == "a" else "a"
    n = batch.num_rows
    shingles = batch["shingles"] if "shingles" in batch.column_names else pa.nulls(n, pa.binary())
    return pa.table({"part": pa.array(part_of(batch[by].to_pylist(), partitions)), "kind": pa.array(["pair"] * n),
                     "key": batch[by], "key_source": batch[f"{by}_source"], "other": batch[other],
                     "other_source": batch[f"{other}_source"], "text": pa.nulls(n, pa.string()), "shingles": shingles},
                    schema=JOIN_SCHEMA)


def _texts_and_pairs(group: pa.Table) -> tuple[dict[str, str], list[dict]]:
    """The partition's pairs, and the texts of the documents they name (the partition holds every
    document whose id falls in it; only those become Python strings)."""
    pairs = group.filter(pc.equal(group["kind"], "pair"))
    docs = group.filter(pc.and_(pc.equal(group["kind"], "doc"), pc.is_in(group["key"], pc.unique(pairs["key"]))))
    return dict(zip(docs["key"].to_pylist(), docs["text"].to_pylist())), pairs.to_pylist()


def attach_first(group: pa.Table, config: dict) -> pa.Table:
    """Pairs meet their first document: each distinct pair leaves with that document's shingle set."""
    texts, pairs = _texts_and_pairs(group)
    seen, out = set(), []
    needed = sorted({p["key"] for p in pairs})
    sets = dict(zip(needed, hasher(DedupConfig(**config)).shingle_sets([texts[k] for k in needed]))) if needed else {}
    for p in pairs:
        if (p["key"], p["other"]) in seen:  # the same pair from several bands
            continue
        seen.add((p["key"], p["other"]))
        out.append({"a": p["key"], "b": p["other"], "a_source": p["key_source"], "b_source": p["other_source"],
                    "shingles": sets[p["key"]].tobytes()})
    return pa.Table.from_pylist(out, schema=pa.schema([*CANDIDATE_SCHEMA.remove(4), ("shingles", pa.binary())]))


def verify_second(group: pa.Table, config: dict) -> pa.Table:
    """Pairs (with their first document's shingles) meet their second document: exact Jaccard."""
    texts, pairs = _texts_and_pairs(group)
    needed = sorted({p["key"] for p in pairs})
    sets = dict(zip(needed, hasher(DedupConfig(**config)).shingle_sets([texts[k] for k in needed]))) if needed else {}
    out = [{"a": p["other"], "b": p["key"], "a_source": p["other_source"], "b_source": p["key_source"],
            "jaccard": jaccard_of_sets(np.frombuffer(p["shingles"], dtype=np.uint64), sets[p["key"]])} for p in pairs]
    return pa.Table.from_pylist(out, schema=CANDIDATE_SCHEMA)


# --------------------------------------------------------------------------- 4: components


def components(candidates: str, duplicates: str, threshold: float, priority: dict[str, int]) -> dict:
    """Verified pairs -> components -> the removed documents written to `duplicates` (runs as a Ray task)."""
    table = pa.concat_tables([pq.read_table(p) for p in parquet_files(candidates)]) if parquet_files(candidates) \
        else CANDIDATE_SCHEMA.empty_table()
    edges = table.filter(pc.greater_equal(table["jaccard"], threshold))
    names = pa.concat_arrays([edges["a"].combine_chunks(), edges["b"].combine_chunks()]).to_pylist()
    sources = pa.concat_arrays([edges["a_source"].combine_chunks(), edges["b_source"].combine_chunks()]).to_pylist()
    source_of = dict(zip(names, sources))
    nodes = sorted(source_of, key=lambda n: (priority.get(source_of[n], len(priority)), n))  # rank 0 = most preferred
    rank = {n: i for i, n in enumerate(nodes)}
    u = np.array([rank[n] for n in edges["a"].to_pylist()], dtype=np.int64)
    v = np.array([rank[n] for n in edges["b"].to_pylist()], dtype=np.int64)
    label = np.arange(len(nodes), dtype=np.int64)
    while True:  # min-label propagation with pointer jumping: O(log) rounds on chains
        m = np.minimum(label[u], label[v])
        new = label.copy()
        np.minimum.at(new, u, m)
        np.minimum.at(new, v, m)
        new = new[new]
        if (new == label).all():
            break
        label = new
    best: dict[str, tuple[float, int, str]] = {}  # each node's strongest verified edge (ties: preferred neighbour)
    for a, b, j in zip(edges["a"].to_pylist(), edges["b"].to_pylist(), edges["jaccard"].to_pylist()):
        for x, y in ((a, b), (b, a)):
            best[x] = max(best.get(x, (-1.0, 0, "")), (j, -rank[y], y))
    parts = Parts(duplicates, "duplicates", DUPLICATE_SCHEMA)
    sizes = collections.Counter(label.tolist())
    removed: collections.Counter = collections.Counter()  # (source, kept source) -> documents removed
    for i, node in enumerate(nodes):
        if label[i] != i:
            kept = nodes[label[i]]
            parts.add({"id": node, "source": source_of[node], "kept_id": kept, "kept_source": source_of[kept],
                       "jaccard": best[node][0], "via": best[node][2]})
            removed[(source_of[node], source_of[kept])] += 1
    parts.close()
    return {"verified_pairs": edges.num_rows, "candidate_pairs": table.num_rows, "clusters": len(sizes),
            "cluster_sizes": dict(collections.Counter(sizes.values())), "removed": removed}


# --------------------------------------------------------------------------- 5: output


def filter_task(task: dict) -> dict:
    removed = set()
    for path in parquet_files(task["duplicates"]):
        removed.update(pq.read_table(path, columns=["id"])["id"].to_pylist())
    docs = Parts(task["output"], task["stem"], DOCUMENT_SCHEMA)
    counts: collections.Counter = collections.Counter()
    for row in iter_rows(task["path"]):
        counts["rows_in"] += 1
        if row["id"] in removed:
            counts["duplicate"] += 1
        else:
            docs.add(row, len(row["text"]))
            counts["rows_out"] += 1
    docs.close()
    return dict(counts)


def run(ctx: StageContext) -> StageResult:
    import ray
    import ray.data

    cfg: DedupConfig = ctx.section
    config = dataclasses.asdict(cfg)
    bands, rows = (cfg.bands, cfg.rows) if cfg.bands else choose_banding(cfg.num_perm, cfg.threshold)
    parts = parquet_files(ctx.input_output("normalize"))
    if not parts:  # normalize kept nothing
        return StageResult(0, 0, {"duplicate": 0})
    nbytes = parquet_bytes(parts)
    partitions = max(1, -(-nbytes // PARTITION_BYTES))
    work = ctx.folder / "work"

    def grouped(ds):  # by `part`, which takes `partitions` values; sized by the documents, which the joins carry
        return groupby(ds, "part", nbytes, ctx.config.ray, num_partitions=partitions)

    with Bar("dedup", "phases", 5) as bar:  # bands and candidates; two joins; components; output
        docs = ray.data.read_parquet(parts).select_columns(["id", "source", "text"])  # projected into the read
        band_ds = docs.map_batches(band_rows, batch_format="pyarrow", batch_size=500,
                                   fn_kwargs={"config": config, "bands": bands, "rows": rows, "partitions": partitions})
        grouped(band_ds).map_groups(candidate_pairs, batch_format="pyarrow").write_parquet(str(work / "pairs"))
        bar.update()

        candidates = ctx.aside("candidates")
        if parquet_files(work / "pairs"):  # no shared band key anywhere: nothing to verify
            keyed_docs = docs.map_batches(docs_keyed, batch_format="pyarrow", fn_kwargs={"partitions": partitions})
            pairs = ray.data.read_parquet(str(work / "pairs"))
            keyed = pairs.map_batches(pairs_keyed, batch_format="pyarrow", fn_kwargs={"partitions": partitions, "by": "a"})
            grouped(keyed.union(keyed_docs)).map_groups(attach_first, batch_format="pyarrow", fn_kwargs={"config": config}) \
                .write_parquet(str(work / "first"))
            bar.update()
            first = ray.data.read_parquet(str(work / "first"))
            keyed = first.map_batches(pairs_keyed, batch_format="pyarrow", fn_kwargs={"partitions": partitions, "by": "b"})
            grouped(keyed.union(keyed_docs)).map_groups(verify_second, batch_format="pyarrow", fn_kwargs={"config": config}) \
                .write_parquet(str(candidates))
        bar.update_to(3)

        priority = {s.name: i for i, s in enumerate(ctx.config.sources)}
        duplicates = ctx.aside("duplicates")
        found = ray.get(ray.remote(components).remote(str(candidates), str(duplicates), cfg.threshold, priority))
        bar.update()

        tasks = [{"path": p, "stem": Path(p).stem, "duplicates": str(duplicates), "output": str(ctx.output)} for p in parts]
        counts: collections.Counter = collections.Counter()
        for result in run_tasks(filter_task, tasks):
            counts.update(result)
        bar.update()
    check_written(duplicates, counts["duplicate"], "duplicates removed")
    check_written(ctx.output, counts["rows_out"], "documents kept")
    check_read(counts["rows_in"], ctx.inputs, "normalize")
    shutil.rmtree(work, ignore_errors=True)
    return StageResult(counts["rows_in"], counts["rows_out"], {"duplicate": counts["duplicate"]},
                       _metrics(found, bands, rows, ctx))


def _metrics(found: dict, bands: int, rows: int, ctx: StageContext) -> dict:
    metrics = {"bands": bands, "rows": rows, "candidate_pairs": found["candidate_pairs"],
               "verified_pairs": found["verified_pairs"], "clusters": found["clusters"]}
    by_source: collections.Counter = collections.Counter()
    for (source, kept), n in found["removed"].items():
        metrics[f"duplicates.{source}.of.{kept}"] = n
        by_source[source] += n
    metrics.update({f"duplicates.{source}": n for source, n in by_source.items()})
    sizes = {int(k): v for k, v in found["cluster_sizes"].items()}
    (ctx.folder / "cluster_sizes.json").write_text(json.dumps(dict(sorted(sizes.items()))) + "\n")
    _log_histogram(sizes, ctx)
    return metrics


def _log_histogram(sizes: dict[int, int], ctx: StageContext) -> None:
    """The cluster-size histogram as a plot on the stage's MLflow run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(k) for k in sorted(sizes)], [sizes[k] for k in sorted(sizes)])
    ax.set_xlabel("documents in the cluster")
    ax.set_ylabel("clusters")
    ax.set_title("near-duplicate clusters (kept one of each)")
    fig.tight_layout()
    MlflowClient(ctx.config.mlflow.tracking_uri).log_figure(ctx.mlflow_run_id, fig, "cluster_sizes.png")
    plt.close(fig)

"""The dedup stage: near-duplicates (Jaccard >= threshold) removed across every source, on Ray Data,
without the corpus's text in any shuffle and without a step that holds every duplicate in one task.

A document's key is its place: `part << 32 | row` (an int64) in normalize's parts, which are read
in a fixed order. Keys are what the shuffles carry, what finds a document's text again (a read of
its own part, not a join) and what removal matches on.

1. Exact duplicates: one task per part hashes every text (128-bit BLAKE2b) and writes an index of
   key, hash, id and source; a groupby on the hash collapses identical texts to their kept copy
   (source order in the config, then the smallest id). Copies go to `duplicates/` with Jaccard
   1.0 and `via` that kept copy. Everything below sees one document per text.
2. Band keys: one task per part computes the MinHash band keys (dedup/minhash.py, dedup/lsh.py)
   of the documents left after step 1: rows (band key, key, id, source).
3. Candidates: the band rows grouped by a coarse partition of the band key; a bucket of k <= 32
   documents gives all its pairs, a bigger one the pairs of its smallest id with every other and
   of each neighbour in id order, O(k) instead of O(k^2). Pairs carry keys and ids only.
4. Verification: the candidate documents are found per part (a semi-join by key: a groupby of
   keys on their part), and one task per part reads only those documents' text from its own part
   and sends their shingle sets to the verification partitions of their pairs (a pair's is its
   first document's); one groupby then brings each partition its pairs and those shingle sets,
   and every pair gets its exact Jaccard. A pair below the threshold is never merged. Every checked
   pair is kept in `candidates/` with its Jaccard.
5. Components of the verified pairs: distributed rounds of large-star and small-star (Kiveris et
   al. 2014), each a groupby over the edges, until a round changes nothing; up to
   `SMALL_GRAPH_EDGES` edges in one task instead (the same labels: tests/test_dedup.py). Each
   component keeps its smallest (source order, id) document; the others go to `duplicates/` with
   `via` their verified neighbour of highest Jaccard (ties: the preferred one), the evidence.
   Chains a~b~c are one component. The exact copies of a document another one replaces go with
   it to that document.
6. Output: one task per part drops its removed rows by key against a sorted array.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus.parts import DOCUMENT_SCHEMA, Parts, check_read, check_written, parquet_bytes, parquet_files, run_tasks
from dedup.lsh import band_keys, choose_banding
from dedup.minhash import MinHasher, jaccard_of_sets
from pipelines.config import DedupConfig
from pipelines.console import Bar
from pipelines.dag import StageContext, StageResult
from pipelines.engines import groupby

SMALL_BUCKET = 32  # buckets up to this size give all their pairs
PARTITION_BYTES = 64 << 20  # of shuffled rows per groupby partition
SMALL_GRAPH_EDGES = 1 << 20  # verified pairs up to this many: their components in one task
ROW_BITS = 32  # key = part << ROW_BITS | row
DUPLICATE_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("kept_id", pa.string()),
                              ("kept_source", pa.string()), ("jaccard", pa.float64()), ("via", pa.string())])
CANDIDATE_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("a_source", pa.string()),
                              ("b_source", pa.string()), ("jaccard", pa.float64()), ("a_key", pa.int64()),
                              ("b_key", pa.int64())])
PAIR_SCHEMA = CANDIDATE_SCHEMA.remove(4)
# Rows of the verification groupby: a candidate document's shingle set (kind "doc"), or a pair (kind "pair").
JOIN_SCHEMA = pa.schema([("part", pa.int64()), ("kind", pa.string()), ("key", pa.int64()), *PAIR_SCHEMA,
                         ("shingles", pa.binary())])
EDGE_SCHEMA = pa.schema([("part", pa.int64()), ("u", pa.int64()), ("v", pa.int64())])


def part_of(values: np.ndarray, partitions: int) -> np.ndarray:
    """A stable partition for each int64 key (the same in every worker)."""
    mixed = (values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return (mixed % np.uint64(partitions)).astype(np.int64)


def hasher(config: DedupConfig) -> MinHasher:
    return MinHasher(num_perm=config.num_perm, ngram=config.ngram, seed=config.seed, lowercase=config.lowercase)


def keys_of(part: int, rows: int) -> np.ndarray:
    return (np.int64(part) << np.int64(ROW_BITS)) + np.arange(rows, dtype=np.int64)


# --------------------------------------------------------------------------- 1: exact duplicates


def index_task(task: dict) -> dict:
    """One part -> its index rows: key, the text's 128-bit hash (two uint64), priority, id, source."""
    table = pq.read_table(task["path"], columns=["id", "source", "text"])
    n = table.num_rows
    digest = b"".join(hashlib.blake2b(t.encode(), digest_size=16).digest() for t in table["text"].to_pylist())
    h = np.frombuffer(digest, dtype=np.uint64).reshape(n, 2) if n else np.zeros((0, 2), dtype=np.uint64)
    priority = task["priority"]
    out = pa.table({"part": pa.array((h[:, 0] % np.uint64(task["partitions"])).astype(np.int64)),
                    "key": pa.array(keys_of(task["part"], n)), "h1": pa.array(h[:, 0]), "h2": pa.array(h[:, 1]),
                    "prio": pa.array([priority.get(s, len(priority)) for s in table["source"].to_pylist()], pa.int64()),
                    "id": table["id"], "source": table["source"]})
    Path(task["out"]).mkdir(parents=True, exist_ok=True)
    pq.write_table(out, Path(task["out"]) / f"index-{task['part']:05d}.parquet")
    return {"rows": n, "bytes": out.nbytes}


def exact_groups(group: pa.Table) -> pa.Table:
    """Index rows of one partition of text hashes -> one row per copy that is not its text's kept copy."""
    order = pc.sort_indices(group, [("h1", "ascending"), ("h2", "ascending"), ("prio", "ascending"), ("id", "ascending")])
    g = group.take(order)
    h1, h2 = g["h1"].to_numpy(), g["h2"].to_numpy()
    new_text = np.concatenate([[True], (h1[1:] != h1[:-1]) | (h2[1:] != h2[:-1])]) if len(h1) else np.zeros(0, bool)
    first = np.maximum.accumulate(np.where(new_text, np.arange(len(h1)), 0))  # each row's text's first (kept) row
    copies = np.flatnonzero(~new_text)
    keep = first[copies]
    return pa.table({"key": g["key"].take(copies), "id": g["id"].take(copies), "source": g["source"].take(copies),
                     "kept_key": g["key"].take(keep), "kept_id": g["id"].take(keep), "kept_source": g["source"].take(keep)})


def removed_rows(folder: Path, part: int) -> np.ndarray:
    """The sorted rows of `part` listed in `folder` (written by `write_by_part`)."""
    path = folder / f"part-{part:05d}.npy"
    return np.load(path) if path.is_file() else np.zeros(0, dtype=np.int64)


def write_by_part(group: pa.Table, folder: str) -> pa.Table:
    """Keys of one part -> that part's sorted rows, in one file (each output task reads only its own)."""
    keys = group["key"].to_numpy()
    part = int(keys[0] >> ROW_BITS)
    np.save(Path(folder) / f"part-{part:05d}.npy", np.unique(keys & ((1 << ROW_BITS) - 1)))
    return pa.table({"part": [part], "rows": [len(keys)]})


# --------------------------------------------------------------------------- 2-3: bands, candidates


def band_task(task: dict) -> dict:
    """One part -> band rows of its documents that are not exact copies: (band, part, key, id, source)."""
    cfg = DedupConfig(**task["config"])
    table = pq.read_table(task["path"], columns=["id", "source", "text"])
    keep = np.setdiff1d(np.arange(table.num_rows), removed_rows(Path(task["exact"]), task["part"]), assume_unique=True)
    table = table.take(keep)
    bands = task["bands"]
    keys = band_keys(hasher(cfg).signatures(table["text"].to_pylist()), bands, task["rows"], seed=cfg.seed)
    flat = keys.ravel()  # document-major: doc 0's bands, doc 1's, ...
    out = pa.table({"band": pa.array(flat, pa.uint64()),
                    "part": pa.array((flat % np.uint64(task["partitions"])).astype(np.int64)),
                    "key": pa.array(np.repeat((np.int64(task["part"]) << np.int64(ROW_BITS)) + keep.astype(np.int64), bands)),
                    "id": pa.array(np.repeat(table["id"].to_numpy(zero_copy_only=False), bands)),
                    "source": pa.array(np.repeat(table["source"].to_numpy(zero_copy_only=False), bands))})
    Path(task["out"]).mkdir(parents=True, exist_ok=True)
    pq.write_table(out, Path(task["out"]) / f"bands-{task['part']:05d}.parquet")
    return {"documents": table.num_rows, "bytes": out.nbytes}


def bucket_pairs(members: list[tuple[str, str, int]]) -> list[tuple[str, str, str, str, int, int]]:
    """Candidate pairs (a < b) of one bucket of (id, source, key)."""
    members = sorted(set(members))
    if len(members) <= SMALL_BUCKET:
        idx = [(i, j) for i in range(len(members)) for j in range(i + 1, len(members))]
    else:
        idx = sorted({(0, j) for j in range(1, len(members))} | {(j, j + 1) for j in range(len(members) - 1)})
    return [(members[i][0], members[j][0], members[i][1], members[j][1], members[i][2], members[j][2]) for i, j in idx]


def candidate_pairs(group: pa.Table) -> pa.Table:
    """One partition of band rows -> the candidate pairs of every bucket in it (a bucket = a band key)."""
    order = np.argsort(group["band"].to_numpy(), kind="stable")
    band = group["band"].to_numpy()[order]
    ids = np.asarray(group["id"].to_pylist(), dtype=object)[order]
    sources = np.asarray(group["source"].to_pylist(), dtype=object)[order]
    keys = group["key"].to_numpy()[order]
    starts = np.flatnonzero(np.concatenate([[True], band[1:] != band[:-1]])) if len(band) else np.zeros(0, np.int64)
    ends = np.append(starts[1:], len(band))
    out = []
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):  # buckets of 2+ only
        out.extend(bucket_pairs(list(zip(ids[s:e], sources[s:e], keys[s:e].tolist()))))
    columns = list(zip(*out)) if out else [[] for _ in PAIR_SCHEMA]
    return pa.table([pa.array(c, f.type) for c, f in zip(columns, PAIR_SCHEMA)], schema=PAIR_SCHEMA)


# --------------------------------------------------------------------------- 4: verification


def candidate_keys(batch: pa.Table, partitions: int) -> pa.Table:
    """Pairs -> both their documents' keys, each with the part that holds it (the semi-join's side) and
    the verification partition its pair goes to (its first document's)."""
    a, b = batch["a_key"].to_numpy(), batch["b_key"].to_numpy()
    keys, dest = np.concatenate([a, b]), np.tile(part_of(a, partitions), 2)
    return pa.table({"part": pa.array(keys >> ROW_BITS), "key": pa.array(keys), "dest": pa.array(dest)})


def shingle_rows(group: pa.Table, paths: list[str], config: dict) -> pa.Table:
    """The candidate documents of one part -> their shingle sets, read from that part alone, one row for
    each verification partition that needs the document."""
    keys, dest = group["key"].to_numpy(), group["dest"].to_numpy()
    unique, index = np.unique(keys, return_inverse=True)
    part = int(unique[0] >> ROW_BITS)
    texts = pq.read_table(paths[part], columns=["text"])["text"].take(pa.array(unique & ((1 << ROW_BITS) - 1)))
    sets = hasher(DedupConfig(**config)).shingle_sets(texts.to_pylist())
    routes = np.unique(np.stack([index, dest], axis=1), axis=0)  # (document, partition), each once
    n = len(routes)
    return pa.table({"part": pa.array(routes[:, 1]), "kind": pa.array(["doc"] * n), "key": pa.array(unique[routes[:, 0]]),
                     **{f.name: pa.nulls(n, f.type) for f in PAIR_SCHEMA},
                     "shingles": pa.array([sets[i].tobytes() for i in routes[:, 0]], pa.binary())}, schema=JOIN_SCHEMA)


def pairs_keyed(batch: pa.Table, partitions: int) -> pa.Table:
    """Pairs keyed by their first document's verification partition."""
    n = batch.num_rows
    keys = batch["a_key"].to_numpy()
    return pa.table({"part": pa.array(part_of(keys, partitions)), "kind": pa.array(["pair"] * n), "key": pa.array(keys),
                     **{f.name: batch[f.name] for f in PAIR_SCHEMA}, "shingles": pa.nulls(n, pa.binary())}, schema=JOIN_SCHEMA)


def verify(group: pa.Table) -> pa.Table:
    """One verification partition: its pairs (each once, though several bands may have proposed it) and the
    shingle sets of their documents -> each pair's exact Jaccard."""
    docs = group.filter(pc.equal(group["kind"], "doc"))
    sets = {k: np.frombuffer(s, dtype=np.uint64) for k, s in zip(docs["key"].to_pylist(), docs["shingles"].to_pylist())}
    pairs = group.filter(pc.equal(group["kind"], "pair")).select([f.name for f in PAIR_SCHEMA])
    if pairs.num_rows:
        pairs = pairs.group_by(pairs.column_names, use_threads=False).aggregate([]).select(pairs.column_names)
    jaccard = [jaccard_of_sets(sets[a], sets[b]) for a, b in zip(pairs["a_key"].to_pylist(), pairs["b_key"].to_pylist())]
    return pairs.add_column(4, "jaccard", pa.array(jaccard, pa.float64())).cast(CANDIDATE_SCHEMA)


# --------------------------------------------------------------------------- 5: components


def components_in_one_task(u: np.ndarray, v: np.ndarray) -> dict[int, int]:
    """{node: the smallest node of its component}, by min-label propagation with pointer jumping."""
    nodes = np.unique(np.concatenate([u, v]))
    iu, iv = np.searchsorted(nodes, u), np.searchsorted(nodes, v)
    label = np.arange(len(nodes), dtype=np.int64)
    while True:  # O(log) rounds on chains
        m = np.minimum(label[iu], label[iv])
        new = label.copy()
        np.minimum.at(new, iu, m)
        np.minimum.at(new, iv, m)
        new = new[new]
        if (new == label).all():
            break
        label = new
    return dict(zip(nodes.tolist(), nodes[label].tolist()))


def _large_star(group: pa.Table) -> pa.Table:
    """Edges (u, v) in both directions, grouped by u: every neighbour v > u is linked to the smallest
    node of u's neighbourhood (u included). `changed` marks edges that moved."""
    u, v = group["u"].to_numpy(), group["v"].to_numpy()
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    starts = np.flatnonzero(np.concatenate([[True], u[1:] != u[:-1]]))
    m = np.minimum(np.minimum.reduceat(v, starts), u[starts])
    m_of = np.repeat(m, np.diff(np.append(starts, len(u))))
    out = v > u
    return _edges(v[out], m_of[out], m_of[out] != u[out])


def _small_star(group: pa.Table) -> pa.Table:
    """Edges (u, v) with v < u, grouped by u: u and its smaller neighbours are linked to the smallest of them."""
    u, v = group["u"].to_numpy(), group["v"].to_numpy()
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    starts = np.flatnonzero(np.concatenate([[True], u[1:] != u[:-1]]))
    counts = np.diff(np.append(starts, len(u)))
    m = np.minimum.reduceat(v, starts)
    m_of = np.repeat(m, counts)
    moved_from = np.repeat(counts > 1, counts)  # edges among the neighbourhood (other than to m) move to m
    others = v != m_of
    a = np.concatenate([u[starts], v[others]])
    b = np.concatenate([m, m_of[others]])
    moved = np.concatenate([np.zeros(len(starts), bool), moved_from[others]])
    return _edges(a, b, moved)


def _edges(a: np.ndarray, b: np.ndarray, moved: np.ndarray) -> pa.Table:
    """Undirected edges (u > v), each once (moved if any of its copies moved)."""
    u, v = np.maximum(a, b), np.minimum(a, b)
    order = np.lexsort((v, u))
    u, v, moved = u[order], v[order], moved[order].astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (u[1:] != u[:-1]) | (v[1:] != v[:-1])])) if len(u) else np.zeros(0, np.int64)
    moved = np.maximum.reduceat(moved, starts) if len(u) else moved
    return pa.table({"u": pa.array(u[starts]), "v": pa.array(v[starts]), "moved": pa.array(moved)})


def _directed(batch: pa.Table, partitions: int, both: bool) -> pa.Table:
    """Undirected edges (u > v) -> rows keyed by u (and by v too when `both`)."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    if both:
        u, v = np.concatenate([u, v]), np.concatenate([v, u])
    return pa.table({"part": pa.array(part_of(u, partitions)), "u": pa.array(u), "v": pa.array(v)}, schema=EDGE_SCHEMA)


def components_on_ray(edges, nbytes: int, ray_config, partitions: int) -> tuple[dict[int, int], int]:
    """Large-star and small-star rounds over a Ray Data dataset of edges (u > v) until a round moves no
    edge: then every component is a star around its smallest node. Returns ({node: that node}, rounds).
    The rounds hold no more than a partition of edges per task; the labels come back to the caller."""
    rounds = 0
    while True:
        rounds += 1
        kw = {"partitions": partitions}
        large = groupby(edges.map_batches(_directed, batch_format="pyarrow", fn_kwargs={**kw, "both": True}), "part",
                        2 * nbytes, ray_config, partitions).map_groups(_large_star, batch_format="pyarrow").materialize()
        small = groupby(large.map_batches(_directed, batch_format="pyarrow", fn_kwargs={**kw, "both": False}), "part",
                        nbytes, ray_config, partitions).map_groups(_small_star, batch_format="pyarrow").materialize()
        moved = (large.sum("moved") or 0) + (small.sum("moved") or 0)
        edges = small.select_columns(["u", "v"])
        if not moved:
            break
    star = pa.concat_tables(list(edges.iter_batches(batch_format="pyarrow"))) if edges.count() else None
    labels = {}
    if star is not None:
        for u, v in zip(star["u"].to_pylist(), star["v"].to_pylist()):
            labels[u] = v
            labels[v] = v
    return labels, rounds


def assemble(candidates: str, exact: str, duplicates: str, removed: str, threshold: float, priority: dict[str, int],
             labels: dict[int, int] | None) -> dict:
    """Verified pairs and exact copies -> the removed documents, written to `duplicates` (rows) and to
    `removed` (each part's sorted rows). `labels`: the components (node -> its smallest node) from
    `components_on_ray`; None computes them here. Runs as a Ray task whose memory follows the number of
    duplicate documents, not the corpus."""
    files = parquet_files(candidates)
    table = pa.concat_tables([pq.read_table(p) for p in files]) if files else CANDIDATE_SCHEMA.empty_table()
    edges = table.filter(pc.greater_equal(table["jaccard"], threshold))
    u, v = edges["a_key"].to_numpy(), edges["b_key"].to_numpy()
    if labels is None:
        labels = components_in_one_task(u, v) if len(u) else {}
    name = dict(zip(np.concatenate([u, v]).tolist(), zip(edges["a"].to_pylist() + edges["b"].to_pylist(),
                                                          edges["a_source"].to_pylist() + edges["b_source"].to_pylist())))

    def rank(k: int) -> tuple[int, str]:  # smaller = preferred: source order, then id
        return priority.get(name[k][1], len(priority)), name[k][0]

    kept: dict[int, int] = {}  # component (its smallest key) -> its kept document
    for node, root in labels.items():
        if root not in kept or rank(node) < rank(kept[root]):
            kept[root] = node
    best: dict[int, tuple[float, int]] = {}  # each node's strongest verified edge (ties: the preferred neighbour)
    for a, b, j in zip(u.tolist(), v.tolist(), edges["jaccard"].to_pylist()):
        for x, y in ((a, b), (b, a)):
            if x not in best or j > best[x][0] or (j == best[x][0] and rank(y) < rank(best[x][1])):
                best[x] = (j, y)
    exact_rows = [r for p in parquet_files(exact) for r in pq.read_table(p).to_pylist()]
    copies = collections.Counter(r["kept_key"] for r in exact_rows)
    parts = Parts(duplicates, "duplicates", DUPLICATE_SCHEMA)
    gone: list[int] = []
    members: collections.Counter = collections.Counter()  # kept document -> its cluster's size, copies included
    removed_by: collections.Counter = collections.Counter()  # (source, kept source) -> documents removed
    for node, root in labels.items():
        keep = kept[root]
        members[keep] += 1 + copies[node]
        if keep != node:
            j, via = best[node]
            parts.add({"id": name[node][0], "source": name[node][1], "kept_id": name[keep][0], "kept_source": name[keep][1],
                       "jaccard": j, "via": name[via][0]})
            gone.append(node)
            removed_by[(name[node][1], name[keep][1])] += 1
    for rep in copies:
        if rep not in labels:  # a text near no other: a cluster of its copies alone
            members[rep] += 1 + copies[rep]
    for r in exact_rows:
        keep = kept[labels[r["kept_key"]]] if r["kept_key"] in labels else None
        kept_id, kept_source = name[keep] if keep is not None else (r["kept_id"], r["kept_source"])
        parts.add({"id": r["id"], "source": r["source"], "kept_id": kept_id, "kept_source": kept_source, "jaccard": 1.0,
                   "via": r["kept_id"]})
        gone.append(r["key"])
        removed_by[(r["source"], kept_source)] += 1
    parts.close()
    keys = np.asarray(gone, dtype=np.int64)
    Path(removed).mkdir(parents=True, exist_ok=True)
    for part in np.unique(keys >> ROW_BITS).tolist():
        mine = keys[(keys >> ROW_BITS) == part]
        np.save(Path(removed) / f"part-{part:05d}.npy", np.unique(mine & ((1 << ROW_BITS) - 1)))
    in_pairs = np.unique(np.concatenate([table["a_key"].to_numpy(), table["b_key"].to_numpy()]))
    return {"verified_pairs": edges.num_rows + len(exact_rows), "candidate_pairs": table.num_rows,
            "candidate_documents": len(in_pairs),
            "exact_duplicates": len(exact_rows), "duplicates": len(gone), "clusters": len(members),
            "cluster_sizes": dict(collections.Counter(members.values())), "removed": removed_by}


# --------------------------------------------------------------------------- 6: output


def filter_task(task: dict) -> dict:
    """One part minus its removed rows (by row number, against the part's sorted array), a row group at a time."""
    gone = removed_rows(Path(task["removed"]), task["part"])
    docs = Parts(task["output"], task["stem"], DOCUMENT_SCHEMA)
    parquet, start = pq.ParquetFile(task["path"]), 0
    for i in range(parquet.num_row_groups):
        table = parquet.read_row_group(i)
        keep = np.ones(table.num_rows, dtype=bool)
        keep[gone[(gone >= start) & (gone < start + table.num_rows)] - start] = False
        for row in table.filter(pa.array(keep)).to_pylist():
            docs.add(row, len(row["text"]))
        start += table.num_rows
    docs.close()
    return {"rows_in": start, "rows_out": start - len(gone), "duplicate": len(gone)}


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
    priority = {s.name: i for i, s in enumerate(ctx.config.sources)}
    shuffled: dict[str, int] = {}  # phase -> bytes into its groupbys (Ray Data's block sizes)

    def grouped(ds, phase: str):
        ds = ds.materialize()
        size = ds.size_bytes()
        shuffled[phase] = shuffled.get(phase, 0) + size
        return groupby(ds, "part", size, ctx.config.ray, num_partitions=max(1, -(-size // PARTITION_BYTES)))

    def tasks(out: str, **extra) -> list[dict]:
        return [{"path": p, "part": i, "out": str(work / out), "partitions": partitions, **extra} for i, p in enumerate(parts)]

    with Bar("dedup", "phases", 6) as bar:  # exact; bands and candidates; candidate documents; verification; components; output
        run_tasks(index_task, tasks("index", priority=priority))
        exact = work / "exact"
        grouped(ray.data.read_parquet(str(work / "index")), "exact").map_groups(exact_groups, batch_format="pyarrow") \
            .write_parquet(str(exact))
        (work / "exact_rows").mkdir(parents=True)
        if parquet_files(exact):
            keyed = ray.data.read_parquet(str(exact)).select_columns(["key"]).map_batches(
                lambda b: b.append_column("part", pa.array(b["key"].to_numpy() >> ROW_BITS)), batch_format="pyarrow")
            grouped(keyed, "exact").map_groups(write_by_part, batch_format="pyarrow",
                                               fn_kwargs={"folder": str(work / "exact_rows")}).materialize()
        bar.update()

        run_tasks(band_task, tasks("bands", config=config, bands=bands, rows=rows, exact=str(work / "exact_rows")))
        grouped(ray.data.read_parquet(str(work / "bands")), "candidates").map_groups(candidate_pairs, batch_format="pyarrow") \
            .write_parquet(str(work / "pairs"))
        bar.update()

        candidates = ctx.aside("candidates")
        if parquet_files(work / "pairs"):  # no shared band key anywhere: nothing to verify
            pairs = ray.data.read_parquet(str(work / "pairs"))
            which = pairs.map_batches(candidate_keys, batch_format="pyarrow", fn_kwargs={"partitions": partitions})
            grouped(which, "candidate documents").map_groups(shingle_rows, batch_format="pyarrow",
                                                             fn_kwargs={"paths": parts, "config": config}) \
                .write_parquet(str(work / "shingles"))
            bar.update()
            keyed = pairs.map_batches(pairs_keyed, batch_format="pyarrow", fn_kwargs={"partitions": partitions})
            grouped(keyed.union(ray.data.read_parquet(str(work / "shingles"))), "verification") \
                .map_groups(verify, batch_format="pyarrow").write_parquet(str(candidates))
        bar.update_to(4)

        labels, rounds = None, 0
        edges = ray.data.read_parquet(str(candidates)).filter(expr=f"jaccard >= {cfg.threshold}") \
            if parquet_files(candidates) else None
        if edges is not None and edges.count() > SMALL_GRAPH_EDGES:
            undirected = edges.map_batches(lambda b: pa.table({"u": pc.max_element_wise(b["a_key"], b["b_key"]),
                                                               "v": pc.min_element_wise(b["a_key"], b["b_key"])}),
                                           batch_format="pyarrow").materialize()
            shuffled["components"] = undirected.size_bytes()
            labels, rounds = components_on_ray(undirected, undirected.size_bytes(), ctx.config.ray, partitions)
        duplicates, removed = ctx.aside("duplicates"), work / "removed"
        found = ray.get(ray.remote(assemble).remote(str(candidates), str(exact), str(duplicates), str(removed),
                                                   cfg.threshold, priority, labels))
        bar.update()

        counts: collections.Counter = collections.Counter()
        for result in run_tasks(filter_task, [{"path": p, "part": i, "stem": Path(p).stem, "removed": str(removed),
                                               "output": str(ctx.output)} for i, p in enumerate(parts)]):
            counts.update(result)
        bar.update()
    check_written(duplicates, counts["duplicate"], "duplicates removed")
    check_written(ctx.output, counts["rows_out"], "documents kept")
    check_read(counts["rows_in"], ctx.inputs, "normalize")
    shutil.rmtree(work, ignore_errors=True)
    found.update(rounds=rounds, shuffled=shuffled, candidate_fraction=found["candidate_documents"] / counts["rows_in"])
    return StageResult(counts["rows_in"], counts["rows_out"], {"duplicate": counts["duplicate"]},
                       _metrics(found, bands, rows, ctx))


def lsh_threshold(bands: int, rows: int) -> float:
    """The Jaccard at which a pair becomes a candidate with probability 1/2: 1 - (1 - J^r)^b = 1/2."""
    return (1.0 - 0.5 ** (1.0 / bands)) ** (1.0 / rows)


def _metrics(found: dict, bands: int, rows: int, ctx: StageContext) -> dict:
    metrics = {"bands": bands, "rows": rows, "lsh_threshold": round(lsh_threshold(bands, rows), 4),
               "exact_duplicates": found["exact_duplicates"], "candidate_pairs": found["candidate_pairs"],
               "candidate_documents_fraction": round(found["candidate_fraction"], 6),
               "verified_pairs": found["verified_pairs"], "clusters": found["clusters"], "rounds": found["rounds"]}
    metrics.update({f"shuffled_bytes.{phase.replace(' ', '_')}": n for phase, n in found["shuffled"].items()})
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

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
   of the documents left after step 1: rows (band key, partition, key), 20 bytes each.
3. Candidates: the band rows grouped by a coarse partition of the band key; a bucket of k <= 32
   documents gives all its pairs, a bigger one the pairs of its smallest key with every other and
   of each neighbour in key order, O(k) instead of O(k^2). Pairs are two keys.
4. Verification, in the part of each pair's first document: a groupby of the pairs' keys on their
   own part (the semi-join) lets one task per part read only its candidate documents whose pairs
   are verified in another part, and send their ids, sources and shingle sets there, once per
   part that needs them. One groupby then brings each part its pairs and those documents; the
   task reads its own documents from its part, and every pair gets its exact Jaccard. A pair
   below the threshold is never merged. Every checked pair is kept in `candidates/`, (a, b) in
   (id, source) order, with its Jaccard.
5. Components of the graph of verified pairs and exact copies (each copy linked to its text's kept
   copy): distributed rounds of large-star and small-star (Kiveris et al. 2014), each a groupby over
   the edges, until a round changes nothing. A groupby then joins every edge with its first
   document's label (node -> its component's smallest node) and another brings each component's
   edges together, so that a task holds whole components, never all of them. Each component keeps
   its smallest (source order, id) document; an exact copy goes to `duplicates/` with Jaccard 1.0
   and `via` its text's kept copy, any other removed document with `via` its verified neighbour of
   highest Jaccard (ties: the preferred one), the evidence. Chains a~b~c are one component. Up to
   `SMALL_GRAPH_EDGES` checked pairs and copies, all this in one task instead (the same rows: tests/test_dedup.py).
6. Output: one task per part drops its removed rows by key against a sorted array.

The evaluation set (corpus/evalset.py, set aside by normalize) takes part as parts of its own, after
normalize's: its documents are preferred over any other as a text's kept copy and as a component's
kept document, and are never removed. A training document whose component is kept as an evaluation
document (a copy, a verified near-duplicate, or one through a chain of them) goes to `near_eval/`
instead of `duplicates/`, with that document as `kept_id`: a copy of an evaluation document never
trains the model. Only normalize's parts are written to the output.
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus import evalset
from corpus.parts import (DOCUMENT_SCHEMA, Parts, aside_parts, check_read, check_written, input_parts, parquet_bytes, parquet_files,
                          rows_in_folder, run_tasks)
from dedup.lsh import band_keys, choose_banding
from dedup.minhash import MinHasher, jaccard_of_sets
from dedup.config import DedupConfig
from core.console import Bar
from core.dag import StageContext, StageResult
from core.ray_session import groupby

SMALL_BUCKET = 32  # buckets up to this size give all their pairs
PARTITION_BYTES = 64 << 20  # of shuffled rows per groupby partition
SMALL_GRAPH_EDGES = 1 << 20  # checked pairs and exact copies up to this many: their components in one task
ROW_BITS = 32  # key = part << ROW_BITS | row
DUPLICATE_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("kept_id", pa.string()),
                              ("kept_source", pa.string()), ("jaccard", pa.float64()), ("via", pa.string())])
CANDIDATE_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("a_source", pa.string()),
                              ("b_source", pa.string()), ("jaccard", pa.float64()), ("a_key", pa.int64()),
                              ("b_key", pa.int64())])
PAIR_SCHEMA = pa.schema([("a_key", pa.int64()), ("b_key", pa.int64())])
# Rows of the verification groupby, keyed by part: a pair of that part's (kind "pair": a_key, b_key), or a
# document of another part that one of its pairs needs (kind "doc": a_key, id, source, shingles).
# `first` is 1 on one row of each candidate document (so they can be counted).
JOIN_SCHEMA = pa.schema([("part", pa.int64()), ("kind", pa.string()), *PAIR_SCHEMA, ("id", pa.string()),
                         ("source", pa.string()), ("shingles", pa.binary()), ("first", pa.int64())])
EDGE_SCHEMA = pa.schema([("part", pa.int64()), ("u", pa.int64()), ("v", pa.int64())])
# The components' graph: a verified pair (a, b), or an exact copy b of its text's kept copy a (`copy`).
GRAPH_SCHEMA = pa.schema([("a_key", pa.int64()), ("b_key", pa.int64()), ("a", pa.string()), ("b", pa.string()),
                          ("a_source", pa.string()), ("b_source", pa.string()), ("jaccard", pa.float64()), ("copy", pa.bool_())])
# Rows of the join of edges with their first document's label: an edge (kind "edge") or a label (kind "label").
LABEL_JOIN_SCHEMA = pa.schema([("part", pa.int64()), ("kind", pa.string()), ("root", pa.int64()), *GRAPH_SCHEMA])
ASSEMBLED_SCHEMA = pa.schema([*DUPLICATE_SCHEMA, ("key", pa.int64()), ("cluster_size", pa.int64()), ("reason", pa.string())])
TALLY_SCHEMA = pa.schema([("source", pa.string()), ("kept_source", pa.string()), ("reason", pa.string()), ("size", pa.int64()),
                          ("n", pa.int64())])
DUPLICATE = "duplicate"  # the reason, and (in the plural) its folder, of a document removed as another's near-duplicate
FOLDERS = {DUPLICATE: "duplicates", evalset.NEAR: evalset.NEAR}


def part_of(values: np.ndarray, partitions: int) -> np.ndarray:
    """A stable partition for each int64 key (the same in every worker)."""
    mixed = (values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return (mixed % np.uint64(partitions)).astype(np.int64)


def hasher(config: DedupConfig) -> MinHasher:
    return MinHasher(num_perm=config.num_perm, ngram=config.ngram, seed=config.seed, lowercase=config.lowercase)


def keys_of(part: int, rows: int) -> np.ndarray:
    return (np.int64(part) << np.int64(ROW_BITS)) + np.arange(rows, dtype=np.int64)


# --------------------------------------------------------------------------- 1: exact duplicates


@dataclass(frozen=True)
class PartTask:
    """One of the parts dedup reads (normalize's output, then its evaluation set's: `eval`), for a phase that
    writes under `out` rows keyed to `partitions` shuffle partitions."""
    path: str
    part: int
    out: str
    partitions: int
    eval: bool


@dataclass(frozen=True)
class IndexTask(PartTask):
    priority: dict[str, int]  # source -> its rank as the kept copy (the config's order)


def index_task(task: IndexTask) -> dict:
    """One part -> its index rows: key, the text's 128-bit hash (two uint64), priority, id, source."""
    table = pq.read_table(task.path, columns=["id", "source", "text"])
    n = table.num_rows
    digest = b"".join(hashlib.blake2b(t.encode(), digest_size=16).digest() for t in table["text"].to_pylist())
    h = np.frombuffer(digest, dtype=np.uint64).reshape(n, 2) if n else np.zeros((0, 2), dtype=np.uint64)
    priority = task.priority
    prio = [-1] * n if task.eval else [priority.get(s, len(priority)) for s in table["source"].to_pylist()]
    out = pa.table({"part": pa.array((h[:, 0] % np.uint64(task.partitions)).astype(np.int32)),
                    "key": pa.array(keys_of(task.part, n)), "h1": pa.array(h[:, 0]), "h2": pa.array(h[:, 1]),
                    "prio": pa.array(prio, pa.int32()),
                    "id": table["id"], "source": table["source"]})
    Path(task.out).mkdir(parents=True, exist_ok=True)
    pq.write_table(out, Path(task.out) / f"index-{task.part:05d}.parquet")
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


@dataclass(frozen=True)
class BandTask(PartTask):
    config: DedupConfig
    bands: int
    rows: int
    exact: str  # the exact copies' rows by part (write_by_part), which get no bands


def band_task(task: BandTask) -> dict:
    """One part -> band rows of its documents that are not exact copies: (band, part, key), 20 bytes."""
    cfg = task.config
    table = pq.read_table(task.path, columns=["text"])
    keep = np.setdiff1d(np.arange(table.num_rows), removed_rows(Path(task.exact), task.part), assume_unique=True)
    bands = task.bands
    keys = band_keys(hasher(cfg).signatures(table["text"].take(keep).to_pylist()), bands, task.rows, seed=cfg.seed)
    flat = keys.ravel()  # document-major: doc 0's bands, doc 1's, ...
    out = pa.table({"band": pa.array(flat, pa.uint64()),
                    "part": pa.array((flat % np.uint64(task.partitions)).astype(np.int32)),
                    "key": pa.array(np.repeat((np.int64(task.part) << np.int64(ROW_BITS)) + keep.astype(np.int64), bands))})
    Path(task.out).mkdir(parents=True, exist_ok=True)
    pq.write_table(out, Path(task.out) / f"bands-{task.part:05d}.parquet")
    return {"documents": len(keep), "bytes": out.nbytes}


def bucket_pairs(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs (a < b) of one bucket of distinct sorted keys."""
    k = len(members)
    if k <= SMALL_BUCKET:
        i, j = np.triu_indices(k, 1)
    else:  # the smallest with every other, and each with the next: a spanning set of 2k - 3 pairs
        i = np.concatenate([np.zeros(k - 1, np.int64), np.arange(1, k - 1)])
        j = np.concatenate([np.arange(1, k), np.arange(2, k)])
    return members[i], members[j]


def candidate_pairs(group: pa.Table) -> pa.Table:
    """One partition of band rows -> the candidate pairs (a_key < b_key) of every bucket in it (a bucket =
    a band key), each pair once per partition."""
    band, key = group["band"].to_numpy(), group["key"].to_numpy()
    order = np.lexsort((key, band))
    band, key = band[order], key[order]
    fresh = np.concatenate([[True], (band[1:] != band[:-1]) | (key[1:] != key[:-1])]) if len(band) else np.zeros(0, bool)
    band, key = band[fresh], key[fresh]  # a document twice in one bucket (two bands alike): once
    starts = np.flatnonzero(np.concatenate([[True], band[1:] != band[:-1]])) if len(band) else np.zeros(0, np.int64)
    ends = np.append(starts[1:], len(band))
    a, b = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):  # buckets of 2+ only
        x, y = bucket_pairs(key[s:e])
        a.append(x)
        b.append(y)
    pairs = np.unique(np.stack([np.concatenate(a), np.concatenate(b)], axis=1), axis=0)
    return pa.table({"a_key": pa.array(pairs[:, 0]), "b_key": pa.array(pairs[:, 1])}, schema=PAIR_SCHEMA)


# --------------------------------------------------------------------------- 4: verification


def candidate_keys(batch: pa.Table) -> pa.Table:
    """Pairs -> both their documents' keys, each with the part that holds it (the semi-join's side) and the
    part that verifies its pair (its first document's), or -1 where that is its own part (nothing to send:
    that part reads it), each once per batch."""
    a, b = batch["a_key"].to_numpy(), batch["b_key"].to_numpy()
    keys = np.concatenate([a, b])
    dest = np.tile(a >> ROW_BITS, 2)
    dest[(keys >> ROW_BITS) == dest] = -1
    routes = np.unique(np.stack([keys, dest], axis=1), axis=0)
    return pa.table({"part": pa.array(routes[:, 0] >> ROW_BITS), "key": pa.array(routes[:, 0]), "dest": pa.array(routes[:, 1])})


def read_documents(path: str, keys: np.ndarray, config: DedupConfig) -> tuple[pa.Table, list[np.ndarray]]:
    """Some documents of one part, by key (sorted, unique): their ids and sources, and their shingle sets."""
    table = pq.read_table(path, columns=["id", "source", "text"]).take(pa.array(keys & ((1 << ROW_BITS) - 1)))
    return table.select(["id", "source"]), hasher(config).shingle_sets(table["text"].to_pylist())


def shingle_rows(group: pa.Table, paths: list[str], config: DedupConfig) -> pa.Table:
    """The candidate documents of one part -> for each part that verifies one of their pairs elsewhere, their
    id, source and shingle set, read from this part alone. A document verified only here gets one row
    (part -1, nothing in it) so that `first` counts every candidate document once."""
    keys, dest = group["key"].to_numpy(), group["dest"].to_numpy()
    unique, index = np.unique(keys, return_inverse=True)
    routes = np.unique(np.stack([index, dest], axis=1), axis=0)  # (document, part), each once, by document
    first = np.concatenate([[True], routes[1:, 0] != routes[:-1, 0]])
    routes = routes[first | (routes[:, 1] >= 0)]  # a document's -1 route only where it has no other
    first = np.concatenate([[True], routes[1:, 0] != routes[:-1, 0]])
    away = routes[:, 1] >= 0
    sent = np.unique(routes[away, 0])
    names, sets = read_documents(paths[int(unique[0] >> ROW_BITS)], unique[sent], config)
    # Each row's place in `names` and `sets`, None on the rows that send nothing.
    at = pa.array(np.searchsorted(sent, routes[:, 0]), mask=~away)
    n = len(routes)
    return pa.table({"part": pa.array(routes[:, 1]), "kind": pa.array(["doc"] * n), "a_key": pa.array(unique[routes[:, 0]]),
                     "b_key": pa.nulls(n, pa.int64()), "id": names["id"].take(at), "source": names["source"].take(at),
                     "shingles": pa.array([sets[i].tobytes() if i is not None else None for i in at.to_pylist()], pa.binary()),
                     "first": pa.array(first.astype(np.int64))}, schema=JOIN_SCHEMA)


def pairs_keyed(batch: pa.Table) -> pa.Table:
    """Pairs keyed by the part that verifies them: their first document's."""
    n = batch.num_rows
    return pa.table({"part": pa.array(batch["a_key"].to_numpy() >> ROW_BITS), "kind": pa.array(["pair"] * n),
                     "a_key": batch["a_key"], "b_key": batch["b_key"], "id": pa.nulls(n, pa.string()),
                     "source": pa.nulls(n, pa.string()), "shingles": pa.nulls(n, pa.binary()),
                     "first": pa.array(np.zeros(n, np.int64))}, schema=JOIN_SCHEMA)


def verify(group: pa.Table, paths: list[str], config: DedupConfig) -> pa.Table:
    """One part's pairs (each once, though several bands may have proposed it) and the shingle sets of
    their second documents held elsewhere -> each pair's exact Jaccard. The part's own documents are
    read from the part; a pair is written (a, b) in (id, source) order."""
    docs = group.filter(pc.equal(group["kind"], "doc"))
    pairs = np.unique(np.stack([c.to_numpy() for c in group.filter(pc.equal(group["kind"], "pair"))
                                .select(["a_key", "b_key"]).columns], axis=1), axis=0)
    if not len(pairs):
        return CANDIDATE_SCHEMA.empty_table()
    part = int(pairs[0, 0] >> ROW_BITS)
    local = np.unique(pairs[(pairs >> ROW_BITS) == part])
    names, sets = read_documents(paths[part], local, config)
    known = {k: (i, s, x) for k, i, s, x in zip(local.tolist(), names["id"].to_pylist(), names["source"].to_pylist(), sets)}
    for k, i, s, x in zip(docs["a_key"].to_pylist(), docs["id"].to_pylist(), docs["source"].to_pylist(),
                          docs["shingles"].to_pylist()):
        known[k] = (i, s, np.frombuffer(x, dtype=np.uint64))
    out = []
    for a, b in pairs.tolist():
        (a_id, a_source, a_set), (b_id, b_source, b_set) = known[a], known[b]
        if (b_id, b_source, b) < (a_id, a_source, a):
            a, b, a_id, b_id, a_source, b_source = b, a, b_id, a_id, b_source, a_source
        out.append({"a": a_id, "b": b_id, "a_source": a_source, "b_source": b_source,
                    "jaccard": jaccard_of_sets(a_set, b_set), "a_key": a, "b_key": b})
    return pa.Table.from_pylist(out, schema=CANDIDATE_SCHEMA)


# --------------------------------------------------------------------------- 5: components


def components_in_one_task(u: np.ndarray, v: np.ndarray) -> dict[int, int]:
    """{node: the smallest node of its component}, by hooking and pointer jumping: each round hangs the
    larger root of every edge under the smaller one, then every node jumps to its root. O(log n)
    rounds even on long chains, where propagating labels along edges would take their length."""
    nodes = np.unique(np.concatenate([u, v]))
    iu, iv = np.searchsorted(nodes, u), np.searchsorted(nodes, v)
    parent = np.arange(len(nodes), dtype=np.int64)  # index order = key order: a root is its tree's smallest
    while True:
        ru, rv = parent[iu], parent[iv]
        live = ru != rv
        if not live.any():
            break
        lo, hi = np.minimum(ru[live], rv[live]), np.maximum(ru[live], rv[live])
        np.minimum.at(parent, hi, lo)
        while True:  # jump to the root
            jumped = parent[parent]
            if (jumped == parent).all():
                break
            parent = jumped
    return dict(zip(nodes.tolist(), nodes[parent].tolist()))


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


def components_on_ray(edges, nbytes: int, ray_config, partitions: int):
    """Large-star and small-star rounds over a Ray Data dataset of edges (u > v) until a round moves no
    edge: then every component is a star around its smallest node. Returns (a dataset of (node, root):
    every node with its component's smallest node, roots included, some rows more than once; rounds).
    No task holds more than a partition of edges, and nothing comes back to the caller but counts."""
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
    return edges.map_batches(_star_labels, batch_format="pyarrow"), rounds


def _star_labels(batch: pa.Table) -> pa.Table:
    """Star edges (leaf u, root v) -> (node, root) rows: each leaf, and each root (once per batch)."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    roots = np.unique(v)
    return pa.table({"node": pa.array(np.concatenate([u, roots])), "root": pa.array(np.concatenate([v, roots]))})


# --------------------------------------------------------------------------- 5b: the kept document of each component


def near_edges(batch: pa.Table, threshold: float) -> pa.Table:
    """Checked candidate pairs -> the verified ones (Jaccard >= threshold), as graph edges."""
    batch = batch.filter(pc.greater_equal(batch["jaccard"], threshold))
    return pa.table({**{f.name: batch[f.name] for f in GRAPH_SCHEMA if f.name != "copy"},
                     "copy": pa.array(np.zeros(batch.num_rows, bool))}, schema=GRAPH_SCHEMA)


def copy_edges(batch: pa.Table) -> pa.Table:
    """Exact copies -> graph edges from each text's kept copy (a) to the copy (b), Jaccard 1.0."""
    n = batch.num_rows
    return pa.table({"a_key": batch["kept_key"], "b_key": batch["key"], "a": batch["kept_id"], "b": batch["id"],
                     "a_source": batch["kept_source"], "b_source": batch["source"],
                     "jaccard": pa.array(np.ones(n)), "copy": pa.array(np.ones(n, bool))}, schema=GRAPH_SCHEMA)


def _undirected(batch: pa.Table) -> pa.Table:
    return pa.table({"u": pc.max_element_wise(batch["a_key"], batch["b_key"]),
                     "v": pc.min_element_wise(batch["a_key"], batch["b_key"])})


def edges_keyed(batch: pa.Table, partitions: int) -> pa.Table:
    """Graph edges keyed by their first document, for the join with its label."""
    n = batch.num_rows
    return pa.table({"part": pa.array(part_of(batch["a_key"].to_numpy(), partitions)), "kind": pa.array(["edge"] * n),
                     "root": pa.nulls(n, pa.int64()), **{f.name: batch[f.name] for f in GRAPH_SCHEMA}}, schema=LABEL_JOIN_SCHEMA)


def labels_keyed(batch: pa.Table, partitions: int) -> pa.Table:
    """(node, root) rows keyed by the node, for the join with the edges that start at it."""
    n = batch.num_rows
    return pa.table({"part": pa.array(part_of(batch["node"].to_numpy(), partitions)), "kind": pa.array(["label"] * n),
                     "root": batch["root"], "a_key": batch["node"],
                     **{f.name: pa.nulls(n, f.type) for f in GRAPH_SCHEMA if f.name != "a_key"}}, schema=LABEL_JOIN_SCHEMA)


def with_roots(group: pa.Table, partitions: int) -> pa.Table:
    """One partition of edges and of the labels of their first documents -> the edges with their
    component's root, keyed by that root (so that each component meets in one partition)."""
    labels = group.filter(pc.equal(group["kind"], "label"))
    edges = group.filter(pc.equal(group["kind"], "edge"))
    nodes, first = np.unique(labels["a_key"].to_numpy(), return_index=True)
    roots = labels["root"].to_numpy()[first]
    root = roots[np.searchsorted(nodes, edges["a_key"].to_numpy())]
    return rooted(edges.select(GRAPH_SCHEMA.names), root, partitions)


def rooted(edges: pa.Table, root: np.ndarray, partitions: int) -> pa.Table:
    return edges.append_column("root", pa.array(root, pa.int64())) \
        .append_column("part", pa.array(part_of(root, partitions)))


def assemble_components(group: pa.Table, priority: dict[str, int], first_eval: int) -> pa.Table:
    """The edges of whole components (each with its component's root) -> a row for every document but each
    component's kept one and the evaluation set's (parts from `first_eval` on), with the document's key, its
    reason (`duplicate`, or `near_eval` where the kept one is an evaluation document), and the component's
    size on the first row of each component (0 on the others).

    The kept document is the component's smallest (evaluation set first, source order, id); an exact copy
    goes `via` its text's kept copy with Jaccard 1.0, any other document via its verified neighbour of
    highest Jaccard (ties: the preferred neighbour)."""
    name: dict[int, tuple[str, str]] = {}
    root_of: dict[int, int] = {}
    copy_of: dict[int, int] = {}
    best: dict[int, tuple[float, int]] = {}

    def rank(k: int) -> tuple[bool, int, str, int]:  # smaller = preferred: the evaluation set, source order, id, key
        return k >> ROW_BITS < first_eval, priority.get(name[k][1], len(priority)), name[k][0], k

    columns = [group[c].to_pylist() for c in ("a_key", "b_key", "a", "b", "a_source", "b_source", "jaccard", "copy", "root")]
    for a_key, b_key, a, b, a_source, b_source, _, _, root in zip(*columns):
        name[a_key], name[b_key] = (a, a_source), (b, b_source)
        root_of[a_key] = root_of[b_key] = root
    for a_key, b_key, _, _, _, _, j, copy, _ in zip(*columns):
        if copy:
            copy_of[b_key] = a_key
            continue
        for x, y in ((a_key, b_key), (b_key, a_key)):
            if x not in best or j > best[x][0] or (j == best[x][0] and rank(y) < rank(best[x][1])):
                best[x] = (j, y)
    kept: dict[int, int] = {}
    size: collections.Counter = collections.Counter()
    for node, root in root_of.items():
        size[root] += 1
        if root not in kept or rank(node) < rank(kept[root]):
            kept[root] = node
    out, first = [], set()
    for node in sorted(root_of, key=lambda k: (root_of[k], k)):
        root = root_of[node]
        keep = kept[root]
        if node == keep or node >> ROW_BITS >= first_eval:  # the evaluation set is fixed: nothing leaves it here
            continue
        j, via = (1.0, copy_of[node]) if node in copy_of else best[node]
        out.append({"id": name[node][0], "source": name[node][1], "kept_id": name[keep][0], "kept_source": name[keep][1],
                    "jaccard": j, "via": name[via][0], "key": node, "cluster_size": 0 if root in first else size[root],
                    "reason": evalset.NEAR if keep >> ROW_BITS >= first_eval else DUPLICATE})
        first.add(root)
    return pa.Table.from_pylist(out, schema=ASSEMBLED_SCHEMA)


def tally(batch: pa.Table) -> pa.Table:
    """Assembled rows -> counts: documents removed per (source, kept source, reason), clusters per size."""
    removed = collections.Counter(zip(batch["source"].to_pylist(), batch["kept_source"].to_pylist(), batch["reason"].to_pylist()))
    sizes = collections.Counter(s for s in batch["cluster_size"].to_pylist() if s)
    rows = [{"source": s, "kept_source": k, "reason": r, "size": 0, "n": n} for (s, k, r), n in removed.items()]
    rows += [{"source": None, "kept_source": None, "reason": None, "size": s, "n": n} for s, n in sizes.items()]
    return pa.Table.from_pylist(rows, schema=TALLY_SCHEMA)


def keys_by_part(batch: pa.Table) -> pa.Table:
    """Rows with a document key -> (part, key), for a groupby that writes each part's rows (`write_by_part`)."""
    keys = batch["key"].to_numpy()
    return pa.table({"part": pa.array(keys >> ROW_BITS), "key": pa.array(keys)})


def assemble_in_one_task(candidates: str, exact: str, threshold: float, priority: dict[str, int], first_eval: int,
                         folders: dict[str, str], removed: dict[str, str]) -> tuple[list[dict], int]:
    """The small graph's path: components, kept documents, `duplicates/`, `near_eval/` and each part's removed
    rows (per reason), in one Ray task (memory ~ the duplicate documents). Returns (tally rows, edges)."""
    near = [near_edges(pq.read_table(p), threshold) for p in parquet_files(candidates)]
    copies = [copy_edges(pq.read_table(p)) for p in parquet_files(exact)]
    graph = pa.concat_tables([GRAPH_SCHEMA.empty_table(), *near, *copies])
    undirected = _undirected(graph)
    labels = components_in_one_task(undirected["u"].to_numpy(), undirected["v"].to_numpy()) if graph.num_rows else {}
    root = np.array([labels[k] for k in graph["a_key"].to_pylist()], dtype=np.int64)
    assembled = assemble_components(rooted(graph, root, 1), priority, first_eval)
    for reason, folder in folders.items():
        mine = assembled.filter(pc.equal(assembled["reason"], reason))
        parts = Parts(folder, FOLDERS[reason], DUPLICATE_SCHEMA)
        for row in mine.select(DUPLICATE_SCHEMA.names).to_pylist():
            parts.add(row)
        parts.close()
        Path(removed[reason]).mkdir(parents=True, exist_ok=True)
        keys = mine["key"].to_numpy()
        for part in np.unique(keys >> ROW_BITS).tolist():
            write_by_part(pa.table({"key": keys[(keys >> ROW_BITS) == part]}), removed[reason])
    return tally(assembled).to_pylist(), graph.num_rows


def assemble_on_ray(graph, labels, grouped, partitions: int, priority: dict[str, int], first_eval: int,
                    folders: dict[str, str], removed: dict[str, str]) -> list[dict]:
    """The large graph's path after `components_on_ray`: a groupby joins each edge with its first document's
    label, another brings each component's edges to one task (`assemble_components`), and a third writes
    each part's removed rows. `grouped(ds, phase)`: the stage's groupby on "part", which counts the bytes.
    Writes `duplicates/` and `near_eval/` and returns the tally rows."""
    kw = {"partitions": partitions}
    joined = graph.map_batches(edges_keyed, batch_format="pyarrow", fn_kwargs=kw) \
        .union(labels.map_batches(labels_keyed, batch_format="pyarrow", fn_kwargs=kw))
    by_root = grouped(joined, "components").map_groups(with_roots, batch_format="pyarrow", fn_kwargs=kw)
    assembled = grouped(by_root, "components").map_groups(
        assemble_components, batch_format="pyarrow", fn_kwargs={"priority": priority, "first_eval": first_eval}).materialize()
    for reason, folder in folders.items():
        mine = assembled.map_batches(lambda b, r=reason: b.filter(pc.equal(b["reason"], r)), batch_format="pyarrow").materialize()
        Path(removed[reason]).mkdir(parents=True, exist_ok=True)
        if not mine.count():
            continue
        mine.select_columns(DUPLICATE_SCHEMA.names).write_parquet(folder)
        grouped(mine.map_batches(keys_by_part, batch_format="pyarrow"), "components").map_groups(
            write_by_part, batch_format="pyarrow", fn_kwargs={"folder": removed[reason]}).materialize()
    return assembled.map_batches(tally, batch_format="pyarrow").take_all()


# --------------------------------------------------------------------------- 6: output


@dataclass(frozen=True)
class FilterTask:
    """One part of normalize's output, written by `filter_task` without the rows dedup removed."""
    path: str
    part: int
    stem: str  # of the part files it writes
    removed: dict[str, str]  # reason -> the folder of the rows removed for it, by part (write_by_part)
    output: str


def filter_task(task: FilterTask) -> dict:
    """One part minus its removed rows (by row number, against the part's sorted array), a row group at a time."""
    by_reason = {reason: removed_rows(Path(folder), task.part) for reason, folder in task.removed.items()}
    gone = np.sort(np.concatenate(list(by_reason.values())))
    docs = Parts(task.output, task.stem, DOCUMENT_SCHEMA)
    parquet, start = pq.ParquetFile(task.path), 0
    for i in range(parquet.num_row_groups):
        table = parquet.read_row_group(i)
        keep = np.ones(table.num_rows, dtype=bool)
        keep[gone[(gone >= start) & (gone < start + table.num_rows)] - start] = False
        for row in table.filter(pa.array(keep)).to_pylist():
            docs.add(row, len(row["text"]))
        start += table.num_rows
    docs.close()
    return {"rows_in": start, "rows_out": start - len(gone), **{reason: len(rows) for reason, rows in by_reason.items()}}


def run(ctx: StageContext) -> StageResult:
    import ray
    import ray.data

    cfg: DedupConfig = ctx.section
    bands, rows = (cfg.bands, cfg.rows) if cfg.bands else choose_banding(cfg.num_perm, cfg.threshold)
    parts = input_parts(ctx.inputs, "normalize")
    if not parts:  # normalize kept nothing
        return StageResult(0, 0, {DUPLICATE: 0, evalset.NEAR: 0})
    first_eval = len(parts)  # the evaluation set's parts come after normalize's output's
    training, parts = parts, parts + aside_parts(ctx.inputs, "normalize", evalset.REASON)
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

    def tasks(kind: type[PartTask], out: str, **extra) -> list[PartTask]:
        return [kind(p, i, str(work / out), partitions, i >= first_eval, **extra) for i, p in enumerate(parts)]

    with Bar("dedup", "phases", 6) as bar:  # exact; bands and candidates; candidate documents; verification; components; output
        run_tasks(index_task, tasks(IndexTask, "index", priority=priority))
        exact = work / "exact"
        grouped(ray.data.read_parquet(str(work / "index")), "exact").map_groups(exact_groups, batch_format="pyarrow") \
            .write_parquet(str(exact))
        (work / "exact_rows").mkdir(parents=True)
        if parquet_files(exact):
            keyed = ray.data.read_parquet(str(exact)).map_batches(keys_by_part, batch_format="pyarrow")
            grouped(keyed, "exact").map_groups(write_by_part, batch_format="pyarrow",
                                               fn_kwargs={"folder": str(work / "exact_rows")}).materialize()
        bar.update()

        run_tasks(band_task, tasks(BandTask, "bands", config=cfg, bands=bands, rows=rows, exact=str(work / "exact_rows")))
        grouped(ray.data.read_parquet(str(work / "bands")), "candidates").map_groups(candidate_pairs, batch_format="pyarrow") \
            .write_parquet(str(work / "pairs"))
        bar.update()

        candidates, candidate_documents = ctx.aside("candidates"), 0
        if parquet_files(work / "pairs"):  # no shared band key anywhere: nothing to verify
            pairs = ray.data.read_parquet(str(work / "pairs"))
            which = pairs.map_batches(candidate_keys, batch_format="pyarrow")
            grouped(which, "candidate documents").map_groups(shingle_rows, batch_format="pyarrow",
                                                             fn_kwargs={"paths": parts, "config": cfg}) \
                .write_parquet(str(work / "shingles"))
            candidate_documents = ray.data.read_parquet(str(work / "shingles"), columns=["first"]).sum("first") or 0
            bar.update()
            sent = ray.data.read_parquet(str(work / "shingles")).map_batches(
                lambda b: b.filter(pc.greater_equal(b["part"], 0)), batch_format="pyarrow")
            grouped(pairs.map_batches(pairs_keyed, batch_format="pyarrow").union(sent), "verification") \
                .map_groups(verify, batch_format="pyarrow", fn_kwargs={"paths": parts, "config": cfg}) \
                .write_parquet(str(candidates))
        bar.update_to(4)

        folders = {reason: str(ctx.aside(folder)) for reason, folder in FOLDERS.items()}
        removed, rounds = {reason: str(work / f"removed-{reason}") for reason in FOLDERS}, 0
        checked, copied = rows_in_folder(candidates), rows_in_folder(exact)  # from the footers
        if checked + copied <= SMALL_GRAPH_EDGES:  # at most that many edges: one task
            tallies, edges = ray.get(ray.remote(assemble_in_one_task).remote(
                str(candidates), str(exact), cfg.threshold, priority, first_eval, folders, removed))
        else:
            near = ray.data.read_parquet(str(candidates)).map_batches(near_edges, batch_format="pyarrow",
                                                                       fn_kwargs={"threshold": cfg.threshold}) \
                if checked else None
            copies = ray.data.read_parquet(str(exact)).map_batches(copy_edges, batch_format="pyarrow") \
                if copied else None
            graph = (near.union(copies) if near is not None and copies is not None else near or copies).materialize()
            edges, tallies = graph.count(), []
            for folder in removed.values():
                Path(folder).mkdir(parents=True)
            if edges:
                undirected = graph.map_batches(_undirected, batch_format="pyarrow").materialize()
                shuffled["components"] = undirected.size_bytes()
                labels, rounds = components_on_ray(undirected, undirected.size_bytes(), ctx.config.ray, partitions)
                tallies = assemble_on_ray(graph, labels, grouped, partitions, priority, first_eval, folders, removed)
        found = {"verified_pairs": edges, "rounds": rounds, "removed": collections.Counter(), "near_eval": collections.Counter(),
                 "cluster_sizes": collections.Counter(),
                 "candidate_pairs": checked, "exact_duplicates": copied}
        for t in tallies:
            if t["size"]:
                found["cluster_sizes"][t["size"]] += t["n"]
            else:
                found["removed" if t["reason"] == DUPLICATE else "near_eval"][(t["source"], t["kept_source"])] += t["n"]
        bar.update()

        counts: collections.Counter = collections.Counter()
        for result in run_tasks(filter_task, [FilterTask(p, i, Path(p).stem, removed, str(ctx.output))
                                              for i, p in enumerate(training)]):
            counts.update(result)
        bar.update()
    check_written(folders[DUPLICATE], counts[DUPLICATE], "duplicates removed")
    check_written(folders[evalset.NEAR], counts[evalset.NEAR], "near-duplicates of the evaluation set removed")
    check_written(ctx.output, counts["rows_out"], "documents kept")
    check_read(counts["rows_in"], ctx.inputs, "normalize")
    shutil.rmtree(work, ignore_errors=True)
    found.update(shuffled=shuffled, candidate_fraction=candidate_documents / counts["rows_in"],
                 clusters=sum(found["cluster_sizes"].values()))
    return StageResult(counts["rows_in"], counts["rows_out"], {DUPLICATE: counts[DUPLICATE], evalset.NEAR: counts[evalset.NEAR]},
                       _metrics(found, bands, rows, ctx), fields={"eval": ctx.inputs["normalize"].get("eval")})


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
    near: collections.Counter = collections.Counter()
    for (source, _), n in found["near_eval"].items():
        near[source] += n
    metrics.update({f"near_eval.{source}": n for source, n in near.items()})
    sizes = {int(k): v for k, v in found["cluster_sizes"].items()}
    (ctx.folder / "cluster_sizes.json").write_text(json.dumps(dict(sorted(sizes.items()))) + "\n")
    _log_histogram(sizes, ctx)
    return metrics


def _log_histogram(sizes: dict[int, int], ctx: StageContext) -> None:
    """The cluster-size histogram as a plot on the stage's MLflow run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.tracking import StageRun

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(k) for k in sorted(sizes)], [sizes[k] for k in sorted(sizes)])
    ax.set_xlabel("documents in the cluster")
    ax.set_ylabel("clusters")
    ax.set_title("near-duplicate clusters (kept one of each)")
    fig.tight_layout()
    StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id).log_figure(fig, "cluster_sizes.png")
    plt.close(fig)

"""Phase 4, verification. A pair (a < b) is verified in the unit of its second document: `task_documents`
consecutive rows of one part (`unit_of`). A groupby of the pairs' keys on their own part (the semi-join) lets
one task per part read only its candidate documents whose pairs are verified in another part, and send their
ids, sources and shingle sets there, once per unit that needs them. One groupby then brings each unit its pairs
and those documents; the task reads its own part's documents from the part, and every pair gets its exact
Jaccard. A pair below the threshold is never merged. Every checked pair is kept in `candidates/`, (a, b) in
(id, source) order, with its Jaccard.

Why the second document's unit: a bucket of more than SMALL_BUCKET documents pairs its smallest key with every
other (dedup/candidates.py), so in its first document's part a hot cluster of a million near-copies would be one
task holding them all. In the second's, each unit holds its own rows and their partners (the bucket's smallest
document and each one's neighbour in key order): a task is bounded by `task_documents`, whatever the largest
duplicate cluster, and each pair still has one place, so it is checked once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.ray_session import largest, over_all
from corpus.parts import parquet_files
from dedup.candidates import PAIR_SCHEMA
from dedup.config import DedupConfig
from dedup.keys import ROW_BITS, Inputs, Shuffles, hasher, rows_by_group, unit_of
from dedup.minhash import jaccard_of_sets

CANDIDATE_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("a_source", pa.string()),
                              ("b_source", pa.string()), ("jaccard", pa.float64()), ("a_key", pa.int64()),
                              ("b_key", pa.int64())])
VERIFIED_SCHEMA = CANDIDATE_SCHEMA.append(pa.field("held", pa.int64()))  # what `verify` returns
# Rows of the verification groupby, keyed by unit (`part`): a pair of that unit's (kind "pair": a_key, b_key), or
# a document of another part that one of its pairs needs (kind "doc": a_key, id, source, shingles).
# `first` is 1 on one row of each candidate document (so they can be counted).
JOIN_SCHEMA = pa.schema([("part", pa.int64()), ("kind", pa.string()), *PAIR_SCHEMA, ("id", pa.string()),
                         ("source", pa.string()), ("shingles", pa.binary()), ("first", pa.int64())])


def candidate_keys(batch: pa.Table, task_documents: int) -> pa.Table:
    """Pairs -> both their documents' keys, each with the part that holds it (the semi-join's side) and the
    unit that verifies its pair (its second document's), or -1 where that unit is in its own part (nothing to
    send: the unit reads it from its part), each once per batch."""
    a, b = batch["a_key"].to_numpy(), batch["b_key"].to_numpy()
    keys = np.concatenate([a, b])
    dest = np.tile(unit_of(b, task_documents), 2)
    dest[(keys >> ROW_BITS) == (dest >> ROW_BITS)] = -1
    routes = np.unique(np.stack([keys, dest], axis=1), axis=0)
    return pa.table({"part": pa.array(routes[:, 0] >> ROW_BITS), "key": pa.array(routes[:, 0]), "dest": pa.array(routes[:, 1])})


def read_documents(path: str, keys: np.ndarray, config: DedupConfig) -> tuple[pa.Table, list[np.ndarray]]:
    """Some documents of one part, by key (sorted, unique): their ids and sources, and their shingle sets. Read a
    row group at a time (`rows_by_group`): a task keeps the sets (8 bytes a distinct shingle), and one row group's
    text at most."""
    minhash = hasher(config)
    names, sets = [pa.table({"id": pa.array([], pa.string()), "source": pa.array([], pa.string())})], []
    for table, _ in rows_by_group(path, keys & ((1 << ROW_BITS) - 1), ["id", "source", "text"]):
        names.append(table.select(["id", "source"]))
        sets.extend(minhash.shingle_sets(table["text"].to_pylist()))
    return pa.concat_tables(names), sets


def shingle_rows(group: pa.Table, paths: list[str], config: DedupConfig) -> pa.Table:
    """The candidate documents of one part -> for each unit of another part that verifies one of their pairs,
    their id, source and shingle set, read from this part alone. A document verified only here gets one row
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
                     "shingles": binary_of([None if i is None else sets[i] for i in at.to_pylist()]),
                     "first": pa.array(first.astype(np.int64))}, schema=JOIN_SCHEMA)


def pairs_keyed(batch: pa.Table, task_documents: int) -> pa.Table:
    """Pairs keyed by the unit that verifies them: their second document's."""
    n = batch.num_rows
    return pa.table({"part": pa.array(unit_of(batch["b_key"].to_numpy(), task_documents)), "kind": pa.array(["pair"] * n),
                     "a_key": batch["a_key"], "b_key": batch["b_key"], "id": pa.nulls(n, pa.string()),
                     "source": pa.nulls(n, pa.string()), "shingles": pa.nulls(n, pa.binary()),
                     "first": pa.array(np.zeros(n, np.int64))}, schema=JOIN_SCHEMA)


def verify(group: pa.Table, paths: list[str], config: DedupConfig) -> pa.Table:
    """One unit's pairs (each once, though several bands may have proposed it) and the shingle sets of their
    first documents held in other parts -> each pair's exact Jaccard, and on every row the documents the task
    held (`held`: what bounds its memory). The part's own documents are read from the part; a pair is written
    (a, b) in (id, source) order.

    Beside the sets, a task holds arrays, not a Python object per pair: a unit of a hot cluster has up to
    2 x bands x task_documents pairs: a tuple each held about 360 bytes, the arrays 66 (tests/test_dedup.py)."""
    docs = group.filter(pc.equal(group["kind"], "doc"))
    pairs = np.unique(np.stack([c.to_numpy() for c in group.filter(pc.equal(group["kind"], "pair"))
                                .select(["a_key", "b_key"]).columns], axis=1), axis=0)
    if not len(pairs):
        return VERIFIED_SCHEMA.empty_table()
    part = int(pairs[0, 1] >> ROW_BITS)
    local = np.unique(pairs[(pairs >> ROW_BITS) == part])
    names, local_sets = read_documents(paths[part], local, config)
    keys, first = np.unique(np.concatenate([local, docs["a_key"].to_numpy()]), return_index=True)
    ids = pa.concat_arrays([*names["id"].chunks, *docs["id"].chunks]).take(first)
    sources = pa.concat_arrays([*names["source"].chunks, *docs["source"].chunks]).take(first)
    sets = local_sets + sets_of(docs["shingles"])
    rank = np.empty(len(keys), np.int64)  # each document's place in (id, source, key) order
    order = [("id", "ascending"), ("source", "ascending"), ("key", "ascending")]
    rank[pc.sort_indices(pa.table({"id": ids, "source": sources, "key": keys}), sort_keys=order).to_numpy()] = np.arange(len(keys))
    a, b = np.searchsorted(keys, pairs[:, 0]), np.searchsorted(keys, pairs[:, 1])
    swap = rank[b] < rank[a]
    a, b = np.where(swap, b, a), np.where(swap, a, b)
    at_a, at_b = first[a], first[b]
    jaccard = np.fromiter((jaccard_of_sets(sets[i], sets[j]) for s in range(0, len(a), 4096)
                           for i, j in zip(at_a[s : s + 4096].tolist(), at_b[s : s + 4096].tolist())), np.float64, len(a))
    return pa.table({"a": ids.take(a), "b": ids.take(b), "a_source": sources.take(a), "b_source": sources.take(b),
                     "jaccard": jaccard, "a_key": keys[a], "b_key": keys[b], "held": np.full(len(a), len(keys))},
                    schema=VERIFIED_SCHEMA)


def binary_of(sets: list[np.ndarray | None]) -> pa.Array:
    """uint64 arrays (None: a null) as one binary column, from their bytes at once: no Python bytes object
    per row."""
    offsets = np.concatenate([[0], np.cumsum([0 if x is None else x.nbytes for x in sets], dtype=np.int64)])
    if offsets[-1] >= 1 << 31:
        raise ValueError(f"{offsets[-1]} bytes of shingle sets in one column: over Arrow binary's 2 GiB")
    offsets = offsets.astype(np.int32)
    data = np.concatenate([np.zeros(0, np.uint64), *(x for x in sets if x is not None)])
    valid = pa.array([x is not None for x in sets], pa.bool_()).buffers()[1]
    return pa.Array.from_buffers(pa.binary(), len(sets), [valid, pa.py_buffer(offsets), pa.py_buffer(data)])


def sets_of(column: pa.ChunkedArray) -> list[np.ndarray]:
    """`binary_of`'s column -> each row's uint64 set, a view of the column's own bytes (no copy)."""
    out = []
    for chunk in column.chunks:
        _, offsets, data = chunk.buffers()
        at = np.frombuffer(offsets, np.int32)[chunk.offset : chunk.offset + len(chunk) + 1].tolist()
        data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        out.extend(data[s:e].view(np.uint64) for s, e in zip(at[:-1], at[1:]))
    return out


def verify_candidates(inputs: Inputs, pairs: Path, config: DedupConfig, shuffles: Shuffles, out: Path) -> dict[str, int]:
    """Writes every candidate pair with its exact Jaccard under `out`. Returns the number of candidate documents
    and the most documents one verification task held."""
    import ray.data
    from ray.data.aggregate import Sum

    if not parquet_files(pairs):  # no shared band key anywhere: nothing to verify
        return {"candidate_documents": 0, "largest_task_documents.verification": 0}
    work, kw, unit = inputs.work, {"paths": inputs.parts, "config": config}, {"task_documents": config.task_documents}
    pair_rows = ray.data.read_parquet(str(pairs))
    which = pair_rows.map_batches(candidate_keys, batch_format="pyarrow", fn_kwargs=unit)
    shuffles(which, "candidate documents").map_groups(shingle_rows, batch_format="pyarrow", fn_kwargs=kw) \
        .write_parquet(str(work / "shingles"))
    documents = over_all(ray.data.read_parquet(str(work / "shingles"), columns=["first"]), Sum("first"))["sum(first)"] or 0
    sent = ray.data.read_parquet(str(work / "shingles")).map_batches(
        lambda b: b.filter(pc.greater_equal(b["part"], 0)), batch_format="pyarrow")
    checked = shuffles(pair_rows.map_batches(pairs_keyed, batch_format="pyarrow", fn_kwargs=unit).union(sent), "verification") \
        .map_groups(verify, batch_format="pyarrow", fn_kwargs=kw).materialize()
    checked.drop_columns(["held"]).write_parquet(str(out))
    return {"candidate_documents": documents, "largest_task_documents.verification": largest(checked, "held")}

"""Phases 2 and 3, band keys and candidate pairs. One task per part computes the MinHash band keys
(dedup/minhash.py, dedup/lsh.py) of its documents that are not exact copies (nor removed by decontamination):
rows (band key, partition, key), 20 bytes each. The band rows are then grouped by a coarse partition of the band
key; a bucket (one band key) of k <= SMALL_BUCKET documents gives all its pairs, a bigger one the pairs of its
smallest key with every other and of each neighbour in key order: O(k) instead of O(k^2). A pair is two keys,
a < b."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from corpus.parts import run_tasks
from dedup.config import DedupConfig
from dedup.keys import ROW_BITS, Inputs, PartTask, Shuffles, hasher, kept_rows
from dedup.lsh import band_keys

SMALL_BUCKET = 32  # buckets up to this size give all their pairs
PAIR_SCHEMA = pa.schema([("a_key", pa.int64()), ("b_key", pa.int64())])


@dataclass(frozen=True)
class BandTask(PartTask):
    config: DedupConfig
    bands: int
    rows: int
    exact: str  # the exact copies' rows by part (write_by_part), which get no bands


def band_task(task: BandTask) -> dict:
    """One part -> band rows of its documents that are not exact copies (nor decontamination's): (band, part, key),
    20 bytes."""
    cfg = task.config
    table = pq.read_table(task.path, columns=["text"])
    keep = kept_rows(task.part, table.num_rows, task.exact, task.skip)
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


def find_candidates(inputs: Inputs, config: DedupConfig, bands: int, rows: int, exact_rows: Path, shuffles: Shuffles) -> Path:
    """Writes the candidate pairs under work/pairs (none where no two documents share a band key)."""
    import ray.data

    run_tasks(band_task, inputs.tasks(BandTask, "bands", config=config, bands=bands, rows=rows, exact=str(exact_rows)))
    pairs = inputs.work / "pairs"
    shuffles(ray.data.read_parquet(str(inputs.work / "bands")), "candidates") \
        .map_groups(candidate_pairs, batch_format="pyarrow").write_parquet(str(pairs))
    return pairs

"""Phases 2 and 3, band keys and candidate pairs. One task per part computes the MinHash band keys
(dedup/minhash.py, dedup/lsh.py) of its documents that are not exact copies (nor removed by decontamination):
rows (band key, partition, key), 20 bytes each. The band rows are then grouped by a coarse partition of the band
key; a bucket (one band key) of k <= SMALL_BUCKET documents gives all its pairs, a bigger one the pairs of its
smallest key with every other and of each neighbour in key order: O(k) instead of O(k^2). A bucket of more than
`dedup.task_documents` is never grouped whole (a million near-copies share one in most bands): its smallest key
comes from the tally of heavy keys (dedup/heavy.py), its rows are grouped by unit of its key order (`unit_of`), and
the units' ends are paired across: the same pairs. A pair is two keys, a < b."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.ray_session import largest
from corpus.parts import run_tasks
from dedup.config import DedupConfig
from dedup.heavy import firsts, firsts_mask, heavy_keys, is_heavy, least_of, run_lengths
from dedup.keys import Inputs, PartTask, Shuffles, hasher, kept_groups, part_of, unit_of
from dedup.lsh import band_keys

SMALL_BUCKET = 32  # buckets up to this size give all their pairs
PAIR_SCHEMA = pa.schema([("a_key", pa.int64()), ("b_key", pa.int64())])
HELD_SCHEMA = PAIR_SCHEMA.append(pa.field("held", pa.int64()))  # and the rows the task that found them held


@dataclass(frozen=True)
class BandTask(PartTask):
    config: DedupConfig
    bands: int
    rows: int
    exact: str  # the exact copies' rows by part (write_by_part), which get no bands


def band_task(task: BandTask) -> dict:
    """One part -> band rows of its documents that are not exact copies (nor decontamination's): (band, part, key),
    20 bytes; a row group of text at a time (dedup/keys.py `kept_groups`), hashed a chunk at a time (MinHasher)."""
    cfg, minhash = task.config, hasher(task.config)
    bands, keys = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
    for table, kept in kept_groups(task.path, task.part, ["text"], task.exact, task.skip):
        signatures = minhash.signatures(table["text"].to_pylist())
        bands.append(band_keys(signatures, task.bands, task.rows, seed=cfg.seed).ravel())  # doc 0's bands, doc 1's, ...
        keys.append(np.repeat(kept, task.bands))
    flat = np.concatenate(bands)
    out = pa.table({"band": pa.array(flat, pa.uint64()), "part": pa.array((flat % np.uint64(task.partitions)).astype(np.int32)),
                    "key": pa.array(np.concatenate(keys))})
    Path(task.out).mkdir(parents=True, exist_ok=True)
    pq.write_table(out, Path(task.out) / f"bands-{task.part:05d}.parquet")
    return {"documents": out.num_rows // task.bands, "bytes": out.nbytes}


def bucket_pairs(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs (a < b) of one bucket of distinct sorted keys."""
    k = len(members)
    if k <= SMALL_BUCKET:
        i, j = np.triu_indices(k, 1)
    else:  # the smallest with every other, and each with the next: a spanning set of 2k - 3 pairs
        i = np.concatenate([np.zeros(k - 1, np.int64), np.arange(1, k - 1)])
        j = np.concatenate([np.arange(1, k), np.arange(2, k)])
    return members[i], members[j]


def _buckets(band: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Band rows -> (band, key) sorted, each document once per bucket, and each bucket's start and end."""
    order = np.lexsort((key, band))
    band, key = band[order], key[order]
    fresh = firsts_mask(band, key)
    band, key = band[fresh], key[fresh]  # a document twice in one bucket (two bands alike): once
    starts = firsts(band)
    return band, key, starts, np.append(starts[1:], len(band))


def _pairs(a: list[np.ndarray], b: list[np.ndarray], held: int) -> pa.Table:
    pairs = np.unique(np.stack([np.concatenate([np.zeros(0, np.int64), *a]), np.concatenate([np.zeros(0, np.int64), *b])],
                               axis=1), axis=0)
    return pa.table({"a_key": pa.array(pairs[:, 0]), "b_key": pa.array(pairs[:, 1]),
                     "held": pa.array(np.full(len(pairs), held, np.int64))}, schema=HELD_SCHEMA)


def candidate_pairs(group: pa.Table) -> pa.Table:
    """One partition of band rows -> the candidate pairs (a_key < b_key) of every bucket in it (a bucket =
    a band key), each pair once per partition; `held`: its largest bucket."""
    band, key, starts, ends = _buckets(group["band"].to_numpy(), group["key"].to_numpy())
    a, b = [], []
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):  # buckets of 2+ only
        x, y = bucket_pairs(key[s:e])
        a.append(x)
        b.append(y)
    return _pairs(a, b, int((ends - starts).max(initial=0)))


def bucket_of(block: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Band rows -> (their buckets, their keys): what `heavy_keys` tallies, for each bucket's smallest key."""
    return block["band"].to_numpy(), block["key"].to_numpy()


def keyed_band_rows(batch: pa.Table, heavy: np.ndarray, task_documents: int, partitions: int) -> pa.Table:
    """Band rows, keyed for the candidates' groupby (`part`): by their bucket's partition of `partitions`; or, in a
    heavy bucket (`heavy` set), by bucket and unit (`unit_of`: a run of `task_documents` keys, so a bucket's units
    are runs of its key order), in `partitions` more."""
    mask = is_heavy(batch["band"].to_numpy(), heavy)
    part = batch["part"].to_numpy().astype(np.int64)
    if mask.any():
        unit = unit_of(batch["key"].to_numpy()[mask], task_documents).astype(np.uint64)
        part[mask] = partitions + part_of(batch["band"].to_numpy()[mask] ^ (unit * np.uint64(0x9E3779B97F4A7C15)), partitions)
    return batch.set_column(batch.schema.get_field_index("part"), "part", pa.array(part)).append_column("heavy", pa.array(mask))


def group_pairs(group: pa.Table, heavy: np.ndarray, smallest: np.ndarray, task_documents: int) -> pa.Table:
    """One group of the candidates' groupby -> its pairs (`band` null), and, for heavy buckets' units, each unit's
    ends (`band` set)."""
    if group.num_rows and group["heavy"][0].as_py():
        return heavy_unit_pairs(group, heavy, smallest, task_documents)
    pairs = candidate_pairs(group)
    return pairs.append_column("band", pa.nulls(pairs.num_rows, pa.uint64()))


def heavy_unit_pairs(group: pa.Table, heavy: np.ndarray, smallest: np.ndarray, task_documents: int) -> pa.Table:
    """Band rows of heavy buckets, a partition of (bucket, unit)s -> `bucket_pairs`' pairs of a big bucket that
    fall in each: every key with the bucket's smallest (from the tally), and with the next key in the same unit;
    and each (bucket, unit)'s first and last key (`band` set), whose pairs across units `boundary_pairs` adds."""
    band, key, starts, ends = _buckets(group["band"].to_numpy(), group["key"].to_numpy())
    unit = unit_of(key, task_documents)
    run = firsts_mask(band, unit)
    next_in_run = np.flatnonzero(~run[1:])  # key i and key i + 1, same bucket and unit
    least = least_of(band, heavy, smallest)
    star = key != least
    held = int(run_lengths(run).max(initial=0))
    pairs = _pairs([least[star], key[next_in_run]], [key[star], key[next_in_run + 1]], held)
    first = np.flatnonzero(run)
    last = np.append(first[1:], len(key)) - 1
    ends_ = pa.table({"a_key": pa.array(key[first]), "b_key": pa.array(key[last]),
                      "held": pa.array(np.full(len(first), held, np.int64)), "band": pa.array(band[first])})
    return pa.concat_tables([pairs.append_column("band", pa.nulls(pairs.num_rows, pa.uint64())), ends_])


def unit_rows(batch: pa.Table, ends: bool, partitions: int) -> pa.Table:
    """`group_pairs`' rows -> the pairs; or (`ends`) heavy buckets' units' first and last keys, keyed by bucket."""
    if not ends:
        return batch.filter(pc.is_null(batch["band"])).drop_columns(["band"])
    batch = batch.filter(pc.is_valid(batch["band"]))
    return batch.append_column("part", pa.array(part_of(batch["band"].to_numpy(), partitions)))


def boundary_pairs(group: pa.Table) -> pa.Table:
    """The (bucket, unit)s' first and last keys, a partition of buckets -> the pairs of each unit's last key with the
    next unit's first: with the pairs inside units, each key with the next in its whole bucket."""
    band, first, last = group["band"].to_numpy(), group["a_key"].to_numpy(), group["b_key"].to_numpy()
    order = np.lexsort((first, band))
    band, first, last = band[order], first[order], last[order]
    same = np.flatnonzero(band[1:] == band[:-1])
    return _pairs([last[same]], [first[same + 1]], int(run_lengths(firsts_mask(band)).max(initial=0)))


def find_candidates(inputs: Inputs, config: DedupConfig, bands: int, rows: int, exact_rows: Path,
                    shuffles: Shuffles) -> tuple[Path, int]:
    """Writes the candidate pairs under work/pairs (none where no two documents share a band key). A bucket of more
    than `task_documents` documents is not grouped whole: its smallest key comes from the tally of heavy keys
    (dedup/heavy.py), and its pairs are made per unit of its key order. Returns (the folder, the most rows of one
    bucket, or of one bucket's units, that one task grouped)."""
    import ray.data

    run_tasks(band_task, inputs.tasks(BandTask, "bands", config=config, bands=bands, rows=rows, exact=str(exact_rows)))
    pairs = inputs.work / "pairs"
    band_rows = ray.data.read_parquet(str(inputs.work / "bands")).materialize()
    bound = max(config.task_documents, SMALL_BUCKET)  # a bucket up to SMALL_BUCKET gives all its pairs
    heavy, smallest = heavy_keys(band_rows, bucket_of, bound, shuffles, "candidates")
    keyed = band_rows.map_batches(keyed_band_rows, batch_format="pyarrow", fn_kwargs={
        "heavy": heavy, "task_documents": config.task_documents, "partitions": inputs.partitions})
    out = shuffles(keyed, "candidates", band_rows.size_bytes()).map_groups(group_pairs, batch_format="pyarrow", fn_kwargs={
        "heavy": heavy, "smallest": smallest, "task_documents": config.task_documents}).materialize()
    found = out.map_batches(unit_rows, batch_format="pyarrow", fn_kwargs={"ends": False, "partitions": inputs.partitions})
    if len(heavy):
        ends = out.map_batches(unit_rows, batch_format="pyarrow", fn_kwargs={"ends": True, "partitions": inputs.partitions})
        found = found.union(shuffles(ends, "candidates").map_groups(boundary_pairs, batch_format="pyarrow"))
    found = found.materialize()
    held = largest(found, "held")
    found.drop_columns(["held"]).write_parquet(str(pairs))
    return pairs, held

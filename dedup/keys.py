"""What every dedup phase shares: a document's key, the stable partition of a key, the tasks that read one of
normalize's parts (without the rows decontamination removed), and the per-part files of removed rows.

A document's key is its place: `part << ROW_BITS | row` (an int64) in normalize's parts, read in a fixed order.
Keys are what the shuffles carry, what finds a document's text again (a read of its own part, not a join) and
what removal matches on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.ray_session import RayConfig, groupby
from corpus.parts import parquet_bytes
from dedup.config import DedupConfig
from dedup.minhash import MinHasher

ROW_BITS = 32  # key = part << ROW_BITS | row
PARTITION_BYTES = 64 << 20  # of shuffled rows per groupby partition


def part_of(values: np.ndarray, partitions: int) -> np.ndarray:
    """A stable partition for each int64 key (the same in every worker)."""
    mixed = (values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return (mixed % np.uint64(partitions)).astype(np.int64)


def partitions_for(nbytes: int) -> int:
    """Groupby partitions for `nbytes` of shuffled rows: one per PARTITION_BYTES."""
    return max(1, -(-nbytes // PARTITION_BYTES))


def unit_of(keys: np.ndarray, task_documents: int) -> np.ndarray:
    """The unit of each key: its part (high bits, as in the key) and its row // task_documents. A unit is a run of
    the key order: what a verification task checks (dedup/verify.py), and a heavy bucket's share of one task
    (dedup/candidates.py)."""
    return (keys >> ROW_BITS << ROW_BITS) | ((keys & ((1 << ROW_BITS) - 1)) // task_documents)


def hasher(config: DedupConfig) -> MinHasher:
    return MinHasher(num_perm=config.num_perm, ngram=config.ngram, seed=config.seed, lowercase=config.lowercase)


@dataclass(frozen=True)
class PartTask:
    """One of normalize's parts, for a phase that writes under `out` rows keyed to `partitions` shuffle partitions,
    and skips the part's rows that decontamination removed (listed in `skip`, as `write_by_part` writes them)."""
    path: str
    part: int
    out: str
    partitions: int
    skip: str


@dataclass
class Shuffles:
    """The stage's groupbys on "part", each with partitions sized from the bytes it moves (Ray Data's block
    sizes, once the input is materialized), and those bytes counted per phase for the stage's metrics."""
    ray: RayConfig
    moved: dict[str, int] = field(default_factory=dict)

    def __call__(self, ds, phase: str, size: int | None = None):
        """`size`: the bytes `ds` moves, where the caller knows them (about its materialized input's); else `ds`
        is materialized to read them."""
        if size is None:
            ds = ds.materialize()
            size = ds.size_bytes()
        self.moved[phase] = self.moved.get(phase, 0) + size
        return groupby(ds, "part", size, self.ray, num_partitions=partitions_for(size))


def removed_rows(folder: Path, part: int) -> np.ndarray:
    """The sorted rows of `part` listed in `folder` (written by `write_by_part`)."""
    path = folder / f"part-{part:05d}.npy"
    return np.load(path) if path.is_file() else np.zeros(0, dtype=np.int64)


def kept_rows(part: int, rows: int, *folders: str) -> np.ndarray:
    """The rows of a part of `rows` rows that none of `folders` (each written by `write_by_part`) lists, sorted."""
    gone = [removed_rows(Path(f), part) for f in folders]
    return np.setdiff1d(np.arange(rows, dtype=np.int64), np.concatenate([np.zeros(0, np.int64), *gone]))


def rows_by_group(path: str, rows: np.ndarray, columns: list[str] | None):
    """Some rows of one part (sorted, unique), a row group at a time, reading only the groups that hold them:
    (those rows' `columns`, all with None; the rows). A part holds up to PART_BYTES of text in row groups of GROUP_ROWS rows
    (corpus/parts.py): a task that reads this way holds one group's text, whatever the part's size."""
    parquet = pq.ParquetFile(path)
    sizes = np.array([parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)], np.int64)
    starts = np.cumsum(sizes) - sizes
    group = np.searchsorted(starts + sizes, rows, side="right")
    cuts = np.flatnonzero(np.diff(group)) + 1
    for these, g in zip(np.split(rows, cuts), np.split(group, cuts)):
        if len(these):
            yield parquet.read_row_group(int(g[0]), columns=columns).take(pa.array(these - starts[g[0]])), these


def kept_groups(path: str, part: int, columns: list[str], *folders: str):
    """The rows of one part that none of `folders` lists, a row group at a time (`rows_by_group`): (those rows'
    `columns`, their keys)."""
    rows = kept_rows(part, pq.ParquetFile(path).metadata.num_rows, *folders)
    for table, these in rows_by_group(path, rows, columns):
        yield table, (np.int64(part) << np.int64(ROW_BITS)) + these


def write_by_part(group: pa.Table, folder: str) -> pa.Table:
    """Keys of one part -> that part's sorted rows, in one file (each output task reads only its own)."""
    keys = group["key"].to_numpy()
    part = int(keys[0] >> ROW_BITS)
    np.save(Path(folder) / f"part-{part:05d}.npy", np.unique(keys & ((1 << ROW_BITS) - 1)))
    return pa.table({"part": [part], "rows": [len(keys)]})


def keys_by_part(batch: pa.Table) -> pa.Table:
    """Rows with a document key -> (part, key), for a groupby that writes each part's rows (`write_by_part`)."""
    keys = batch["key"].to_numpy()
    return pa.table({"part": pa.array(keys >> ROW_BITS), "key": pa.array(keys)})


@dataclass(frozen=True)
class Inputs:
    """The parts dedup reads: normalize's output; and the stage's scratch folder `work`. `partitions`: the
    corpus-sized count of shuffle keys, from the parts' footers, read once (`of`)."""
    parts: list[str]
    work: Path
    partitions: int

    @classmethod
    def of(cls, parts: list[str], work: Path) -> Inputs:
        return cls(parts, work, partitions_for(parquet_bytes(parts)))

    @property
    def decontaminated(self) -> Path:
        """The rows of each part that decontamination removed (dedup/decontaminate.py), by part."""
        return self.work / "decontaminated"

    def tasks(self, kind: type[PartTask], out: str, **extra) -> list[PartTask]:
        """A task of `kind` for every part, writing under work/`out`."""
        return [kind(p, i, str(self.work / out), self.partitions, str(self.decontaminated), **extra)
                for i, p in enumerate(self.parts)]

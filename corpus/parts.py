"""File-parallel work on Ray Data: one task per group of files, each writing its own Parquet parts.

A corpus stage turns every input file into rows of a few kinds (documents, rejects, rows set
aside for a reason). Writing them from the task that produced them (datatrove's way) keeps each
kind in its own folder without a second pass over the data and without holding a file's rows in
memory or in Ray's object store: a task streams its input, `Parts` flushes row groups as they
fill and starts a new file every `part_bytes`, and only the task's counters travel back to the
driver. Part names derive from the task (not from a random write id), so a retried task
overwrites its own parts and a rerun of the same input gives the same files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

# design.md's documents contract: what ingest, normalize and dedup write to their output/.
DOCUMENT_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
                             ("subset", pa.string()), ("meta", pa.string())])

GROUP_ROWS = 2048  # rows per Parquet row group (also what a reader of the part holds at once)
PART_BYTES = 256 << 20  # a part is closed after about this many bytes of strings


class Parts:
    """Rows of one schema, appended one at a time, written as `<folder>/<stem>-NNNN.parquet`."""

    def __init__(self, folder: str | os.PathLike, stem: str, schema: pa.Schema, part_bytes: int = PART_BYTES):
        self.folder, self.stem, self.schema, self.part_bytes = Path(folder), stem, schema, part_bytes
        self.rows = 0
        self._buffer: list[dict] = []
        self._writer: pq.ParquetWriter | None = None
        self._part, self._part_bytes = 0, 0

    def add(self, row: dict, size: int = 0) -> None:
        """`size`: the row's weight towards the part size (its text's length, say)."""
        self._buffer.append(row)
        self.rows += 1
        self._part_bytes += size
        if len(self._buffer) >= GROUP_ROWS:
            self._flush()
        if self._part_bytes >= self.part_bytes:
            self._flush()
            self._close_part()

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._writer is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{self.stem}-{self._part:04d}.parquet"
            self._writer = pq.ParquetWriter(path, self.schema, compression="zstd")
        self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema), row_group_size=GROUP_ROWS)
        self._buffer = []

    def _close_part(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._part += 1
        self._part_bytes = 0

    def close(self) -> int:
        self._flush()
        self._close_part()
        return self.rows


def parquet_files(folder: str | os.PathLike) -> list[str]:
    """The Parquet parts in a folder, sorted (a missing folder has none)."""
    folder = Path(folder)
    return sorted(str(p) for p in folder.glob("*.parquet")) if folder.is_dir() else []


def rows_in_folder(folder: str | os.PathLike) -> int:
    """Rows in a folder's parts, from their footers (nothing is read)."""
    return sum(pq.ParquetFile(p).metadata.num_rows for p in parquet_files(folder))


def iter_rows(path: str, columns: list[str] | None = None):
    """A part's rows as dicts, one row group at a time."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=GROUP_ROWS, columns=columns):
        yield from batch.to_pylist()


def group_by_size(paths: list[str], target_bytes: int) -> list[list[str]]:
    """Consecutive files packed into groups of about `target_bytes` (a big file is a group of its own).

    Ten thousand small books are a few tasks, not ten thousand; a 30 GB dump is one task.
    """
    groups: list[list[str]] = []
    size = 0
    for path in paths:
        file_size = os.path.getsize(path)
        if not groups or size + file_size > target_bytes:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += file_size
    return groups


def run_tasks(fn: Callable[[dict], dict], tasks: list[dict], num_cpus: float = 1) -> list[dict]:
    """`fn(task) -> counters` for every task, as Ray Data tasks (one block per task), results in task order.

    Tasks and results travel as JSON strings so that Arrow never has to infer a schema for them.
    """
    import ray.data

    if not tasks:
        return []

    def one(row: dict[str, Any]) -> dict[str, Any]:
        task = json.loads(row["task"])
        return {"index": row["index"], "result": json.dumps(fn(task))}

    items = [{"index": i, "task": json.dumps(t)} for i, t in enumerate(tasks)]
    rows = ray.data.from_items(items, override_num_blocks=len(items)).map(one, num_cpus=num_cpus).take_all()
    return [json.loads(r["result"]) for r in sorted(rows, key=lambda r: r["index"])]

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

import contextlib
import dataclasses
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

T = TypeVar("T")  # a task: a frozen dataclass (run_tasks)

# design.md's documents contract: what ingest, normalize and dedup write to their output/.
DOCUMENT_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
                             ("subset", pa.string()), ("meta", pa.string())])
DROPPED_SCHEMA = DOCUMENT_SCHEMA.append(pa.field("reason", pa.string()))  # a document set aside, and why

GROUP_ROWS = 2048  # rows per Parquet row group at most (also what a reader holds at once) ...
GROUP_BYTES = 32 << 20  # ... and about this many bytes of strings at most (books are megabytes each)
PART_BYTES = 256 << 20  # a part is closed after about this many bytes of strings
# Columns of free text, kilobytes a value: their footers keep no min/max statistics. A row group's text min and
# max are two documents' first kilobytes (Arrow keeps values up to 4 KB): most of a part's footer, which nothing
# reads and every footer read parses in the driver (each stage's checks and task planning, the commit's
# files.json, the run summary), so its memory there grew with the corpus (issue #61).
FREE_TEXT = frozenset({"text", "meta", "head", "body", "title"})


class Parts:
    """Rows of one schema, appended one at a time, written as `<folder>/<stem>-NNNN.parquet`."""

    def __init__(self, folder: str | os.PathLike, stem: str, schema: pa.Schema, part_bytes: int = PART_BYTES):
        self.folder, self.stem, self.schema, self.part_bytes = Path(folder), stem, schema, part_bytes
        self.rows = 0
        self._buffer: list[dict] = []
        self._buffer_bytes = 0
        self._writer: pq.ParquetWriter | None = None
        self._part, self._part_bytes = 0, 0

    def add(self, row: dict, size: int = 0) -> None:
        """`size`: the row's weight towards the part size (its text's length, say)."""
        self._buffer.append(row)
        self.rows += 1
        self._part_bytes += size
        self._buffer_bytes += size
        if len(self._buffer) >= GROUP_ROWS or self._buffer_bytes >= GROUP_BYTES:
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
            stated = [name for name in self.schema.names if name not in FREE_TEXT]
            self._writer = pq.ParquetWriter(path, self.schema, compression="zstd", write_statistics=stated)
        self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema), row_group_size=len(self._buffer))
        self._buffer, self._buffer_bytes = [], 0

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


def input_parts(inputs: dict[str, dict], upstream: str) -> list[str]:
    """The Parquet parts of an input stage's committed output. A missing folder, an unreadable part or fewer
    rows than the stage committed is an error naming the path and the counts: never an empty input."""
    manifest = inputs[upstream]
    folder, committed = Path(manifest["output"]), manifest["counts"]["rows_out"]
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: {upstream}'s output is missing ({committed} rows committed there)")
    parts = parquet_files(folder)
    found = 0
    for part in parts:
        try:
            found += pq.ParquetFile(part).metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise RuntimeError(f"{part}: {upstream}'s output cannot be read ({type(exc).__name__}: {exc})") from None
    if found != committed:
        raise RuntimeError(f"{folder}: {found} rows in {len(parts)} part(s), but {upstream} committed {committed}")
    return parts


def aside_parts(inputs: dict[str, dict], upstream: str, reason: str) -> list[str]:
    """The Parquet parts an input stage set aside for `reason` (beside its output), checked as `input_parts`
    checks the output: the rows there are the rows it committed under that reason."""
    manifest = inputs[upstream]
    folder, committed = Path(manifest["output"]).parent / reason, manifest["counts"].get(reason, 0)
    parts = parquet_files(folder)
    found = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    if found != committed:
        raise RuntimeError(f"{folder}: {found} rows in {len(parts)} part(s), but {upstream} committed {committed} as {reason!r}")
    return parts


def rows_in_folder(folder: str | os.PathLike) -> int:
    """Rows in a folder's parts, from their footers (nothing is read)."""
    return sum(pq.ParquetFile(p).metadata.num_rows for p in parquet_files(folder))


def check_written(folder: str | os.PathLike, counted: int, what: str) -> None:
    """A stage's own check before it commits: the rows it counted are the rows on disk."""
    written = rows_in_folder(folder)
    if written != counted:
        raise RuntimeError(f"{what}: counted {counted} rows but {written} are written")


def check_read(read: int, inputs: dict[str, dict], upstream: str) -> None:
    """A stage read every document its input stage committed, no more, no fewer."""
    expected = inputs[upstream]["counts"]["rows_out"]
    if read != expected:
        raise RuntimeError(f"read {read} documents but {upstream} wrote {expected}")


def iter_rows(path: str, columns: list[str] | None = None, row_groups: list[int] | None = None):
    """A part's rows (or those of some of its row groups) as dicts, one batch at a time."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=GROUP_ROWS, columns=columns, row_groups=row_groups):
        yield from batch.to_pylist()


def parquet_bytes(paths: list[str]) -> int:
    """The parts' size uncompressed, from their footers."""
    total = 0
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        total += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return total


def row_group_ranges(paths: list[str], target_bytes: int) -> list[tuple[str, list[int]]]:
    """Each part's row groups in runs of about `target_bytes` (uncompressed): the next stage's tasks.

    A stage reading one big part still gets as many tasks as it has cores to give them to.
    """
    tasks = []
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        run, size = [], 0
        for i in range(meta.num_row_groups):
            if run and size + meta.row_group(i).total_byte_size > target_bytes:
                tasks.append((path, run))
                run, size = [], 0
            run.append(i)
            size += meta.row_group(i).total_byte_size
        if run:
            tasks.append((path, run))
    return tasks


def task_bytes(total_bytes: int, limit_bytes: int) -> int:
    """How much input one task gets: at most `limit_bytes`, and little enough that every CPU of the
    Ray cluster (local or not) gets two tasks when there is enough input to go round (two, so
    that uneven tasks still keep every core busy to the end)."""
    import ray

    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    return max(1 << 20, min(limit_bytes, total_bytes // (2 * cpus)))


def group_by_size(sizes: dict[str, int], target_bytes: int) -> list[list[str]]:
    """Consecutive files (path -> bytes, in order) packed into groups of about `target_bytes`: a group
    is closed once it holds that much (so it may pass it by one file; a big file is a group of its own).

    Ten thousand small books are a few tasks, not ten thousand; a 30 GB dump is one task.
    """
    groups: list[list[str]] = []
    size = target_bytes
    for path, nbytes in sizes.items():
        if size >= target_bytes:  # the last group is full: start another
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += nbytes
    return groups


def run_tasks(fn: Callable[[T], dict], tasks: list[T], num_cpus: float = 1, stage: str | None = None) -> list[dict]:
    """`fn(task) -> counters` for every task, as Ray Data tasks (one block per task), results in task order;
    with `stage`, a progress bar of the tasks done under that stage's name.

    A task is a frozen dataclass of its own kind, built (and so checked) on the driver, pickled to the worker:
    a misspelt field fails here, not inside a Ray worker. Results travel as JSON strings so that Arrow never has
    to infer a schema for them.
    """
    import ray.data

    from core.console import Bar

    if not tasks:
        return []
    kinds = {type(t) for t in tasks}
    if len(kinds) != 1 or not dataclasses.is_dataclass(tasks[0]) or not tasks[0].__dataclass_params__.frozen:
        raise TypeError(f"tasks must be frozen dataclasses of one kind, got {sorted(k.__name__ for k in kinds)}")

    def one(row: dict[str, Any]) -> dict[str, Any]:
        return {"index": row["index"], "result": json.dumps(fn(pickle.loads(row["task"])))}

    one.__name__ = one.__qualname__ = fn.__name__  # Ray Data's operator and its workers' titles: Map(band_task)

    items = [{"index": i, "task": pickle.dumps(t)} for i, t in enumerate(tasks)]
    rows = []
    with Bar(stage, "tasks", len(items)) if stage else contextlib.nullcontext() as bar:
        for row in ray.data.from_items(items, override_num_blocks=len(items)).map(one, num_cpus=num_cpus).iter_rows():
            rows.append(row)
            if bar is not None:
                bar.update()
    return [json.loads(r["result"]) for r in sorted(rows, key=lambda r: r["index"])]

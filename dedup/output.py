"""Phase 6, the output: one task per part of normalize's output drops its removed rows by row number, against
the part's sorted array of them (written per reason: by decontamination, and by the assembly), a row group at a
time."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from corpus.parts import DOCUMENT_SCHEMA, Parts, run_tasks
from dedup.keys import Inputs, removed_rows, rows_by_group


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
    n = pq.ParquetFile(task.path).metadata.num_rows
    docs = Parts(task.output, task.stem, DOCUMENT_SCHEMA)
    for table, _ in rows_by_group(task.path, np.setdiff1d(np.arange(n, dtype=np.int64), gone), None):
        for row in table.to_pylist():
            docs.add(row, len(row["text"]))
    docs.close()
    return {"rows_in": n, "rows_out": n - len(gone), **{reason: len(rows) for reason, rows in by_reason.items()}}


def write_output(inputs: Inputs, removed: dict[str, str], output: Path) -> collections.Counter:
    """Writes the kept documents of every part under `output`. Returns the counts: rows in and out, and the rows
    removed per reason."""
    counts: collections.Counter = collections.Counter()
    for result in run_tasks(filter_task, [FilterTask(p, i, Path(p).stem, removed, str(output))
                                          for i, p in enumerate(inputs.parts)]):
        counts.update(result)
    return counts

"""Phase 1, exact duplicates: one task per part hashes every text (128-bit BLAKE2b) but those decontamination
removed, and writes an index of key, hash, id and source; a groupby on the hash collapses identical texts to their
kept copy (source order in the config, then the smallest id). Every phase after this one sees one document per
text: the copies get no MinHash bands, and join the components' graph linked to their text's kept copy."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus.parts import parquet_files, run_tasks
from dedup.keys import Inputs, PartTask, Shuffles, keys_by_part, keys_of, kept_rows, write_by_part


@dataclass(frozen=True)
class IndexTask(PartTask):
    priority: dict[str, int]  # source -> its rank as the kept copy (the config's order)


def index_task(task: IndexTask) -> dict:
    """One part -> its index rows: key, the text's 128-bit hash (two uint64), priority, id, source."""
    table = pq.read_table(task.path, columns=["id", "source", "text"])
    keys = keys_of(task.part, table.num_rows)
    kept = kept_rows(task.part, table.num_rows, task.skip)
    table, keys, n = table.take(pa.array(kept)), keys[kept], len(kept)
    digest = b"".join(hashlib.blake2b(t.encode(), digest_size=16).digest() for t in table["text"].to_pylist())
    h = np.frombuffer(digest, dtype=np.uint64).reshape(n, 2) if n else np.zeros((0, 2), dtype=np.uint64)
    priority = task.priority
    prio = [priority.get(s, len(priority)) for s in table["source"].to_pylist()]
    out = pa.table({"part": pa.array((h[:, 0] % np.uint64(task.partitions)).astype(np.int32)),
                    "key": pa.array(keys), "h1": pa.array(h[:, 0]), "h2": pa.array(h[:, 1]),
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


def find_exact(inputs: Inputs, priority: dict[str, int], shuffles: Shuffles) -> tuple[Path, Path]:
    """Writes the exact copies (key, id, source and their kept copy's) and each part's copied rows
    (`write_by_part`). Returns (the copies' folder, the rows' folder)."""
    import ray.data

    run_tasks(index_task, inputs.tasks(IndexTask, "index", priority=priority))
    exact, rows = inputs.work / "exact", inputs.work / "exact_rows"
    shuffles(ray.data.read_parquet(str(inputs.work / "index")), "exact") \
        .map_groups(exact_groups, batch_format="pyarrow").write_parquet(str(exact))
    rows.mkdir(parents=True)
    if parquet_files(exact):
        keyed = ray.data.read_parquet(str(exact)).map_batches(keys_by_part, batch_format="pyarrow")
        shuffles(keyed, "exact").map_groups(write_by_part, batch_format="pyarrow", fn_kwargs={"folder": str(rows)}).materialize()
    return exact, rows

"""Phase 1, exact duplicates: one task per part hashes every text (128-bit BLAKE2b) but those decontamination
removed, and writes an index of key, hash, id and source; a groupby on the hash collapses identical texts to their
kept copy (source order in the config, then the smallest id). A text of more than `dedup.task_documents` copies
(a cookie notice, a licence footer) is not grouped: its kept copy is reduced per block and then on the driver,
and sent to every block (dedup/heavy.py). Every phase after this one sees one document per text: the copies get no
MinHash bands, and join the components' graph linked to their text's kept copy."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.ray_session import collect, largest
from corpus.parts import parquet_files, run_tasks
from dedup.heavy import firsts_mask, heavy_keys, heavy_rows, run_lengths
from dedup.keys import Inputs, PartTask, Shuffles, kept_groups, keys_by_part, write_by_part


@dataclass(frozen=True)
class IndexTask(PartTask):
    priority: dict[str, int]  # source -> its rank as the kept copy (the config's order)


INDEX_SCHEMA = pa.schema([("part", pa.int32()), ("key", pa.int64()), ("h1", pa.uint64()), ("h2", pa.uint64()),
                          ("prio", pa.int32()), ("id", pa.string()), ("source", pa.string())])


def index_task(task: IndexTask) -> dict:
    """One part -> its index rows: key, the text's 128-bit hash (two uint64), priority, id, source; a row group
    of text at a time."""
    pieces = [index_rows(table, keys, task) for table, keys in kept_groups(task.path, task.part, ["id", "source", "text"],
                                                                           task.skip)]
    out = pa.concat_tables([INDEX_SCHEMA.empty_table(), *pieces])
    Path(task.out).mkdir(parents=True, exist_ok=True)
    pq.write_table(out, Path(task.out) / f"index-{task.part:05d}.parquet")
    return {"rows": out.num_rows, "bytes": out.nbytes}


def index_rows(table: pa.Table, keys: np.ndarray, task: IndexTask) -> pa.Table:
    digest = b"".join(hashlib.blake2b(t.encode(), digest_size=16).digest() for t in table["text"].to_pylist())
    h = np.frombuffer(digest, dtype=np.uint64).reshape(len(keys), 2)
    priority = task.priority
    prio = [priority.get(s, len(priority)) for s in table["source"].to_pylist()]
    return pa.table({"part": pa.array((h[:, 0] % np.uint64(task.partitions)).astype(np.int32)),
                     "key": pa.array(keys), "h1": pa.array(h[:, 0]), "h2": pa.array(h[:, 1]),
                     "prio": pa.array(prio, pa.int32()), "id": table["id"], "source": table["source"]}, schema=INDEX_SCHEMA)


TEXT = [("h1", "ascending"), ("h2", "ascending")]
KEPT_FIRST = [*TEXT, ("prio", "ascending"), ("id", "ascending"), ("key", "ascending")]


def _new_text(g: pa.Table) -> np.ndarray:
    """Sorted index rows -> a mask of each text's first row."""
    return firsts_mask(g["h1"].to_numpy(), g["h2"].to_numpy())


def exact_groups(group: pa.Table) -> pa.Table:
    """Index rows of one partition of text hashes -> one row per copy that is not its text's kept copy; `held`:
    the most rows of one text in this task."""
    g = group.take(pc.sort_indices(group, KEPT_FIRST))
    new_text = _new_text(g)
    first = np.maximum.accumulate(np.where(new_text, np.arange(len(new_text)), 0))  # each row's text's first (kept) row
    copies = np.flatnonzero(~new_text)
    keep = first[copies]
    return pa.table({"key": g["key"].take(copies), "id": g["id"].take(copies), "source": g["source"].take(copies),
                     "kept_key": g["key"].take(keep), "kept_id": g["id"].take(keep), "kept_source": g["source"].take(keep),
                     "held": pa.array(np.full(len(copies), run_lengths(new_text).max(initial=0), np.int64))})


def text_of(block: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Index rows -> (their texts' first hash, their keys): what `heavy_keys` tallies."""
    return block["h1"].to_numpy(), block["key"].to_numpy()


def kept_copies(rows: pa.Table) -> pa.Table:
    """Index rows -> each text's most preferred row. Reduces its own output again: per block, then on the driver."""
    g = rows.take(pc.sort_indices(rows, KEPT_FIRST))
    return g.filter(pa.array(_new_text(g))).select(["h1", "h2", "prio", "key", "id", "source"])


def heavy_copies(batch: pa.Table, kept: pa.Table) -> pa.Table:
    """Index rows of heavy texts, and each heavy text's kept copy -> a row per copy that is not it (as
    `exact_groups`' rows; `held` 0: no text is grouped here)."""
    kept = kept.select(["h1", "h2", "key", "id", "source"]).rename_columns(["h1", "h2", "kept_key", "kept_id", "kept_source"])
    rows = batch.select(["h1", "h2", "key", "id", "source"]).join(kept, ["h1", "h2"])
    rows = rows.filter(pc.not_equal(rows["key"], rows["kept_key"]))
    return rows.select(["key", "id", "source", "kept_key", "kept_id", "kept_source"]) \
        .append_column("held", pa.array(np.zeros(rows.num_rows, np.int64)))


def find_exact(inputs: Inputs, priority: dict[str, int], shuffles: Shuffles, bound: int) -> tuple[Path, Path, int]:
    """Writes the exact copies (key, id, source and their kept copy's) and each part's copied rows
    (`write_by_part`). A text of more than `bound` copies is not grouped: its kept copy is found per block and
    then on the driver, and sent to every block (dedup/heavy.py). Returns (the copies' folder, the rows' folder,
    the most rows of one text one task grouped)."""
    import ray.data

    run_tasks(index_task, inputs.tasks(IndexTask, "index", priority=priority))
    exact, rows = inputs.work / "exact", inputs.work / "exact_rows"
    index = ray.data.read_parquet(str(inputs.work / "index")).materialize()
    heavy, _ = heavy_keys(index, text_of, bound, shuffles, "exact")
    kw = {"column": "h1", "heavy": heavy}
    cold = index.map_batches(heavy_rows, batch_format="pyarrow", fn_kwargs={**kw, "keep": False}) if len(heavy) else index
    copies = shuffles(cold, "exact", index.size_bytes()).map_groups(exact_groups, batch_format="pyarrow")
    if len(heavy):
        hot = index.map_batches(heavy_rows, batch_format="pyarrow", fn_kwargs={**kw, "keep": True}).materialize()
        kept = kept_copies(collect(hot.map_batches(kept_copies, batch_format="pyarrow")))
        copies = copies.union(hot.map_batches(heavy_copies, batch_format="pyarrow", fn_kwargs={"kept": kept}))
    copies = copies.materialize()
    held = largest(copies, "held")
    copies.drop_columns(["held"]).write_parquet(str(exact))
    rows.mkdir(parents=True)
    if parquet_files(exact):
        keyed = ray.data.read_parquet(str(exact)).map_batches(keys_by_part, batch_format="pyarrow")
        shuffles(keyed, "exact").map_groups(write_by_part, batch_format="pyarrow", fn_kwargs={"folder": str(rows)}).materialize()
    return exact, rows, held

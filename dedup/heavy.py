"""Heavy keys: the values of a groupby's key on more rows than one task may hold (`dedup.task_documents`).

A groupby hands each task whole groups, so a key shared by a million rows is a million rows in one task: the
text of a boilerplate page copied a million times (exact), the band key of a million near-copies (candidates),
the node every one of them is linked to (components). Each such phase first finds its heavy keys, and handles
their rows without a groupby: what a heavy key's rows need from each other is a minimum (the kept copy, the
bucket's smallest document, a node's smallest neighbour), which the driver receives as one row per heavy key and
sends to every task. Only the other rows are grouped.

Finding them costs no task more than a block, or one row per block for each key: each block is tallied (a row per
distinct key: its count and its smallest), the tallies are grouped and summed, and the keys over the bound come
back. Most of the time nothing needs grouping: the sum over blocks of each block's largest count bounds every key's
total, and when it is within the bound no key can be heavy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dedup.keys import Shuffles, part_of, partitions_for


def firsts_mask(values: np.ndarray) -> np.ndarray:
    """A mask of the first of each run of equal values (sorted input)."""
    return np.concatenate([[True], values[1:] != values[:-1]]) if len(values) else np.zeros(0, bool)


def firsts(values: np.ndarray) -> np.ndarray:
    """The index of the first of each run of equal values (sorted input)."""
    return np.flatnonzero(firsts_mask(values))


def run_lengths(starts: np.ndarray) -> np.ndarray:
    """A mask of each run's first element -> each run's length."""
    return np.diff(np.append(np.flatnonzero(starts), len(starts)))


def _tally(values: np.ndarray, counts: np.ndarray, least: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (value, count, least) -> one per distinct value: the counts summed, the smallest least."""
    order = np.lexsort((least, values))
    values, counts, least = values[order], counts[order], least[order]
    starts = firsts(values)
    return values[starts], np.add.reduceat(counts, starts) if len(starts) else counts[:0], least[starts]


def tally_block(block: pa.Table, rows_of, kw: dict, partitions: int) -> tuple[pa.Table, int]:
    """One block -> (a row per distinct key of its rows, `rows_of(block, **kw)`: (keys, what to minimise); with
    its count and smallest, keyed for the groupby; and the block's largest count: 0 for an empty block, which may
    have no columns)."""
    if not block.num_rows:
        return pa.table({}), 0
    values, least = rows_of(block, **kw)
    v, n, m = _tally(values, np.ones(len(values), np.int64), least)
    return pa.table({"part": pa.array(part_of(v, partitions)), "value": pa.array(v), "n": pa.array(n),
                     "least": pa.array(m)}), int(n.max(initial=0))


def heavy_of_group(group: pa.Table, bound: int) -> pa.Table:
    """Tallies of one partition of keys -> the keys over `bound` rows, with their smallest."""
    v, n, m = _tally(group["value"].to_numpy(), group["n"].to_numpy(), group["least"].to_numpy())
    over = n > bound
    return pa.table({"value": pa.array(v[over]), "least": pa.array(m[over])})


def heavy_keys(ds, rows_of, bound: int, shuffles: Shuffles, phase: str, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The keys on more than `bound` rows of the materialized dataset `ds` (sorted), and for each the smallest of
    what its rows minimise: `rows_of(block, **kw)` gives each block's (keys, what to minimise). The blocks are
    tallied by plain tasks beside Ray Data (the driver holds a reference and an int per block); the tallies'
    groupby runs only where the blocks' largest counts add up to more than the bound."""
    import ray
    import ray.data

    tally = ray.remote(num_returns=2)(tally_block)
    tallies = [tally.remote(ref, rows_of, kw, partitions_for(ds.size_bytes())) for ref in ds.to_arrow_refs()]
    tops = ray.get([top for _, top in tallies])
    if sum(tops) <= bound:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    groups = shuffles(ray.data.from_arrow_refs([t for (t, _), top in zip(tallies, tops) if top]), phase)
    table = collect(groups.map_groups(heavy_of_group, batch_format="pyarrow", fn_kwargs={"bound": bound}))
    table = table.sort_by("value") if table.num_rows else table
    return (table["value"].to_numpy(), table["least"].to_numpy()) if table.num_rows else (np.zeros(0, np.int64),) * 2


def collect(ds) -> pa.Table:
    """A small dataset's rows, on the driver, as one table (no columns where it has no rows)."""
    import ray

    tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
    return pa.concat_tables(tables) if tables else pa.table({})


def is_heavy(values: np.ndarray, heavy: np.ndarray) -> np.ndarray:
    """A mask: which of `values` are among the sorted `heavy` ones."""
    if not len(heavy):
        return np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(heavy, values), len(heavy) - 1)
    return heavy[at] == values


def least_of(values: np.ndarray, heavy: np.ndarray, least: np.ndarray) -> np.ndarray:
    """For each of `values` (every one heavy), its heavy key's smallest `least`."""
    return least[np.searchsorted(heavy, values)]

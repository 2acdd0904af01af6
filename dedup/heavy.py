"""Heavy keys: the values of a groupby's key on more rows than one task may hold (`dedup.task_documents`).

A groupby hands each task whole groups, so a key shared by a million rows is a million rows in one task: the
text of a boilerplate page copied a million times (exact), the band key of a million near-copies (candidates),
the node every one of them is linked to (components). Each such phase first finds its heavy keys, and handles
their rows without a groupby: what a heavy key's rows need from each other is a minimum (the kept copy, the
bucket's smallest document, a node's smallest neighbour), which the driver receives as one row per heavy key and
sends to every task. Only the other rows are grouped.

Finding them costs no task more than a block, or one row per block for each key (`heavy_keys`): each block's
keys are tallied, the tallies of the keys common in a block are grouped and summed, and the few keys that could be
over the bound are counted exactly. Most of the time nothing needs grouping: the sum over blocks of each block's
largest count bounds every key's total, and when it is within the bound no key can be heavy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from core.ray_session import collect, collect_tables
from dedup.keys import Shuffles, part_of, partitions_for


def firsts_mask(*columns: np.ndarray) -> np.ndarray:
    """A mask of the first row of each run of equal rows, a row being its values in `columns` (sorted input)."""
    if not len(columns[0]):
        return np.zeros(0, bool)
    changed = np.zeros(len(columns[0]) - 1, bool)
    for values in columns:
        changed |= values[1:] != values[:-1]
    return np.concatenate([[True], changed])


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


def tally_block(block: pa.Table, rows_of, kw: dict, partitions: int, floor: int) -> tuple[pa.Table, int]:
    """One block -> (a row per distinct key of its rows, `rows_of(block, **kw)`: (keys, what to minimise), that has
    `floor` rows or more in it: the count, keyed for the groupby; and the block's largest count: 0 for an empty
    block, which may have no columns)."""
    if not block.num_rows:
        return pa.table({}), 0
    v, n = np.unique(rows_of(block, **kw)[0], return_counts=True)
    keep = n >= floor
    return pa.table({"part": pa.array(part_of(v[keep], partitions)), "value": pa.array(v[keep]),
                     "n": pa.array(n[keep])}), int(n.max(initial=0))


def over_in_group(group: pa.Table, over: int) -> pa.Table:
    """Tallies of one partition of keys -> the keys whose counts add up to more than `over`."""
    v, n, _ = _tally(group["value"].to_numpy(), group["n"].to_numpy(), np.zeros(group.num_rows, np.int64))
    return pa.table({"value": pa.array(v[n > over])})


def count_block(block: pa.Table, rows_of, kw: dict, keys: np.ndarray) -> pa.Table:
    """One block -> for each of `keys` (sorted) that it has, its rows here and the smallest of what they minimise."""
    if not block.num_rows:
        return pa.table({})
    values, least = rows_of(block, **kw)
    hit = is_heavy(values, keys)
    v, n, m = _tally(values[hit], np.ones(int(hit.sum()), np.int64), least[hit])
    return pa.table({"value": pa.array(v), "n": pa.array(n), "least": pa.array(m)})


def heavy_keys(ds, rows_of, bound: int, shuffles: Shuffles, phase: str, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The keys on more than `bound` rows of the materialized dataset `ds` (sorted), and for each the smallest of
    what its rows minimise: `rows_of(block, **kw)` gives each block's (keys, what to minimise).

    Plain tasks beside Ray Data, the driver holding a reference and an int per block: each block's keys are
    tallied, but a count under `floor` in a block is left out, so that what is left out adds up to at most half
    the bound over all the blocks. A key over the bound still tallies over the other half (a candidate), and
    only the candidates are counted exactly, in a second pass. Where the blocks' largest counts add up to no more
    than the bound, nothing is grouped at all."""
    import ray
    import ray.data

    none = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    refs = ds.to_arrow_refs()
    floor = 1 + bound // (2 * max(1, len(refs)))
    tally, partitions = ray.remote(num_returns=2)(tally_block), partitions_for(ds.size_bytes())
    tallies = [tally.remote(ref, rows_of, kw, partitions, floor) for ref in refs]
    tops = ray.get([top for _, top in tallies])
    if sum(tops) <= bound:
        return none
    common = [t for (t, _), top in zip(tallies, tops) if top >= floor]
    if not common:  # every count under the floor: no key adds up to more than half the bound
        return none
    groups = shuffles(ray.data.from_arrow_refs(common), phase)
    candidates = collect(groups.map_groups(over_in_group, batch_format="pyarrow",
                                           fn_kwargs={"over": bound - (floor - 1) * len(refs)}))
    if not candidates.num_rows:
        return none
    keys = np.sort(candidates["value"].to_numpy())
    counts = collect_tables(ray.get([ray.remote(count_block).remote(ref, rows_of, kw, keys) for ref in refs]))
    v, n, m = _tally(counts["value"].to_numpy(), counts["n"].to_numpy(), counts["least"].to_numpy())
    return v[n > bound], m[n > bound]


def lookup(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `values` would be in the sorted `keys`, and whether it is there."""
    if not len(keys):
        return np.zeros(len(values), np.int64), np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return at, keys[at] == values


def is_heavy(values: np.ndarray, heavy: np.ndarray) -> np.ndarray:
    """A mask: which of `values` are among the sorted `heavy` ones."""
    return lookup(heavy, values)[1]


def heavy_rows(batch: pa.Table, column: str, heavy: np.ndarray, keep: bool) -> pa.Table:
    """The rows whose `column` is among the sorted `heavy` keys (`keep`), or the others."""
    mask = is_heavy(batch[column].to_numpy(), heavy)
    return batch.filter(pa.array(mask if keep else ~mask))


def least_of(values: np.ndarray, heavy: np.ndarray, least: np.ndarray) -> np.ndarray:
    """For each of `values` (every one heavy), its heavy key's smallest `least`."""
    return least[np.searchsorted(heavy, values)]

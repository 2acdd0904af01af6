"""Phase 5a, the components of the graph of verified pairs and exact copies (each copy linked to its text's kept
copy): {node: the smallest node of its component}. Up to a small graph's size in one task (hooking and pointer
jumping); above it, distributed rounds of large-star and small-star (Kiveris et al. 2014), each a groupby over
the edges, until a round changes nothing. Chains a~b~c are one component."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from core.ray_session import groupby
from dedup.keys import part_of, partitions_for

EDGE_SCHEMA = pa.schema([("part", pa.int64()), ("u", pa.int64()), ("v", pa.int64())])


def components_in_one_task(u: np.ndarray, v: np.ndarray) -> dict[int, int]:
    """{node: the smallest node of its component}, by hooking and pointer jumping: each round hangs the
    larger root of every edge under the smaller one, then every node jumps to its root. O(log n)
    rounds even on long chains, where propagating labels along edges would take their length."""
    nodes = np.unique(np.concatenate([u, v]))
    iu, iv = np.searchsorted(nodes, u), np.searchsorted(nodes, v)
    parent = np.arange(len(nodes), dtype=np.int64)  # index order = key order: a root is its tree's smallest
    while True:
        ru, rv = parent[iu], parent[iv]
        live = ru != rv
        if not live.any():
            break
        lo, hi = np.minimum(ru[live], rv[live]), np.maximum(ru[live], rv[live])
        np.minimum.at(parent, hi, lo)
        while True:  # jump to the root
            jumped = parent[parent]
            if (jumped == parent).all():
                break
            parent = jumped
    return dict(zip(nodes.tolist(), nodes[parent].tolist()))


def _large_star(group: pa.Table) -> pa.Table:
    """Edges (u, v) in both directions, grouped by u: every neighbour v > u is linked to the smallest
    node of u's neighbourhood (u included). `changed` marks edges that moved."""
    u, v = group["u"].to_numpy(), group["v"].to_numpy()
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    starts = np.flatnonzero(np.concatenate([[True], u[1:] != u[:-1]]))
    m = np.minimum(np.minimum.reduceat(v, starts), u[starts])
    m_of = np.repeat(m, np.diff(np.append(starts, len(u))))
    out = v > u
    return _edges(v[out], m_of[out], m_of[out] != u[out])


def _small_star(group: pa.Table) -> pa.Table:
    """Edges (u, v) with v < u, grouped by u: u and its smaller neighbours are linked to the smallest of them."""
    u, v = group["u"].to_numpy(), group["v"].to_numpy()
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    starts = np.flatnonzero(np.concatenate([[True], u[1:] != u[:-1]]))
    counts = np.diff(np.append(starts, len(u)))
    m = np.minimum.reduceat(v, starts)
    m_of = np.repeat(m, counts)
    moved_from = np.repeat(counts > 1, counts)  # edges among the neighbourhood (other than to m) move to m
    others = v != m_of
    a = np.concatenate([u[starts], v[others]])
    b = np.concatenate([m, m_of[others]])
    moved = np.concatenate([np.zeros(len(starts), bool), moved_from[others]])
    return _edges(a, b, moved)


def _edges(a: np.ndarray, b: np.ndarray, moved: np.ndarray) -> pa.Table:
    """Undirected edges (u > v), each once (moved if any of its copies moved)."""
    u, v = np.maximum(a, b), np.minimum(a, b)
    order = np.lexsort((v, u))
    u, v, moved = u[order], v[order], moved[order].astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (u[1:] != u[:-1]) | (v[1:] != v[:-1])])) if len(u) else np.zeros(0, np.int64)
    moved = np.maximum.reduceat(moved, starts) if len(u) else moved
    return pa.table({"u": pa.array(u[starts]), "v": pa.array(v[starts]), "moved": pa.array(moved)})


def _directed(batch: pa.Table, partitions: int, both: bool) -> pa.Table:
    """Undirected edges (u > v) -> rows keyed by u (and by v too when `both`)."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    if both:
        u, v = np.concatenate([u, v]), np.concatenate([v, u])
    return pa.table({"part": pa.array(part_of(u, partitions)), "u": pa.array(u), "v": pa.array(v)}, schema=EDGE_SCHEMA)


def components_on_ray(edges, nbytes: int, ray_config, partitions: int | None = None):
    """Large-star and small-star rounds over a Ray Data dataset of edges (u > v) until a round moves no
    edge: then every component is a star around its smallest node. Returns (a dataset of (node, root):
    every node with its component's smallest node, roots included, some rows more than once; rounds).
    No task holds more than a partition of edges, and nothing comes back to the caller but counts.
    `nbytes`: the edges' size; each groupby's partitions are sized from what it moves (the large star moves
    every edge both ways), unless `partitions` names a count."""
    rounds = 0
    while True:
        rounds += 1
        large_kw = {"partitions": partitions or partitions_for(2 * nbytes), "both": True}
        small_kw = {"partitions": partitions or partitions_for(nbytes), "both": False}
        large = groupby(edges.map_batches(_directed, batch_format="pyarrow", fn_kwargs=large_kw), "part",
                        2 * nbytes, ray_config, large_kw["partitions"]).map_groups(_large_star, batch_format="pyarrow").materialize()
        small = groupby(large.map_batches(_directed, batch_format="pyarrow", fn_kwargs=small_kw), "part",
                        nbytes, ray_config, small_kw["partitions"]).map_groups(_small_star, batch_format="pyarrow").materialize()
        moved = (large.sum("moved") or 0) + (small.sum("moved") or 0)
        edges = small.select_columns(["u", "v"])
        if not moved:
            break
    return edges.map_batches(_star_labels, batch_format="pyarrow"), rounds


def _star_labels(batch: pa.Table) -> pa.Table:
    """Star edges (leaf u, root v) -> (node, root) rows: each leaf, and each root (once per batch)."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    roots = np.unique(v)
    return pa.table({"node": pa.array(np.concatenate([u, roots])), "root": pa.array(np.concatenate([v, roots]))})

"""Phase 5a, the components of the graph of verified pairs and exact copies (each copy linked to its text's kept
copy): {node: the smallest node of its component}. Up to a small graph's size in one task (hooking and pointer
jumping); above it, distributed rounds of large-star and small-star (Kiveris et al. 2014), each a groupby over
the edges, until a round changes nothing; a node of more than `dedup.task_documents` edges (a component's root
in its last rounds) is starred by blocks, its smallest neighbour from the tally of heavy keys (dedup/heavy.py).
Chains a~b~c are one component."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from core.ray_session import groupby, over_all
from dedup.heavy import firsts, heavy_keys, heavy_rows, least_of
from dedup.keys import Shuffles, part_of, partitions_for

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
    starts = firsts(u)
    counts = np.diff(np.append(starts, len(u)))
    m = np.minimum(np.minimum.reduceat(v, starts), u[starts])
    m_of = np.repeat(m, counts)
    out = v > u
    return _edges(v[out], m_of[out], m_of[out] != u[out], counts.max(initial=0))


def _small_star(group: pa.Table) -> pa.Table:
    """Edges (u, v) with v < u, grouped by u: u and its smaller neighbours are linked to the smallest of them."""
    u, v = group["u"].to_numpy(), group["v"].to_numpy()
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    starts = firsts(u)
    counts = np.diff(np.append(starts, len(u)))
    m = np.minimum.reduceat(v, starts)
    m_of = np.repeat(m, counts)
    moved_from = np.repeat(counts > 1, counts)  # edges among the neighbourhood (other than to m) move to m
    others = v != m_of
    a = np.concatenate([u[starts], v[others]])
    b = np.concatenate([m, m_of[others]])
    moved = np.concatenate([np.zeros(len(starts), bool), moved_from[others]])
    return _edges(a, b, moved, counts.max(initial=0))


def _heavy_large_star(batch: pa.Table, heavy: np.ndarray, least: np.ndarray) -> pa.Table:
    """`_large_star` of heavy nodes' edges, without their group: each node's smallest neighbour (`least`) comes
    from the tally."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    m = np.minimum(least_of(u, heavy, least), u)
    out = v > u
    return _edges(v[out], m[out], m[out] != u[out], 0)


def _heavy_small_star(batch: pa.Table, heavy: np.ndarray, least: np.ndarray) -> pa.Table:
    """`_small_star` of heavy nodes' edges (more than one each, so every other neighbour moves), without their
    group."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    m = least_of(u, heavy, least)
    others = v != m
    nodes = np.unique(u)
    a, b = np.concatenate([nodes, v[others]]), np.concatenate([least_of(nodes, heavy, least), m[others]])
    return _edges(a, b, np.concatenate([np.zeros(len(nodes), bool), np.ones(int(others.sum()), bool)]), 0)


def _edges(a: np.ndarray, b: np.ndarray, moved: np.ndarray, held: int) -> pa.Table:
    """Undirected edges (u > v), each once (moved if any of its copies moved); `held`: the most edges of one node
    that the task grouped (0 where it grouped none: a heavy node's block)."""
    u, v = np.maximum(a, b), np.minimum(a, b)
    order = np.lexsort((v, u))
    u, v, moved = u[order], v[order], moved[order].astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (u[1:] != u[:-1]) | (v[1:] != v[:-1])])) if len(u) else np.zeros(0, np.int64)
    moved = np.maximum.reduceat(moved, starts) if len(u) else moved
    return pa.table({"u": pa.array(u[starts]), "v": pa.array(v[starts]), "moved": pa.array(moved),
                     "held": pa.array(np.full(len(starts), held, np.int64))})


def _directed(batch: pa.Table, partitions: int, both: bool) -> pa.Table:
    """Undirected edges (u > v) -> rows keyed by u (and by v too when `both`)."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    if both:
        u, v = np.concatenate([u, v]), np.concatenate([v, u])
    return pa.table({"part": pa.array(part_of(u, partitions)), "u": pa.array(u), "v": pa.array(v)}, schema=EDGE_SCHEMA)


def _ends(block: pa.Table, both: bool) -> tuple[np.ndarray, np.ndarray]:
    """Undirected edges (u > v) -> each directed row's node and neighbour, as `_directed` keys them."""
    u, v = block["u"].to_numpy(), block["v"].to_numpy()
    return (np.concatenate([u, v]), np.concatenate([v, u])) if both else (u, v)


def _star(edges, star, heavy_star, both: bool, nbytes: int, shuffles: Shuffles, bound: int, partitions: int | None):
    """One star over the materialized edges: grouped by u, but a node of more than `bound` edges (dedup/heavy.py)
    by blocks. Returns the materialized edges it gives (u > v, with `moved` and `held`)."""
    kw = {"partitions": partitions or partitions_for(nbytes), "both": both}
    directed = edges.map_batches(_directed, batch_format="pyarrow", fn_kwargs=kw)
    heavy, least = heavy_keys(edges, _ends, bound, shuffles, "components", both=both)
    rows_kw = {"column": "u", "heavy": heavy}
    cold = directed.map_batches(heavy_rows, batch_format="pyarrow", fn_kwargs={**rows_kw, "keep": False}) \
        if len(heavy) else directed
    out = groupby(cold, "part", nbytes, shuffles.ray, kw["partitions"]).map_groups(star, batch_format="pyarrow")
    if len(heavy):
        out = out.union(directed.map_batches(heavy_rows, batch_format="pyarrow", fn_kwargs={**rows_kw, "keep": True})
                        .map_batches(heavy_star, batch_format="pyarrow", fn_kwargs={"heavy": heavy, "least": least}))
    return out.materialize()


def components_on_ray(edges, nbytes: int, ray_config, *, bound: int, partitions: int | None = None):
    """Large-star and small-star rounds over a materialized Ray Data dataset of edges (u > v) until a round moves
    no edge: then every component is a star around its smallest node. Returns (a dataset of (node, root):
    every node with its component's smallest node, roots included, some rows more than once; rounds; the most
    edges of one node that one task grouped). No task holds more than a partition of edges and `bound` edges of
    one node (the stage's `dedup.task_documents`; a node of more, such as the root of a big component's last
    rounds, is handled by blocks), and nothing comes back to the caller but counts. `nbytes`: the edges' size; each groupby's partitions are sized
    from what it moves (the large star moves every edge both ways), unless `partitions` names a count."""
    from ray.data.aggregate import Max, Sum

    rounds, held, shuffles = 0, 0, Shuffles(ray_config)
    while True:
        rounds += 1
        large = _star(edges, _large_star, _heavy_large_star, True, 2 * nbytes, shuffles, bound, partitions)
        small = _star(large, _small_star, _heavy_small_star, False, nbytes, shuffles, bound, partitions)
        stats = over_all(large.union(small), Sum("moved"), Max("held"))
        held = max(held, stats["max(held)"] or 0)
        edges = small  # u, v (and `moved`, `held`, which the next round does not read)
        if not stats["sum(moved)"]:
            break
    return edges.map_batches(_star_labels, batch_format="pyarrow"), rounds, held


def _star_labels(batch: pa.Table) -> pa.Table:
    """Star edges (leaf u, root v) -> (node, root) rows: each leaf, and each root (once per batch)."""
    u, v = batch["u"].to_numpy(), batch["v"].to_numpy()
    roots = np.unique(v)
    return pa.table({"node": pa.array(np.concatenate([u, roots])), "root": pa.array(np.concatenate([v, roots]))})

"""Phase 5b, the kept document of each component, and what every other one becomes.

Each component keeps its smallest document (source order, id); an exact copy goes to `duplicates/` with Jaccard
1.0 and `via` its text's kept copy, any other removed document with `via` its verified neighbour of highest
Jaccard (ties: the preferred one), the evidence. (The evaluation set takes no part: decontamination removed its
copies before, dedup/decontaminate.py.)

Nothing here needs a whole component in one task. Three reductions, each associative (a block's partial result
reduces again with the others'), so a node with a million edges or a component of ten million documents is a few
rows per block before any groupby:
1. per node (`nodes_reduced`): its id and source, its best neighbour, and its root (the components' label);
2. per component (`components_reduced`): its kept document and its size;
3. the join of each node with its component (`leaving`), where a component of more than `task_documents` nodes
   is met in several tasks: its nodes spread over salts, its row copied to each.
Up to EDGES_PER_TASK_DOCUMENT x `task_documents` checked pairs and copies (8,192 at the default) the components and
all three run in one task, on whole tables;
above, on Ray Data (dedup/components.py for the labels). Each part's removed rows are written (`write_by_part`)
for the output phase."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.ray_session import collect, largest
from corpus.parts import Parts, parquet_files, rows_in_folder
from dedup.components import components_in_one_task, components_on_ray
from dedup.heavy import firsts, lookup
from dedup.keys import ROW_BITS, Inputs, Shuffles, keys_by_part, part_of, partitions_for, write_by_part

# Checked pairs and exact copies up to this many per `dedup.task_documents`: their components in one task. A task then
# holds ~1.1 KB an edge (docs/benchmarks.md), ~9 MB at the default. (It was 64, ~1.1 GB: a hot cluster of 40k
# near-copies, 142k edges, then grew the largest worker by 250 MB; on Ray Data it took the same seconds.)
EDGES_PER_TASK_DOCUMENT = 4
DUPLICATE_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("kept_id", pa.string()),
                              ("kept_source", pa.string()), ("jaccard", pa.float64()), ("via", pa.string())])
# The components' graph: a verified pair (a, b), or an exact copy b of its text's kept copy a (`copy`).
GRAPH_SCHEMA = pa.schema([("a_key", pa.int64()), ("b_key", pa.int64()), ("a", pa.string()), ("b", pa.string()),
                          ("a_source", pa.string()), ("b_source", pa.string()), ("jaccard", pa.float64()), ("copy", pa.bool_())])
# A node (`node`, its id, source, and rank: `prio` its source's order), a neighbour it may leave `via` (Jaccard `j`;
# the neighbour's rank), and its component's `root` once labelled. `part`: the groupby's key. A label row has only
# part, node and root.
NODE_SCHEMA = pa.schema([("part", pa.int64()), ("node", pa.int64()), ("id", pa.string()), ("source", pa.string()),
                         ("prio", pa.int32()), ("j", pa.float64()), ("via", pa.int64()), ("via_id", pa.string()),
                         ("via_prio", pa.int32()), ("root", pa.int64())])
# A component: its root, its kept document (`key`, id, source, rank) and its documents.
COMPONENT_SCHEMA = pa.schema([("part", pa.int64()), ("root", pa.int64()), ("key", pa.int64()), ("id", pa.string()),
                              ("source", pa.string()), ("prio", pa.int32()), ("size", pa.int64())])
# What `leaving` returns: a document that leaves, and how many nodes its task held.
LEAVING_SCHEMA = pa.schema([*DUPLICATE_SCHEMA, ("key", pa.int64()), ("held", pa.int64())])
# Documents removed per (source, kept source) (size 0), or components per size (source and kept source null).
TALLY_SCHEMA = pa.schema([("source", pa.string()), ("kept_source", pa.string()), ("size", pa.int64()), ("n", pa.int64())])
DUPLICATE = "duplicate"  # the reason, and (in the plural) its folder, of a document removed as another's near-duplicate
FOLDER = "duplicates"
RANK = [("prio", "ascending"), ("id", "ascending")]  # then the key: smaller = preferred


def near_edges(batch: pa.Table, threshold: float) -> pa.Table:
    """Checked candidate pairs -> the verified ones (Jaccard >= threshold), as graph edges."""
    batch = batch.filter(pc.greater_equal(batch["jaccard"], threshold))
    return pa.table({**{f.name: batch[f.name] for f in GRAPH_SCHEMA if f.name != "copy"},
                     "copy": pa.array(np.zeros(batch.num_rows, bool))}, schema=GRAPH_SCHEMA)


def copy_edges(batch: pa.Table) -> pa.Table:
    """Exact copies -> graph edges from each text's kept copy (a) to the copy (b), Jaccard 1.0."""
    n = batch.num_rows
    return pa.table({"a_key": batch["kept_key"], "b_key": batch["key"], "a": batch["kept_id"], "b": batch["id"],
                     "a_source": batch["kept_source"], "b_source": batch["source"],
                     "jaccard": pa.array(np.ones(n)), "copy": pa.array(np.ones(n, bool))}, schema=GRAPH_SCHEMA)


def _undirected(batch: pa.Table) -> pa.Table:
    return pa.table({"u": pc.max_element_wise(batch["a_key"], batch["b_key"]),
                     "v": pc.min_element_wise(batch["a_key"], batch["b_key"])})


def _rank(sources: pa.Array, priority: dict[str, int]) -> pa.Array:
    return pa.array([priority.get(s, len(priority)) for s in sources.to_pylist()], pa.int32())


def node_rows(batch: pa.Table, priority: dict[str, int], partitions: int) -> pa.Table:
    """Graph edges -> a row per end of each edge: a verified pair gives each end the other as a neighbour, an exact
    copy gives the copy its text's kept copy (Jaccard 1.0) and the kept copy no neighbour."""
    near = pc.invert(batch["copy"])
    ends = [(batch["a_key"], batch["a"], batch["a_source"], batch["b_key"], batch["b"], batch["b_source"], near),
            (batch["b_key"], batch["b"], batch["b_source"], batch["a_key"], batch["a"], batch["a_source"], None)]
    out = []
    for node, ids, sources, via, via_ids, via_sources, only in ends:  # only: the edges that give this end a neighbour
        keys = node.to_numpy()
        out.append(pa.table({
            "part": pa.array(part_of(keys, partitions)), "node": node, "id": ids, "source": sources,
            "prio": _rank(sources, priority), "j": _where(only, batch["jaccard"]), "via": _where(only, via),
            "via_id": _where(only, via_ids), "via_prio": _where(only, _rank(via_sources, priority)),
            "root": pa.nulls(len(keys), pa.int64())}, schema=NODE_SCHEMA))
    return pa.concat_tables(out)


def _where(mask, values):
    """`values` where `mask` holds, null elsewhere; all of them where there is no mask."""
    return values if mask is None else pc.if_else(mask, values, pa.scalar(None, values.type))


def label_rows(batch: pa.Table, partitions: int) -> pa.Table:
    """(node, root) rows of the components' labels -> label rows of NODE_SCHEMA, keyed by node."""
    n, keys = batch.num_rows, batch["node"].to_numpy()
    return pa.table({f.name: pa.nulls(n, f.type) for f in NODE_SCHEMA}, schema=NODE_SCHEMA) \
        .set_column(0, "part", pa.array(part_of(keys, partitions))) \
        .set_column(1, "node", batch["node"]).set_column(NODE_SCHEMA.get_field_index("root"), "root", batch["root"])


def nodes_reduced(group: pa.Table) -> pa.Table:
    """Node rows (and label rows) -> one row per node: its best neighbour (highest Jaccard, then the preferred
    one), and its root where a label row gives it. Reduces its own output again: per block, then per group."""
    labels = group.filter(pc.is_valid(group["root"]))
    rows = group.filter(pc.is_valid(group["id"]))
    order = pc.sort_indices(rows, [("node", "ascending"), ("j", "descending"), ("via_prio", "ascending"),
                                   ("via_id", "ascending"), ("via", "ascending")], null_placement="at_end")
    rows = rows.take(order)
    best = rows.take(pa.array(firsts(rows["node"].to_numpy())))
    if not labels.num_rows:
        return best
    nodes, first = np.unique(labels["node"].to_numpy(), return_index=True)
    root = labels["root"].to_numpy()[first][np.searchsorted(nodes, best["node"].to_numpy())]
    return best.set_column(NODE_SCHEMA.get_field_index("root"), "root", pa.array(root, pa.int64()))


def component_rows(nodes: pa.Table, partitions: int) -> pa.Table:
    """Labelled nodes -> one component row each (a component of one), keyed by root."""
    n, root = nodes.num_rows, nodes["root"].to_numpy()
    return pa.table({"part": pa.array(part_of(root, partitions)), "root": nodes["root"], "key": nodes["node"], "id": nodes["id"],
                     "source": nodes["source"], "prio": nodes["prio"], "size": pa.array(np.ones(n, np.int64))},
                    schema=COMPONENT_SCHEMA)


def components_reduced(group: pa.Table) -> pa.Table:
    """Component rows -> one per root: its most preferred kept document, the sum of sizes. Reduces its own output
    again: per block, then per group."""
    order = pc.sort_indices(group, [("root", "ascending"), *RANK, ("key", "ascending")])
    group = group.take(order)
    starts = firsts(group["root"].to_numpy())
    size = np.add.reduceat(group["size"].to_numpy(), starts) if len(starts) else np.zeros(0, np.int64)
    return group.take(pa.array(starts)).set_column(COMPONENT_SCHEMA.get_field_index("size"), "size", pa.array(size))


def _salts(components: pa.Table, task_documents: int) -> tuple[np.ndarray, np.ndarray]:
    """(roots, salts): the components of more than `task_documents` nodes, sorted, and how many tasks each takes."""
    big = components.filter(pc.greater(components["size"], task_documents))
    order = np.argsort(big["root"].to_numpy())
    return big["root"].to_numpy()[order], -(-big["size"].to_numpy()[order] // task_documents)


def salted(batch: pa.Table, roots: np.ndarray, salts: np.ndarray, partitions: int, copies: bool) -> pa.Table:
    """Node rows (or, with `copies`, component rows) keyed for the join by root and salt: a big component's nodes
    spread over its salts by a hash of the node, its row copied to every one of them."""
    root = batch["root"].to_numpy()
    count = np.ones(len(root), np.int64)
    at, hit = lookup(roots, root)
    count[hit] = salts[at[hit]]
    if copies:
        rows = np.repeat(np.arange(batch.num_rows), count)
        salt = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count)
        batch, root = batch.take(pa.array(rows, pa.int64())), root[rows]
    else:
        salt = part_of(batch["node"].to_numpy(), 1 << 30) % count
    return batch.set_column(0, "part", pa.array(part_of(root, partitions) + partitions * salt))


def leaving(nodes: pa.Table, components: pa.Table) -> pa.Table:
    """The nodes and component rows of some components (a salt's share of each) -> a row for every document that
    is not its component's kept one: via whom it leaves; `held`: the nodes in this task."""
    roots = components["root"].to_numpy()
    order = np.argsort(roots)
    at = order[np.searchsorted(roots[order], nodes["root"].to_numpy())]
    kept, kept_id, kept_source = components["key"].to_numpy()[at], components["id"].take(at), components["source"].take(at)
    go = nodes["node"].to_numpy() != kept
    n, rows = int(go.sum()), pa.array(np.flatnonzero(go))
    return pa.table({"id": nodes["id"].take(rows), "source": nodes["source"].take(rows), "kept_id": kept_id.take(rows),
                     "kept_source": kept_source.take(rows), "jaccard": nodes["j"].take(rows), "via": nodes["via_id"].take(rows),
                     "key": nodes["node"].take(rows), "held": pa.array(np.full(n, nodes.num_rows, np.int64))},
                    schema=LEAVING_SCHEMA)


def leaving_group(group: pa.Table) -> pa.Table:
    """One group of the join: node rows (with a node) and component rows (without) -> `leaving`."""
    nodes = group.filter(pc.is_valid(group["node"]))
    components = group.filter(pc.is_null(group["node"]))
    return leaving(nodes.select(NODE_SCHEMA.names), pa.table({
        "part": components["part"], "root": components["root"], "key": components["kept"], "id": components["kept_id"],
        "source": components["kept_source"], "prio": components["prio"], "size": components["size"]}, schema=COMPONENT_SCHEMA))


def joined_rows(batch: pa.Table, copies: bool) -> pa.Table:
    """Node rows, or component rows (`copies`), in the one schema the join's groupby carries: NODE_SCHEMA and the
    component's kept document and size (null on node rows)."""
    n = batch.num_rows
    if not copies:
        return batch.select(NODE_SCHEMA.names).append_column("kept", pa.nulls(n, pa.int64())) \
            .append_column("kept_id", pa.nulls(n, pa.string())).append_column("kept_source", pa.nulls(n, pa.string())) \
            .append_column("size", pa.nulls(n, pa.int64()))
    nodes = pa.table({f.name: pa.nulls(n, f.type) for f in NODE_SCHEMA}, schema=NODE_SCHEMA) \
        .set_column(0, "part", batch["part"]).set_column(NODE_SCHEMA.get_field_index("root"), "root", batch["root"]) \
        .set_column(NODE_SCHEMA.get_field_index("prio"), "prio", batch["prio"])
    return nodes.append_column("kept", batch["key"]).append_column("kept_id", batch["id"]) \
        .append_column("kept_source", batch["source"]).append_column("size", batch["size"])


def tally_removed(leaving_rows: pa.Table) -> pa.Table:
    """Documents removed per (source, kept source)."""
    removed = collections.Counter(zip(leaving_rows["source"].to_pylist(), leaving_rows["kept_source"].to_pylist()))
    return pa.Table.from_pylist([{"source": s, "kept_source": k, "size": 0, "n": n} for (s, k), n in removed.items()],
                                schema=TALLY_SCHEMA)


def tally_sizes(components: pa.Table) -> pa.Table:
    """Clusters per size (every component loses all but its kept document)."""
    sizes = collections.Counter(components["size"].to_numpy().tolist())
    return pa.Table.from_pylist([{"source": None, "kept_source": None, "size": s, "n": n} for s, n in sizes.items()],
                                schema=TALLY_SCHEMA)


def write_removed(mine: pa.Table, folder: str, removed: str) -> None:
    """One task's documents leaving -> `duplicates/` beside the output, and each part's removed rows."""
    parts = Parts(folder, FOLDER, DUPLICATE_SCHEMA)
    for row in mine.select(DUPLICATE_SCHEMA.names).to_pylist():
        parts.add(row)
    parts.close()
    keys = mine["key"].to_numpy()
    for part in np.unique(keys >> ROW_BITS).tolist():
        write_by_part(pa.table({"key": keys[(keys >> ROW_BITS) == part]}), removed)


def assemble_in_one_task(candidates: str, exact: str, threshold: float, priority: dict[str, int], folder: str,
                         removed: str) -> tuple[list[dict], int, int]:
    """The small graph's path: components, kept documents, `duplicates/` and each part's removed rows, in one Ray
    task (memory ~ the duplicate documents). Returns (tally rows, edges, nodes)."""
    near = [near_edges(pq.read_table(p), threshold) for p in parquet_files(candidates)]
    copies = [copy_edges(pq.read_table(p)) for p in parquet_files(exact)]
    graph = pa.concat_tables([GRAPH_SCHEMA.empty_table(), *near, *copies])
    undirected = _undirected(graph)
    labels = components_in_one_task(undirected["u"].to_numpy(), undirected["v"].to_numpy()) if graph.num_rows else {}
    label_table = pa.table({"node": pa.array(list(labels), pa.int64()), "root": pa.array(list(labels.values()), pa.int64())})
    nodes = nodes_reduced(pa.concat_tables([node_rows(graph, priority, 1), label_rows(label_table, 1)]))
    components = components_reduced(component_rows(nodes, 1))
    gone = leaving(nodes, components)
    Path(removed).mkdir(parents=True, exist_ok=True)
    write_removed(gone, folder, removed)
    return tally_removed(gone).to_pylist() + tally_sizes(components).to_pylist(), graph.num_rows, nodes.num_rows


def assemble_on_ray(graph, labels, shuffles: Shuffles, priority: dict[str, int], task_documents: int, folder: str,
                    removed: str) -> tuple[list[dict], int]:
    """The large graph's path after `components_on_ray`: the three reductions as groupbys of partial results.
    Writes `duplicates/`; returns (the tally rows, the most nodes one join task held)."""
    p = partitions_for(graph.size_bytes())
    rows = graph.map_batches(node_rows, batch_format="pyarrow", fn_kwargs={"priority": priority, "partitions": p})
    rows = rows.map_batches(nodes_reduced, batch_format="pyarrow") \
        .union(labels.map_batches(label_rows, batch_format="pyarrow", fn_kwargs={"partitions": p}))
    nodes = shuffles(rows, "components").map_groups(nodes_reduced, batch_format="pyarrow").materialize()
    parts = nodes.map_batches(component_rows, batch_format="pyarrow", fn_kwargs={"partitions": p}) \
        .map_batches(components_reduced, batch_format="pyarrow")
    components = shuffles(parts, "components").map_groups(components_reduced, batch_format="pyarrow").materialize()
    big = collect(components.map_batches(lambda b: b.filter(pc.greater(b["size"], task_documents)), batch_format="pyarrow")).to_pylist()
    kw = dict(zip(("roots", "salts"), _salts(pa.Table.from_pylist(big, COMPONENT_SCHEMA), task_documents)), partitions=p)
    joined = nodes.map_batches(salted, batch_format="pyarrow", fn_kwargs={**kw, "copies": False}) \
        .map_batches(joined_rows, batch_format="pyarrow", fn_kwargs={"copies": False}) \
        .union(components.map_batches(salted, batch_format="pyarrow", fn_kwargs={**kw, "copies": True})
               .map_batches(joined_rows, batch_format="pyarrow", fn_kwargs={"copies": True}))
    gone = shuffles(joined, "components").map_groups(leaving_group, batch_format="pyarrow").materialize()
    if gone.count():
        gone.select_columns(DUPLICATE_SCHEMA.names).write_parquet(folder)
        shuffles(gone.map_batches(keys_by_part, batch_format="pyarrow"), "components").map_groups(
            write_by_part, batch_format="pyarrow", fn_kwargs={"folder": removed}).materialize()
    tallies = collect(gone.map_batches(tally_removed, batch_format="pyarrow")).to_pylist() \
        + collect(components.map_batches(tally_sizes, batch_format="pyarrow")).to_pylist()
    return tallies, largest(gone, "held")


def graph_on_ray(candidates: Path, exact: Path, threshold: float, checked: int, copied: int):
    """The components' graph as a materialized Ray dataset: the verified pairs and the exact copies."""
    import ray.data

    near = ray.data.read_parquet(str(candidates)).map_batches(near_edges, batch_format="pyarrow",
                                                               fn_kwargs={"threshold": threshold}) if checked else None
    copies = ray.data.read_parquet(str(exact)).map_batches(copy_edges, batch_format="pyarrow") if copied else None
    return (near.union(copies) if near is not None and copies is not None else near or copies).materialize()


def assemble(inputs: Inputs, candidates: Path, exact: Path, threshold: float, task_documents: int, priority: dict[str, int],
             shuffles: Shuffles, folder: str) -> tuple[dict, str]:
    """Writes `duplicates/` (`folder`) and each part's removed rows. Returns (what was found: the graph's size,
    rounds and the tally rows; the folder of the removed rows)."""
    import ray

    removed = str(inputs.work / f"removed-{DUPLICATE}")
    checked, copied = rows_in_folder(candidates), rows_in_folder(exact)  # from the footers
    found = {"candidate_pairs": checked, "exact_duplicates": copied, "rounds": 0, "verified_pairs": 0, "tallies": [],
             "largest_task_documents.assembly": 0}
    if checked + copied <= EDGES_PER_TASK_DOCUMENT * task_documents:  # a small graph: one task
        found["tallies"], found["verified_pairs"], found["largest_task_documents.assembly"] = ray.get(
            ray.remote(assemble_in_one_task).remote(str(candidates), str(exact), threshold, priority, folder, removed))
        return found, removed
    Path(removed).mkdir(parents=True)
    graph = graph_on_ray(candidates, exact, threshold, checked, copied)
    found["verified_pairs"] = graph.count()
    if found["verified_pairs"]:
        undirected = graph.map_batches(_undirected, batch_format="pyarrow").materialize()
        shuffles.moved["components"] = undirected.size_bytes()
        labels, found["rounds"], found["largest_key_rows.components"] = components_on_ray(
            undirected, undirected.size_bytes(), shuffles.ray, bound=task_documents)
        found["tallies"], found["largest_task_documents.assembly"] = assemble_on_ray(
            graph, labels, shuffles, priority, task_documents, folder, removed)
    return found, removed

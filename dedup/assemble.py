"""Phase 5b, the kept document of each component, and what every other one becomes.

Each component keeps its smallest document (the evaluation set first, source order, id); an exact copy goes to
`duplicates/` with Jaccard 1.0 and `via` its text's kept copy, any other removed document with `via` its verified
neighbour of highest Jaccard (ties: the preferred one), the evidence. A training document whose component is
kept as an evaluation document goes to `near_eval/` instead, with that document as `kept_id`: a copy of an
evaluation document never trains the model. The evaluation set is never removed. Up to SMALL_GRAPH_EDGES checked
pairs and copies, the components and all this in one task; above, on Ray Data (dedup/components.py), where a
groupby joins every edge with its first document's label and another brings each component's edges together,
so that a task holds whole components, never all of them. Each part's removed rows are written per reason
(`write_by_part`) for the output phase."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus import evalset
from corpus.parts import Parts, parquet_files, rows_in_folder
from dedup.components import components_in_one_task, components_on_ray
from dedup.keys import ROW_BITS, Inputs, Shuffles, keys_by_part, part_of, partitions_for, write_by_part

SMALL_GRAPH_EDGES = 1 << 20  # checked pairs and exact copies up to this many: their components in one task
DUPLICATE_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("kept_id", pa.string()),
                              ("kept_source", pa.string()), ("jaccard", pa.float64()), ("via", pa.string())])
# The components' graph: a verified pair (a, b), or an exact copy b of its text's kept copy a (`copy`).
GRAPH_SCHEMA = pa.schema([("a_key", pa.int64()), ("b_key", pa.int64()), ("a", pa.string()), ("b", pa.string()),
                          ("a_source", pa.string()), ("b_source", pa.string()), ("jaccard", pa.float64()), ("copy", pa.bool_())])
# Rows of the join of edges with their first document's label: an edge (kind "edge") or a label (kind "label").
LABEL_JOIN_SCHEMA = pa.schema([("part", pa.int64()), ("kind", pa.string()), ("root", pa.int64()), *GRAPH_SCHEMA])
ASSEMBLED_SCHEMA = pa.schema([*DUPLICATE_SCHEMA, ("key", pa.int64()), ("cluster_size", pa.int64()), ("reason", pa.string())])
TALLY_SCHEMA = pa.schema([("source", pa.string()), ("kept_source", pa.string()), ("reason", pa.string()), ("size", pa.int64()),
                          ("n", pa.int64())])
DUPLICATE = "duplicate"  # the reason, and (in the plural) its folder, of a document removed as another's near-duplicate
FOLDERS = {DUPLICATE: "duplicates", evalset.NEAR: evalset.NEAR}


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


def edges_keyed(batch: pa.Table, partitions: int) -> pa.Table:
    """Graph edges keyed by their first document, for the join with its label."""
    n = batch.num_rows
    return pa.table({"part": pa.array(part_of(batch["a_key"].to_numpy(), partitions)), "kind": pa.array(["edge"] * n),
                     "root": pa.nulls(n, pa.int64()), **{f.name: batch[f.name] for f in GRAPH_SCHEMA}}, schema=LABEL_JOIN_SCHEMA)


def labels_keyed(batch: pa.Table, partitions: int) -> pa.Table:
    """(node, root) rows keyed by the node, for the join with the edges that start at it."""
    n = batch.num_rows
    return pa.table({"part": pa.array(part_of(batch["node"].to_numpy(), partitions)), "kind": pa.array(["label"] * n),
                     "root": batch["root"], "a_key": batch["node"],
                     **{f.name: pa.nulls(n, f.type) for f in GRAPH_SCHEMA if f.name != "a_key"}}, schema=LABEL_JOIN_SCHEMA)


def with_roots(group: pa.Table, partitions: int) -> pa.Table:
    """One partition of edges and of the labels of their first documents -> the edges with their
    component's root, keyed by that root (so that each component meets in one partition)."""
    labels = group.filter(pc.equal(group["kind"], "label"))
    edges = group.filter(pc.equal(group["kind"], "edge"))
    nodes, first = np.unique(labels["a_key"].to_numpy(), return_index=True)
    roots = labels["root"].to_numpy()[first]
    root = roots[np.searchsorted(nodes, edges["a_key"].to_numpy())]
    return rooted(edges.select(GRAPH_SCHEMA.names), root, partitions)


def rooted(edges: pa.Table, root: np.ndarray, partitions: int) -> pa.Table:
    return edges.append_column("root", pa.array(root, pa.int64())) \
        .append_column("part", pa.array(part_of(root, partitions)))


def assemble_components(group: pa.Table, priority: dict[str, int], first_eval: int) -> pa.Table:
    """The edges of whole components (each with its component's root) -> a row for every document but each
    component's kept one and the evaluation set's (parts from `first_eval` on), with the document's key, its
    reason (`duplicate`, or `near_eval` where the kept one is an evaluation document), and the component's
    size on the first row of each component (0 on the others).

    The kept document is the component's smallest (evaluation set first, source order, id); an exact copy
    goes `via` its text's kept copy with Jaccard 1.0, any other document via its verified neighbour of
    highest Jaccard (ties: the preferred neighbour)."""
    name: dict[int, tuple[str, str]] = {}
    root_of: dict[int, int] = {}
    copy_of: dict[int, int] = {}
    best: dict[int, tuple[float, int]] = {}

    def rank(k: int) -> tuple[bool, int, str, int]:  # smaller = preferred: the evaluation set, source order, id, key
        return k >> ROW_BITS < first_eval, priority.get(name[k][1], len(priority)), name[k][0], k

    columns = [group[c].to_pylist() for c in ("a_key", "b_key", "a", "b", "a_source", "b_source", "jaccard", "copy", "root")]
    for a_key, b_key, a, b, a_source, b_source, _, _, root in zip(*columns):
        name[a_key], name[b_key] = (a, a_source), (b, b_source)
        root_of[a_key] = root_of[b_key] = root
    for a_key, b_key, _, _, _, _, j, copy, _ in zip(*columns):
        if copy:
            copy_of[b_key] = a_key
            continue
        for x, y in ((a_key, b_key), (b_key, a_key)):
            if x not in best or j > best[x][0] or (j == best[x][0] and rank(y) < rank(best[x][1])):
                best[x] = (j, y)
    kept: dict[int, int] = {}
    size: collections.Counter = collections.Counter()
    for node, root in root_of.items():
        size[root] += 1
        if root not in kept or rank(node) < rank(kept[root]):
            kept[root] = node
    out, first = [], set()
    for node in sorted(root_of, key=lambda k: (root_of[k], k)):
        root = root_of[node]
        keep = kept[root]
        if node == keep or node >> ROW_BITS >= first_eval:  # the evaluation set is fixed: nothing leaves it here
            continue
        j, via = (1.0, copy_of[node]) if node in copy_of else best[node]
        out.append({"id": name[node][0], "source": name[node][1], "kept_id": name[keep][0], "kept_source": name[keep][1],
                    "jaccard": j, "via": name[via][0], "key": node, "cluster_size": 0 if root in first else size[root],
                    "reason": evalset.NEAR if keep >> ROW_BITS >= first_eval else DUPLICATE})
        first.add(root)
    return pa.Table.from_pylist(out, schema=ASSEMBLED_SCHEMA)


def tally(batch: pa.Table) -> pa.Table:
    """Assembled rows -> counts: documents removed per (source, kept source, reason), clusters per size."""
    removed = collections.Counter(zip(batch["source"].to_pylist(), batch["kept_source"].to_pylist(), batch["reason"].to_pylist()))
    sizes = collections.Counter(s for s in batch["cluster_size"].to_pylist() if s)
    rows = [{"source": s, "kept_source": k, "reason": r, "size": 0, "n": n} for (s, k, r), n in removed.items()]
    rows += [{"source": None, "kept_source": None, "reason": None, "size": s, "n": n} for s, n in sizes.items()]
    return pa.Table.from_pylist(rows, schema=TALLY_SCHEMA)


def assemble_in_one_task(candidates: str, exact: str, threshold: float, priority: dict[str, int], first_eval: int,
                         folders: dict[str, str], removed: dict[str, str]) -> tuple[list[dict], int]:
    """The small graph's path: components, kept documents, `duplicates/`, `near_eval/` and each part's removed
    rows (per reason), in one Ray task (memory ~ the duplicate documents). Returns (tally rows, edges)."""
    near = [near_edges(pq.read_table(p), threshold) for p in parquet_files(candidates)]
    copies = [copy_edges(pq.read_table(p)) for p in parquet_files(exact)]
    graph = pa.concat_tables([GRAPH_SCHEMA.empty_table(), *near, *copies])
    undirected = _undirected(graph)
    labels = components_in_one_task(undirected["u"].to_numpy(), undirected["v"].to_numpy()) if graph.num_rows else {}
    root = np.array([labels[k] for k in graph["a_key"].to_pylist()], dtype=np.int64)
    assembled = assemble_components(rooted(graph, root, 1), priority, first_eval)
    for reason, folder in folders.items():
        mine = assembled.filter(pc.equal(assembled["reason"], reason))
        parts = Parts(folder, FOLDERS[reason], DUPLICATE_SCHEMA)
        for row in mine.select(DUPLICATE_SCHEMA.names).to_pylist():
            parts.add(row)
        parts.close()
        Path(removed[reason]).mkdir(parents=True, exist_ok=True)
        keys = mine["key"].to_numpy()
        for part in np.unique(keys >> ROW_BITS).tolist():
            write_by_part(pa.table({"key": keys[(keys >> ROW_BITS) == part]}), removed[reason])
    return tally(assembled).to_pylist(), graph.num_rows


def assemble_on_ray(graph, labels, shuffles: Shuffles, priority: dict[str, int], first_eval: int,
                    folders: dict[str, str], removed: dict[str, str]) -> list[dict]:
    """The large graph's path after `components_on_ray`: a groupby joins each edge with its first document's
    label, another brings each component's edges to one task (`assemble_components`), and a third writes
    each part's removed rows. Writes `duplicates/` and `near_eval/` and returns the tally rows."""
    kw = {"partitions": partitions_for(graph.size_bytes())}
    joined = graph.map_batches(edges_keyed, batch_format="pyarrow", fn_kwargs=kw) \
        .union(labels.map_batches(labels_keyed, batch_format="pyarrow", fn_kwargs=kw))
    by_root = shuffles(joined, "components").map_groups(with_roots, batch_format="pyarrow", fn_kwargs=kw)
    assembled = shuffles(by_root, "components").map_groups(
        assemble_components, batch_format="pyarrow", fn_kwargs={"priority": priority, "first_eval": first_eval}).materialize()
    for reason, folder in folders.items():
        mine = assembled.map_batches(lambda b, r=reason: b.filter(pc.equal(b["reason"], r)), batch_format="pyarrow").materialize()
        Path(removed[reason]).mkdir(parents=True, exist_ok=True)
        if not mine.count():
            continue
        mine.select_columns(DUPLICATE_SCHEMA.names).write_parquet(folder)
        shuffles(mine.map_batches(keys_by_part, batch_format="pyarrow"), "components").map_groups(
            write_by_part, batch_format="pyarrow", fn_kwargs={"folder": removed[reason]}).materialize()
    return assembled.map_batches(tally, batch_format="pyarrow").take_all()


def graph_on_ray(candidates: Path, exact: Path, threshold: float, checked: int, copied: int):
    """The components' graph as a materialized Ray dataset: the verified pairs and the exact copies."""
    import ray.data

    near = ray.data.read_parquet(str(candidates)).map_batches(near_edges, batch_format="pyarrow",
                                                               fn_kwargs={"threshold": threshold}) if checked else None
    copies = ray.data.read_parquet(str(exact)).map_batches(copy_edges, batch_format="pyarrow") if copied else None
    return (near.union(copies) if near is not None and copies is not None else near or copies).materialize()


def assemble(inputs: Inputs, candidates: Path, exact: Path, threshold: float, priority: dict[str, int],
             shuffles: Shuffles, folders: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """Writes `duplicates/`, `near_eval/` and each part's removed rows per reason. Returns (what was found: the
    graph's size, rounds and the tally rows; reason -> the folder of its removed rows)."""
    import ray

    removed = {reason: str(inputs.work / f"removed-{reason}") for reason in FOLDERS}
    checked, copied = rows_in_folder(candidates), rows_in_folder(exact)  # from the footers
    found = {"candidate_pairs": checked, "exact_duplicates": copied, "rounds": 0, "verified_pairs": 0, "tallies": []}
    if checked + copied <= SMALL_GRAPH_EDGES:  # at most that many edges: one task
        found["tallies"], found["verified_pairs"] = ray.get(ray.remote(assemble_in_one_task).remote(
            str(candidates), str(exact), threshold, priority, inputs.first_eval, folders, removed))
        return found, removed
    for folder in removed.values():
        Path(folder).mkdir(parents=True)
    graph = graph_on_ray(candidates, exact, threshold, checked, copied)
    found["verified_pairs"] = graph.count()
    if found["verified_pairs"]:
        undirected = graph.map_batches(_undirected, batch_format="pyarrow").materialize()
        shuffles.moved["components"] = undirected.size_bytes()
        labels, found["rounds"] = components_on_ray(undirected, undirected.size_bytes(), shuffles.ray)
        found["tallies"] = assemble_on_ray(graph, labels, shuffles, priority, inputs.first_eval, folders, removed)
    return found, removed

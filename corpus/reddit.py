"""PushShift Reddit threads -> documents, as OPT did: the longest chain of each comment tree.

OPT linearised each thread's comment tree by keeping the longest root-to-leaf chain and
discarding every other path (about 66% of the comments). Here, for one thread (`link_id`):

- the tree comes from `parent_id` fullnames: `t3_` = the submission (the comment is a root),
  `t1_` = another comment. A comment whose parent comment is missing from the dump starts its own
  tree (counted as an orphan).
- the chain: from the roots, at each step the child with the deepest subtree; ties go to the
  earliest `created_utc`, then the smallest id (base 36, as Reddit numbers them).
- the text: one message per line, root first (a message's own newlines become spaces);
  "[deleted]"/"[removed]" bodies are left out of the text but keep their place in the chain
  (their replies still follow them).

Depths are computed without recursion: threads can be thousands of comments deep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

REMOVED = ("[deleted]", "[removed]")


@dataclass
class Thread:
    link_id: str
    text: str  # "" when every message on the chain was deleted or removed
    chain: list[str]  # comment ids, root first
    comments_in: int
    orphans: int


def _order_key(comment: dict) -> tuple[int, int]:
    return int(comment["created_utc"]), int(comment["id"], 36)


def longest_chain(link_id: str, comments: list[dict]) -> Thread:
    by_id = {c["id"]: c for c in comments}
    children: dict[str | None, list[str]] = {}
    orphans = 0
    for c in comments:
        parent = c["parent_id"]
        if parent.startswith("t1_") and parent[3:] in by_id:
            children.setdefault(parent[3:], []).append(c["id"])
        else:
            orphans += parent.startswith("t1_")
            children.setdefault(None, []).append(c["id"])  # a root (or an orphan: a root of its own)
    depth: dict[str, int] = {}
    for root in children.get(None, []):  # post-order, iteratively
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                depth[node] = 1 + max((depth[k] for k in children.get(node, [])), default=0)
            else:
                stack.append((node, True))
                stack.extend((k, False) for k in children.get(node, []))

    def best(ids: list[str]) -> str:
        return min(ids, key=lambda i: (-depth[i], *_order_key(by_id[i])))

    chain: list[str] = []
    level = children.get(None, [])
    while level:
        node = best(level)
        chain.append(node)
        level = children.get(node, [])
    lines = [" ".join(by_id[i]["body"].split("\n")) for i in chain if by_id[i]["body"].strip() not in REMOVED]
    return Thread(link_id, "\n".join(lines), chain, len(comments), orphans)


# --------------------------------------------------------------------------- threads on Ray Data
# One row per link_id, built by a Ray Data groupby over every monthly file (corpus/ingest.py):
# the thread's document (when it has text) and what happened to each of its records.
THREAD_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("subset", pa.string()),
    ("meta", pa.string()),
    ("outcome", pa.string()),  # document | empty_thread | no_comments
    ("link_id", pa.string()),
    ("comments", pa.int64()), ("on_chain", pa.int64()), ("kept", pa.int64()), ("submission", pa.int64()),
    ("chain_ids", pa.list_(pa.string())), ("off_chain_ids", pa.list_(pa.string())),
    ("repeated", pa.list_(pa.string())),  # "comment <id> at <file>:<line>": the same record twice
])


def thread_row(records: pa.Table, source: str) -> pa.Table:
    """All records of one link_id (comments and, if present, its submission) -> one THREAD_SCHEMA row."""
    rows = sorted(records.to_pylist(), key=lambda r: (r["file"], r["line"]))
    seen: set[tuple[str, str]] = set()
    comments, repeated, submission = [], [], None
    for r in rows:
        if (r["kind"], r["id"]) in seen:  # overlapping dumps: keep the first, say where the repeat was
            repeated.append(f"{r['kind']} {r['id']} at {r['file']}:{r['line']}")
            continue
        seen.add((r["kind"], r["id"]))
        if r["kind"] == "submission":
            submission = r
        else:
            comments.append(r)
    link_id = rows[0]["link_id"]
    thread = longest_chain(link_id, comments) if comments else None
    chain = thread.chain if thread else []
    by_id = {c["id"]: c for c in comments}
    kept = sum(by_id[i]["body"].strip() not in REMOVED for i in chain)
    on_chain = set(chain)
    meta = {"link_id": link_id, "subreddit": (submission or (comments[0] if comments else {})).get("subreddit", ""),
            "chain": chain, "comments": len(comments), "orphans": thread.orphans if thread else 0}
    if submission:
        meta.update(submission=submission["id"], title=submission["title"])
    outcome = "no_comments" if thread is None else "document" if kept else "empty_thread"
    row = {"id": f"{source}/{link_id}", "text": thread.text if thread else "", "source": source, "subset": source,
           "meta": json.dumps(meta, ensure_ascii=False, sort_keys=True), "outcome": outcome, "link_id": link_id,
           "comments": len(comments), "on_chain": len(chain), "kept": kept, "submission": int(submission is not None),
           "chain_ids": chain, "off_chain_ids": [c["id"] for c in comments if c["id"] not in on_chain],
           "repeated": repeated}
    return pa.Table.from_pylist([row], schema=THREAD_SCHEMA)


def thread_fates(row: dict) -> dict[str, int]:
    """Where each record of a staged thread went; the values sum to the thread's records."""
    fates = {"documents": 0, "joined_into_thread": 0, "off_longest_chain": 0, "empty_thread": 0,
             "submission_without_comments": 0, "repeated_record": len(row["repeated"])}
    if row["outcome"] == "no_comments":
        fates["submission_without_comments"] = row["submission"]
        return fates
    fates["off_longest_chain"] = row["comments"] - row["on_chain"]
    if row["outcome"] == "document":
        fates["documents"] = 1
        fates["joined_into_thread"] = row["on_chain"] - 1 + row["submission"]
    else:
        fates["empty_thread"] = row["on_chain"] + row["submission"]
    return fates

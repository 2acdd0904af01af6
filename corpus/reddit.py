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

from dataclasses import dataclass

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

"""OPT's Reddit linearisation on hand-built threads: branching, ties, deletions, orphans, depth."""

from __future__ import annotations

import random

from corpus.reddit import longest_chain


def c(cid: str, parent: str, t: int, body: str | None = None) -> dict:
    return {"id": cid, "parent_id": parent, "link_id": "t3_s", "created_utc": t, "body": body or f"msg {cid}"}


def test_longest_branch_wins_and_other_paths_are_dropped():
    comments = [
        c("a", "t3_s", 1), c("b", "t1_a", 2), c("c", "t1_a", 3), c("d", "t1_c", 4), c("e", "t1_d", 5),
        c("f", "t3_s", 0), c("g", "t1_f", 9),  # an earlier root, but a shorter tree
    ]
    thread = longest_chain("t3_s", comments)
    assert thread.chain == ["a", "c", "d", "e"]
    assert thread.text == "msg a\nmsg c\nmsg d\nmsg e"
    assert thread.comments_in == 7 and thread.orphans == 0


def test_ties_go_to_the_earliest_then_the_smallest_id():
    by_time = [c("a", "t3_s", 1), c("b", "t1_a", 5), c("c", "t1_a", 4)]
    assert longest_chain("t3_s", by_time).chain == ["a", "c"]
    # Same second: the smallest id in base 36 ("z" = 35 comes before "10" = 36).
    by_id = [c("a", "t3_s", 1), c("10", "t1_a", 4), c("z", "t1_a", 4)]
    assert longest_chain("t3_s", by_id).chain == ["a", "z"]
    roots = [c("q", "t3_s", "7"), c("p", "t3_s", "7")]  # created_utc as a string, as older dumps have it
    assert longest_chain("t3_s", roots).chain == ["p"]


def test_deleted_messages_keep_their_place_but_not_their_text():
    comments = [c("a", "t3_s", 1), c("b", "t1_a", 2, "[deleted]"), c("d", "t1_b", 3, "the reply\nover two lines"),
                c("x", "t1_a", 2, "a shorter branch")]
    thread = longest_chain("t3_s", comments)
    assert thread.chain == ["a", "b", "d"]
    assert thread.text == "msg a\nthe reply over two lines"
    assert longest_chain("t3_s", [c("a", "t3_s", 1, "[removed]")]).text == ""


def test_orphans_start_their_own_tree_and_order_does_not_matter():
    comments = [c("a", "t3_s", 1), c("b", "t1_gone", 2), c("d", "t1_b", 3), c("e", "t1_d", 4)]
    thread = longest_chain("t3_s", comments)
    assert thread.chain == ["b", "d", "e"] and thread.orphans == 1
    shuffled = comments[:]  # comments arrive from several monthly files in any order
    random.Random(0).shuffle(shuffled)
    assert longest_chain("t3_s", shuffled).chain == thread.chain


def test_a_very_deep_thread_needs_no_recursion():
    ids = [format(36**3 + i, "x") for i in range(5000)]
    comments = [c(ids[0], "t3_s", 0)] + [c(ids[i], f"t1_{ids[i - 1]}", i) for i in range(1, 5000)]
    assert len(longest_chain("t3_s", comments).chain) == 5000

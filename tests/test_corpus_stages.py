"""Ingest and normalize as stages of `pipelines/full.py`, on Ray: every planted defect accounted for,
documents byte-exact, Reddit threads across monthly files, MLflow showing the counts."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import zstandard
from mlflow import MlflowClient

from conftest import manifest, rows, stage_folder, write_config
from corpus.ingest import REASONS
from corpus.normalize import normalize_text
from corpus.reddit import longest_chain
from corpus.sample import PILE_SUBSETS_KEPT_BY_OPT, write_zst_lines
from corpus.config import NormalizeConfig
from pipelines.full import main

# --------------------------------------------------------------------------- ingest on the sample


def test_ingest_counts_add_up_and_every_planted_defect_is_a_located_reject(sample_run):
    sample, planted, wd = sample_run
    counts = manifest(wd, "ingest")["counts"]
    assert counts["rows_in"] == counts["rows_out"] + sum(counts[r] for r in REASONS)
    rejects = rows(stage_folder(wd, "ingest") / "rejects")
    located = {(str(Path(r["file"]).relative_to(sample)), r["line"]) for r in rejects}
    assert {(m["file"], m["line"]) for m in planted["malformed"]} <= located
    by_file = collections.defaultdict(list)
    for r in rejects:
        by_file[str(Path(r["file"]).relative_to(sample))].append(r["reason"])
    assert by_file[planted["truncated_files"][0]["file"]][0].startswith("truncated file")
    assert by_file[planted["invalid_utf8_files"][0]][0].startswith("invalid UTF-8")
    assert "no meta.pile_set_name" in by_file[planted["missing_subset"]["file"]]
    other = len(planted["truncated_files"]) + len(planted["invalid_utf8_files"]) + 1
    assert counts["rejected"] == len(rejects) == len(planted["malformed"]) + other
    assert all(r["head"] is not None and len(r["head"].encode()) <= 200 * 3 for r in rejects)
    reasons = {(m["file"], m["line"]): m["defect"] for m in planted["malformed"]}
    for r in rejects:
        defect = reasons.get((str(Path(r["file"]).relative_to(sample)), r["line"]))
        expected = {"truncated JSON": "malformed JSON", "not JSON": "malformed JSON", "no text field": "no 'text' field",
                    "text is not a string": "'text' is a int", "invalid UTF-8": "invalid UTF-8", "empty line": "empty line"}
        if defect:
            assert r["reason"].startswith(expected[defect]), (defect, r["reason"])


def test_ingest_keeps_opts_pile_subsets_and_writes_down_the_rest(sample_run):
    _, _, wd = sample_run
    folder = stage_folder(wd, "ingest")
    docs = [r for r in rows(folder / "output") if r["source"] == "pile"]
    not_kept = rows(folder / "subset_not_kept")
    assert {r["subset"] for r in docs} == set(PILE_SUBSETS_KEPT_BY_OPT)
    assert len({r["subset"] for r in not_kept}) == 14 and not {r["subset"] for r in not_kept} & set(PILE_SUBSETS_KEPT_BY_OPT)
    assert manifest(wd, "ingest")["counts"]["subset_not_kept"] == len(not_kept)


def test_ingested_documents_are_byte_exact_with_stable_unique_ids(sample_run):
    sample, _, wd = sample_run
    docs = {r["id"]: r for r in rows(stage_folder(wd, "ingest") / "output")}
    assert len(docs) == manifest(wd, "ingest")["counts"]["rows_out"]  # ids are unique
    # Decoded independently of the readers: zstd + json for the Pile, bytes for text, json for ccnews.
    raw = zstandard.ZstdDecompressor().decompressobj().decompress((sample / "pile" / "01.jsonl.zst").read_bytes())
    checked = 0
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if line and (doc := docs.get(f"pile/01.jsonl.zst:{lineno}")):
            assert doc["text"] == json.loads(line)["text"]
            checked += 1
    assert checked > 50
    assert any("\\" in docs[i]["text"] for i in docs if i.startswith("pile/"))  # backslashes not doubled
    for path in (sample / "stories").glob("*.txt"):
        assert docs[f"stories/{path.name}"]["text"].encode("utf-8") == path.read_bytes()
    crlf = docs["bookcorpus/book_000.txt"]["text"]
    assert crlf.encode() == (sample / "bookcorpus" / "book_000.txt").read_bytes()
    for line in (sample / "ccnews" / "2019.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert docs[record["id"]]["text"] == record["text"]
        assert json.loads(docs[record["id"]]["meta"])["url"] == record["url"]


def test_reddit_threads_group_comments_of_every_month(sample_run):
    sample, planted, wd = sample_run
    metrics = manifest(wd, "ingest")["metrics"]
    assert metrics["reddit_threads"] == planted["reddit"]["threads"]
    assert metrics["reddit_comments_in"] == planted["reddit"]["comments"]
    comments = collections.defaultdict(list)
    month_of = {}
    for path in sorted((sample / "reddit").glob("RC_*.zst")):
        with zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(path.open("rb")) as fh:
            for line in fh.read().split(b"\n"):
                try:
                    c = json.loads(line)
                except ValueError:
                    continue
                comments[c["link_id"]].append(c)
                month_of[c["id"]] = path.name
    threads = {json.loads(r["meta"])["link_id"]: r for r in rows(stage_folder(wd, "ingest") / "output") if r["source"] == "reddit"}
    spanning = [link for link, cs in comments.items() if len({month_of[c["id"]] for c in cs}) == 2]
    assert len(spanning) == planted["reddit"]["threads_spanning_months"] > 0
    for link, cs in comments.items():
        expected = longest_chain(link, cs)
        assert json.loads(threads[link]["meta"])["chain"] == expected.chain
        assert threads[link]["text"] == expected.text
        assert threads[link]["id"] == f"reddit/{link}"
    assert any(month_of[i] == "RC_2019-02.zst" for link in spanning for i in json.loads(threads[link]["meta"])["chain"])
    off_chain = rows(stage_folder(wd, "ingest") / "off_longest_chain")
    assert sum(len(r["ids"]) for r in off_chain) == manifest(wd, "ingest")["counts"]["off_longest_chain"]
    assert metrics["reddit_comments_on_chain"] + manifest(wd, "ingest")["counts"]["off_longest_chain"] == planted["reddit"]["comments"]


# --------------------------------------------------------------------------- normalize on the sample


def test_normalize_drops_with_reasons_and_changes_what_the_rules_say(sample_run):
    _, planted, wd = sample_run
    ingested = {r["id"]: r for r in rows(stage_folder(wd, "ingest") / "output")}
    folder = stage_folder(wd, "normalize")
    out = {r["id"]: r for r in rows(folder / "output")}
    held_out = {r["id"]: r for r in rows(folder / "eval")}
    dropped = {r["id"]: r["reason"] for r in rows(folder / "dropped")}
    planted_drops = {d["id"]: d["kind"] for d in planted["normalize_drops"]}
    assert dropped == {i: ("empty after normalization" if k == "whitespace only" else "shorter than 20 characters")
                       for i, k in planted_drops.items()}
    assert set(out) | set(held_out) == set(ingested) - set(dropped) and not set(out) & set(held_out)
    # The evaluation set: local.yaml's fraction of each source, by the seeded draw of (source, id) alone.
    from corpus.evalset import drawn

    kept = [ingested[i] for i in sorted(set(ingested) - set(dropped))]
    chosen = drawn([d["source"] for d in kept], [d["id"] for d in kept], 0.1, 0)
    assert {d["id"] for d, c in zip(kept, chosen) if c} == set(held_out)
    assert {d["source"] for d in held_out.values()} >= {"pile", "reddit", "ccnews", "stories"}
    config = NormalizeConfig(min_chars=20)
    changed = collections.Counter()
    for doc_id, doc in {**out, **held_out}.items():
        expected = normalize_text(ingested[doc_id]["text"], config)
        assert doc["text"] == expected.text
        assert {k: doc[k] for k in ("source", "subset", "meta")} == {k: ingested[doc_id][k] for k in ("source", "subset", "meta")}
        changed.update(expected.changed_by)
    m = manifest(wd, "normalize")
    assert m["counts"] == {"rows_in": len(ingested), "rows_out": len(out), "dropped": len(dropped), "eval": len(held_out)}
    for rule in ("ftfy", "whitespace", "gutenberg", "chapter_headings"):
        assert m["metrics"][f"changed.{rule}"] == changed[rule] > 0
    mojibake = [e for e in planted["messy"] if e["kind"] == "mojibake" and "id" in e]
    assert all("â€" not in out[e["id"]]["text"] for e in mojibake)
    assert "â€" in ingested[mojibake[0]["id"]]["text"]


def test_mlflow_shows_the_counts_of_both_stages(sample_run):
    _, _, wd = sample_run
    client = MlflowClient(f"sqlite:///{wd}/mlflow.db")
    for stage in ("ingest", "normalize"):
        m = manifest(wd, stage)
        run = client.get_run(m["mlflow_run_id"])
        assert run.data.tags["stage"] == stage and run.info.status == "FINISHED"
        for key, value in m["counts"].items():
            assert run.data.metrics[key] == value
    ingest_run = client.get_run(manifest(wd, "ingest")["mlflow_run_id"])
    assert ingest_run.data.params["ingest.on_bad_input"] == "reject"
    assert ingest_run.data.metrics["documents.pile/Gutenberg _PG-19_"] > 0


# --------------------------------------------------------------------------- hand-built inputs


def comment(cid: str, parent: str, link: str, t: int, body: str = "") -> bytes:
    return json.dumps({"id": cid, "parent_id": parent, "link_id": link, "created_utc": t,
                       "body": body or f"message {cid}", "subreddit": "test"}).encode()


def test_threads_split_across_two_monthly_dumps(tmp_path, ray_session):
    """January holds the roots, February the replies; a re-scraped comment appears in both."""
    raw = tmp_path / "reddit"
    raw.mkdir()
    jan = [comment("a1", "t3_s1", "t3_s1", 100), comment("a2", "t1_a1", "t3_s1", 110),
           comment("b1", "t3_s1", "t3_s1", 105),
           comment("c1", "t3_s2", "t3_s2", 100, "[deleted]"), comment("c2", "t1_c1", "t3_s2", 120, "[removed]"),
           b'{"id": "bad", "parent_id": "t3_s1", "link_id": "t3_s1", "created_utc": "yesterday", "body": "x"}',
           b'{"id": "bad2", "parent_id": "t3_s1", "link_id": "s1", "created_utc": 1, "body": "x"}']
    feb = [comment("a3", "t1_a2", "t3_s1", 200, "deepest\nreply"), comment("b2", "t1_b1", "t3_s1", 201),
           comment("a2", "t1_a1", "t3_s1", 110)]  # a2 again: an overlapping re-scrape
    subs = [json.dumps({"id": "s1", "title": "A title", "selftext": "", "created_utc": 90, "subreddit": "test"}).encode(),
            json.dumps({"id": "s3", "title": "Nobody answered", "created_utc": 95}).encode()]
    write_zst_lines(raw / "RC_2019-01.zst", jan, window_log=31)
    write_zst_lines(raw / "RC_2019-02.zst", feb, window_log=31)
    write_zst_lines(raw / "RS_2019-01.zst", subs, window_log=31)
    cfg = write_config(tmp_path, f"""
workdir: {tmp_path}/work
sources:
  - {{name: reddit, format: pushshift, paths: ["{raw}/R*.zst"]}}
""")
    assert main(["--config", str(cfg), "--only", "ingest"]) == 0
    wd = tmp_path / "work"
    folder = stage_folder(wd, "ingest")
    docs = {r["id"]: r for r in rows(folder / "output")}
    assert set(docs) == {"reddit/t3_s1"}
    # a1 -> a2 (Jan) -> a3 (Feb) is deeper than b1 -> b2; a3's newline becomes a space.
    assert docs["reddit/t3_s1"]["text"] == "message a1\nmessage a2\ndeepest reply"
    meta = json.loads(docs["reddit/t3_s1"]["meta"])
    assert meta["chain"] == ["a1", "a2", "a3"] and meta["title"] == "A title" and meta["submission"] == "s1"
    counts = manifest(wd, "ingest")["counts"]
    assert counts == {"rows_in": 12, "rows_out": 1, "rejected": 2, "subset_not_kept": 0,
                      "off_longest_chain": 2,  # b1, b2
                      "joined_into_thread": 3,  # a2, a3 and the submission s1
                      "empty_thread": 2,  # c1, c2: every message deleted or removed
                      "submission_without_comments": 1,  # s3
                      "repeated_record": 1}  # a2 from February
    assert {r["link_id"]: r["ids"] for r in rows(folder / "empty_thread")} == {"t3_s2": ["c1", "c2"]}
    assert {r["link_id"]: r["ids"] for r in rows(folder / "submission_without_comments")} == {"t3_s3": ["s3"]}
    assert [r["ids"][0].split(" at ")[0] for r in rows(folder / "repeated_record")] == ["comment a2"]
    reasons = sorted(r["reason"] for r in rows(folder / "rejects"))
    assert reasons == ["comment without a 't3_' 'link_id'", "no integer 'created_utc'"]
    metrics = manifest(wd, "ingest")["metrics"]
    assert (metrics["reddit_threads"], metrics["reddit_comments_in"], metrics["reddit_comments_kept"]) == (2, 7, 3)


def test_on_bad_input_fail_exits_1_naming_file_and_line(tmp_path, ray_session, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": 5}\n{"text": "never read"}\n')
    cfg = write_config(tmp_path, f"""
workdir: {tmp_path}/work
ingest: {{on_bad_input: fail}}
sources:
  - {{name: misc, format: jsonl, paths: ["{raw}/*.jsonl"]}}
""")
    assert main(["--config", str(cfg), "--only", "ingest"]) == 1
    err = capsys.readouterr().err
    assert f"{raw}/a.jsonl:3" in err and "'text' is a int, not a string" in err
    assert not (tmp_path / "work" / "ingest" / "manifest.json").exists()
    # The same input with the default (reject) goes through, and says what it set aside.
    assert main(["--config", str(cfg), "--only", "ingest", "--set", "ingest.on_bad_input=reject"]) == 0
    counts = manifest(tmp_path / "work", "ingest")["counts"]
    assert (counts["rows_in"], counts["rows_out"], counts["rejected"]) == (4, 3, 1)


def test_text_blocks_and_generic_jsonl_ids(tmp_path, ray_session):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "poems.txt").write_text("first poem\nline two\n\n\n  \nsecond poem\n\nthird\n")
    (raw / "x.jsonl").write_text('{"doc": "one", "key": 7}\n{"doc": "two", "key": "k2"}\n')
    cfg = write_config(tmp_path, f"""
workdir: {tmp_path}/work
sources:
  - {{name: poems, format: text, split: blank_lines, paths: ["{raw}/*.txt"]}}
  - {{name: misc, format: jsonl, text_field: doc, id_field: key, paths: ["{raw}/*.jsonl"]}}
""")
    assert main(["--config", str(cfg), "--only", "ingest"]) == 0
    docs = {r["id"]: r["text"] for r in rows(stage_folder(tmp_path / "work", "ingest") / "output")}
    assert docs == {"poems/poems.txt:1": "first poem\nline two", "poems/poems.txt:6": "second poem",
                    "poems/poems.txt:8": "third", "7": "one", "k2": "two"}


def test_links_out_and_file_names_that_are_not_utf8_are_counted_rejects_and_ingest_goes_on(tmp_path, ray_session):
    """A planted link out of a source's folder is a reject naming it, never read (the token stays out of documents
    and rejects' heads alike); a file whose name is not UTF-8 is read, its bytes escaped in ids and rejects."""
    import os

    token = tmp_path / "auth_token"  # stands in for ~/.ray/auth_token
    token.write_text('{"text": "secret"}\n')
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("a book")
    (raw / "zz.txt").symlink_to(token)
    (raw / "x.jsonl").symlink_to(token)
    for name, data in ((b"caf\xe9.txt", b"a second book"), (b"bad\xff.txt", b"\xff")):
        Path(os.fsdecode(os.fsencode(raw) + b"/" + name)).write_bytes(data)
    (raw / "ok.jsonl").write_text('{"text": "a line"}\n')
    cfg = write_config(tmp_path, f"""
workdir: {tmp_path}/work
sources:
  - {{name: books, format: text, paths: ["{raw}/*.txt"]}}
  - {{name: misc, format: jsonl, paths: ["{raw}/*.jsonl"]}}
""")
    assert main(["--config", str(cfg), "--only", "ingest"]) == 0
    counts = manifest(tmp_path / "work", "ingest")["counts"]
    assert (counts["rows_in"], counts["rows_out"], counts["rejected"]) == (6, 3, 3)
    folder = stage_folder(tmp_path / "work", "ingest")
    docs, rejects = rows(folder / "output"), rows(folder / "rejects")
    assert sorted(d["id"] for d in docs) == ["books/a.txt", "books/caf\\xe9.txt", "misc/ok.jsonl:1"]
    linked = f"resolves through a symbolic link to {token}, outside the source's folder: not read"
    assert sorted((r["file"], r["reason"]) for r in rejects if r["line"] == 0 and r["head"] == "") == [
        (f"{raw}/x.jsonl", linked), (f"{raw}/zz.txt", linked)]
    assert any(r["file"] == f"{raw}/bad\\xff.txt" and r["reason"].startswith("invalid UTF-8") for r in rejects)
    assert not any("secret" in str(r) for r in docs + rejects)


def test_dedup_removes_the_planted_duplicates_and_nothing_else(sample_run):
    _, planted, wd = sample_run
    folder = stage_folder(wd, "dedup")
    dups = {r["id"]: r for r in rows(folder / "duplicates")}
    kinds = {d["kind"]: d for d in planted["duplicates"]}
    assert kinds["near"]["jaccard"] >= 0.95 > kinds["below threshold"]["jaccard"]
    # Exact and near copies go (the Pile's copy is kept: it is listed first); the one at 0.937 stays.
    assert {"ccnews-2019-0002", "stories/story_000.txt"} <= set(dups)
    assert dups["ccnews-2019-0002"]["kept_source"] == dups["stories/story_000.txt"]["kept_source"] == "pile"
    assert dups["stories/story_000.txt"]["jaccard"] == pytest.approx(kinds["near"]["jaccard"], abs=1e-4)
    owt = [d for d in dups.values() if d["source"] == "pile"]
    assert len(owt) == 1 and len(dups) == 3
    kept = {r["id"] for r in rows(folder / "output")}
    assert {"ccnews-2019-0008", "ccnews-2019-0006"} <= kept
    m = manifest(wd, "dedup")
    assert m["counts"] == {"rows_in": manifest(wd, "normalize")["counts"]["rows_out"], "rows_out": len(kept), "duplicate": 3,
                           "near_eval": 0}  # no planted copy is of an evaluation document (tests/test_dedup.py has those)

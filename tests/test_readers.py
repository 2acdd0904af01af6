"""Readers: documents byte-exact, every bad line a located reject with its reason, cut files kept in part."""

from __future__ import annotations

import collections
import gzip
import io
import json
import random
import re
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corpus.readers import REDDIT_FIELDS, ROW_FIELDS, read_jsonl, read_lines, read_pile, read_pushshift, read_text, relative_names


def pile_rows(out: Path) -> list[dict]:
    files = sorted(str(p) for p in (out / "pile").glob("*.jsonl.zst"))
    rel = relative_names(files)
    return [r for f in files for r in read_pile(f, "pile", rel[f])]


def test_pile_rejects_exactly_the_planted_bad_lines(sample):
    out, planted = sample
    rows = pile_rows(out)
    assert all(set(r) == set(ROW_FIELDS) for r in rows)
    rejects = {(Path(r["file"]).relative_to(out).as_posix(), r["line"]): r["reason"] for r in rows if r["reason"]}
    expected = {(m["file"], m["line"]): m["defect"] for m in planted["malformed"] if m["file"].startswith("pile/")}
    words = {"truncated JSON": "malformed JSON", "not JSON": "malformed JSON", "no text field": "no 'text' field",
             "text is not a string": "'text' is a int, not a string", "invalid UTF-8": "invalid UTF-8", "empty line": "empty line"}
    for where, defect in expected.items():
        assert rejects[where].startswith(words[defect]), (where, rejects.get(where))
    other = {k: v for k, v in rejects.items() if k not in expected}
    assert sorted(other.values()) == ["no meta.pile_set_name", "truncated file: zstd stream ends inside a frame (file cut short?)"]
    # Every line of the complete files is a document or a reject.
    for name in ("00.jsonl.zst", "01.jsonl.zst"):
        assert sum(1 for r in rows if r["file"].endswith(name)) == planted["files"][f"pile/{name}"]["lines"]
    assert {r["subset"] for r in rows if not r["reason"]} >= {"Pile-CC", "Github", "DM Mathematics"}


def test_readable_part_of_a_truncated_file_is_kept(sample):
    out, planted = sample
    rows = [r for r in pile_rows(out) if r["file"].endswith("02.jsonl.zst")]
    docs, rejects = [r for r in rows if not r["reason"]], [r for r in rows if r["reason"]]
    assert 0 < len(docs) < planted["truncated_files"][0]["documents_before_cut"]
    (cut,) = rejects
    assert cut["line"] == len(docs) + 1 and cut["offset"] > 0 and cut["reason"].startswith("truncated file")


def test_text_is_byte_exact_and_ids_are_stable(sample):
    out, _ = sample
    originals = {}
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO((out / "pile" / "00.jsonl.zst").read_bytes())) as r:
        for lineno, line in enumerate(r.read().split(b"\n"), start=1):
            try:
                originals[lineno] = json.loads(line)["text"]
            except (ValueError, KeyError):
                pass
    docs = [r for r in pile_rows(out) if not r["reason"] and r["file"].endswith("00.jsonl.zst")]
    assert len(docs) > 100 and all(d["text"] == originals[d["line"]] for d in docs)
    assert any("\\" in d["text"] and '"' in d["text"] for d in pile_rows(out) if not d["reason"])
    assert docs[0]["id"] == f"pile/00.jsonl.zst:{docs[0]['line']}"
    assert [d["id"] for d in pile_rows(out)] == [d["id"] for d in pile_rows(out)]
    assert len({d["id"] for d in pile_rows(out) if not d["reason"]}) == sum(1 for d in pile_rows(out) if not d["reason"])
    book = out / "bookcorpus" / "book_001.txt"
    (doc,) = read_text(str(book), "bookcorpus", "book_001.txt")
    assert doc["text"].encode("utf-8") == book.read_bytes() and "\r\n" in doc["text"]  # CRLF kept: normalize's job


def test_text_rejects_non_utf8_and_empty_files(sample, tmp_path):
    out, _ = sample
    (bad,) = read_text(str(out / "bookcorpus" / "book_latin1.txt"), "bookcorpus", "book_latin1.txt")
    assert bad["reason"].startswith("invalid UTF-8") and bad["offset"] > 0 and bad["id"] == ""
    whole = zstandard.ZstdCompressor().compress(b"a story " * 5000)
    (tmp_path / "cut.txt.zst").write_bytes(whole[: len(whole) // 2])
    (cut,) = read_text(str(tmp_path / "cut.txt.zst"), "stories", "cut.txt.zst")
    assert cut["reason"].startswith("truncated file: zstd stream ends inside a frame")
    (tmp_path / "junk.txt.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\xff" * 64)  # zstd magic, then garbage
    (junk,) = read_text(str(tmp_path / "junk.txt.zst"), "stories", "junk.txt.zst")
    assert junk["reason"].startswith("corrupt file: ")
    (tmp_path / "empty.txt").write_bytes(b"  \n")
    (empty,) = read_text(str(tmp_path / "empty.txt"), "stories", "empty.txt")
    assert empty["reason"] == "empty file"


def test_jsonl_ids_fields_and_compressions(tmp_path):
    records = [{"id": "n-1", "text": "one", "url": "u1"}, {"id": 2, "text": "two"}, {"text": "no id"}, {"id": "n-4", "text": ["x"]}]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst"):
        rows = list(read_jsonl(str(tmp_path / name), "news", name, id_field="id"))
        assert [r["id"] for r in rows if not r["reason"]] == ["n-1", "2"]
        assert [r["reason"] for r in rows if r["reason"]] == ["no string or integer 'id' field", "'text' is a list, not a string"]
        assert json.loads(rows[0]["meta"]) == {"url": "u1"}
    rows = list(read_jsonl(str(tmp_path / "a.jsonl"), "news", "a.jsonl"))
    assert [r["id"] for r in rows if not r["reason"]] == ["news/a.jsonl:1", "news/a.jsonl:2", "news/a.jsonl:3"]
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert [r["reason"] for r in read_jsonl(str(tmp_path / "empty.jsonl"), "news", "empty.jsonl")] == ["empty file"]


def test_truncated_gzip_and_concatenated_zstd_frames(tmp_path):
    data = b"".join(b'{"text": "line %d"}\n' % i for i in range(3000))
    cut = gzip.compress(data)
    (tmp_path / "cut.jsonl.gz").write_bytes(cut[: len(cut) // 2])
    rows = list(read_jsonl(str(tmp_path / "cut.jsonl.gz"), "x", "cut.jsonl.gz"))
    assert 0 < sum(not r["reason"] for r in rows) < 3000 and rows[-1]["reason"].startswith("truncated file: gzip")
    half = len(data) // 2
    cctx = zstandard.ZstdCompressor()
    (tmp_path / "two.jsonl.zst").write_bytes(cctx.compress(data[:half]) + cctx.compress(data[half:]))
    lines = list(read_lines(str(tmp_path / "two.jsonl.zst")))
    assert len(lines) == 3000 and all(p is None for *_, p in lines)  # a line split across frames is whole


def test_the_2gib_window_only_where_the_source_allows_it(sample):
    """PushShift's dumps (written as `zstd --long=31` writes them: a 2 GiB window) are read with that window; the same
    file in another format, whose default is libzstd's 128 MiB, is a reject naming the setting, as it is for PushShift
    under a lower setting: a reader never holds 2 GiB for a file that was not allowed it."""
    from corpus.readers import Limits

    out, planted = sample
    files = sorted((out / "reddit").glob("RC_*.zst"))
    lines = [l for f in files for l in read_lines(str(f), Limits(zstd_window_log=31))]
    assert all(problem is None for *_, problem in lines)
    assert len(lines) == sum(planted["files"][f"reddit/{f.name}"]["lines"] for f in files)
    counts = collections.Counter(l[2][:7] for l in lines)
    assert counts[b'{"id": '] >= planted["reddit"]["comments"]
    comments = [r for f in files for r in read_pushshift(str(f), "reddit", f.name) if r.get("kind") == "comment"]
    assert len(comments) == planted["reddit"]["comments"]

    refused = ("a zstd frame needs a window over 2^27 bytes (zstd_window_log 27): not read; raise the source's "
               "zstd_window_log (at most 31) if its dumps were written with zstd --long")
    assert next(read_jsonl(str(files[0]), "web", files[0].name, text_field="body"))["reason"] == refused
    lowered = Limits(zstd_window_log=27)
    assert next(read_pushshift(str(files[0]), "reddit", files[0].name, limits=lowered))["reason"] == refused
    rows = list(read_jsonl(str(files[0]), "web", files[0].name, text_field="body", limits=Limits(zstd_window_log=31)))
    assert sum(not r["reason"] for r in rows) == planted["files"][f"reddit/{files[0].name}"]["documents"]


def test_an_incompressible_start_buys_no_room_for_a_bomb_after_it(tmp_path):
    """The ratio is judged over the recent output: 256 KiB of random bytes, then 192 MiB of zeros (in 6 KB) is a
    reject once the zeros pass 125 MiB, though the file as a whole stays under 1000 to 1."""
    from corpus.readers import Limits, TooLarge, byte_chunks

    path = tmp_path / "prefix-bomb.jsonl.zst"
    with open(path, "wb") as fh:
        fh.write(zstandard.ZstdCompressor().compress(random.Random(0).randbytes(256 << 10)))
        with zstandard.ZstdCompressor().stream_writer(fh) as writer:
            for _ in range(12):
                writer.write(bytes(16 << 20))
    assert (192 << 20) < 1000 * path.stat().st_size
    produced = 0
    with pytest.raises(TooLarge, match=r"^decompresses beyond 1000 to 1 \(.*judged over at most its last 125 MiB\)"):
        for chunk in byte_chunks(str(path), Limits()):
            produced += len(chunk)
    assert (120 << 20) < produced < (135 << 20)  # the window, and what the zeros' own 6 KB pay for


def pushshift_rows(tmp_path: Path, records: list) -> list[dict]:
    path = tmp_path / "RC_x.zst"
    lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r in records]
    path.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))
    return list(read_pushshift(str(path), "reddit", "RC_x.zst"))


GOOD = {"id": "abc1", "parent_id": "t3_s1", "link_id": "t3_s1", "created_utc": 1546300800, "body": "hello \\ there"}


@pytest.mark.parametrize("change, reason", [
    ({"id": "ABC!"}, "no base-36 'id'"),
    ({"created_utc": "yesterday"}, "no integer 'created_utc'"),
    ({"created_utc": True}, "no integer 'created_utc'"),
    ({"body": None}, "comment without a string 'body'"),
    ({"link_id": "s1"}, "comment without a 't3_' 'link_id'"),
    ({"parent_id": 17}, "comment without a 't1_'/'t3_' 'parent_id'"),
])
def test_pushshift_comment_checks(tmp_path, change, reason):
    (row,) = pushshift_rows(tmp_path, [{**GOOD, **change}])
    assert row["reason"] == reason and row["line"] == 1 and row["head"].startswith('{"id"')


def test_pushshift_records_and_what_is_not_one(tmp_path):
    rows = pushshift_rows(tmp_path, [
        GOOD, {**GOOD, "id": "abc2", "created_utc": "1546300900"},  # older dumps: a string
        {"id": "s1", "title": "T", "selftext": "S", "created_utc": 1546300000.0, "subreddit": "books"},
        {"id": "s2", "name": "t3_s2", "created_utc": 1}, [1, 2], b"not json"])
    assert [r.get("kind") or r["reason"] for r in rows] == [
        "comment", "comment", "submission", "neither a comment ('body') nor a submission ('title')",
        "a JSON list, not an object", "malformed JSON: Expecting value"]
    assert set(rows[0]) == set(REDDIT_FIELDS) and rows[0]["body"] == "hello \\ there"
    assert rows[1]["created_utc"] == 1546300900 and rows[1]["line"] == 2
    assert rows[2] == {"kind": "submission", "id": "s1", "link_id": "t3_s1", "parent_id": "", "body": "S",
                       "created_utc": 1546300000, "subreddit": "books", "title": "T", "file": rows[2]["file"], "line": 3}


def test_text_blocks_are_exact_with_lines_and_byte_offsets(tmp_path):
    text = "é first\r\nstill first\n \n\nsecond\n\n\nthird  \n"
    (tmp_path / "b.txt").write_bytes(text.encode())
    rows = list(read_text(str(tmp_path / "b.txt"), "s", "b.txt", split="blank_lines"))
    assert [(r["id"], r["text"], r["line"]) for r in rows] == [
        ("s/b.txt:1", "é first\r\nstill first", 1), ("s/b.txt:5", "second", 5), ("s/b.txt:8", "third  ", 8)]
    raw = text.encode()
    for r in rows:
        assert raw[r["offset"]:].startswith(r["text"].encode())



BLANK = re.compile(r"\n(?:[^\S\n]*\n)+|\n[^\S\n]*\Z")  # blank lines between blocks, or the text's end


def blocks_of(text: str) -> list[tuple[int, int, str]]:
    """The blocks of a whole text split at blank lines, as read_text made them when it held the file: (first line,
    byte offset, block); blank-only blocks are separators. The streaming reader must give exactly these."""
    found, start, line, offset = [], 0, 1, 0
    for match in [*BLANK.finditer(text), None]:
        end = match.start() if match else len(text)
        if text[start:end].strip():
            found.append((line, offset, text[start:end]))
        if match:
            line += text.count("\n", start, match.end())
            offset += len(text[start:match.end()].encode())
            start = match.end()
    return found


def block_rows(path: Path, limits=None) -> list[tuple]:
    from corpus.readers import LIMITS

    rows = read_text(str(path), "s", path.name, split="blank_lines", limits=limits or LIMITS)
    return [(r["id"], r["line"], r["offset"], r["text"], r["reason"]) for r in rows]


# Whitespace a blank line may hold besides spaces: \r (CRLF files), \x1c and \x85 (str.isspace, so the regex's
# \s, but not bytes.strip), U+3000 (three bytes in UTF-8, which a small read splits).
BLOCKY = st.text(alphabet="ab\u00e9\n\n\n  \r\t\x1c\x85\u3000\U0001F600", max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=BLOCKY, read=st.integers(1, 9))
def test_blank_line_blocks_read_in_small_steps_are_the_blocks_of_the_whole_text(tmp_path, monkeypatch, text, read):
    """Any text, read a few bytes at a time, gives the blocks (ids, lines, byte offsets, texts) that splitting the
    whole decoded text at its blank lines gives."""
    from corpus import readers

    path = tmp_path / "b.txt"
    path.write_bytes(text.encode())
    monkeypatch.setattr(readers, "CHUNK", read)
    rows = block_rows(path)
    expected = blocks_of(text)
    if not expected:
        assert [r[-1] for r in rows] == ["empty file"]
        return
    assert rows == [(f"s/b.txt:{line}", line, offset, block, "") for line, offset, block in expected]


def test_a_file_of_blocks_streams_past_the_document_cap_with_the_same_documents(tmp_path, monkeypatch):
    """A file of blank-line blocks larger than max_document_bytes is read block by block: every block a document,
    the same in reads of 4093 bytes (which split lines and characters) as in reads of CHUNK, plain and zstd, and the
    reader's memory bounded by its reads and a block, not the file."""
    from corpus import readers
    from corpus.readers import CHUNK, Limits

    blocks = [f"block {i} \u00e9\r\n" + "words words words\n" * (i % 7) + "end" for i in range(40_000)]
    text = "\n\n".join(blocks) + "\n"
    plain = tmp_path / "blocks.txt"
    plain.write_bytes(text.encode())
    (tmp_path / "blocks.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    assert plain.stat().st_size > 2 * CHUNK
    limits = Limits(max_document_bytes=CHUNK)
    whole = block_rows(plain, limits)
    assert [r[3] for r in whole] == blocks and {r[4] for r in whole} == {""}
    assert [r[1:4] for r in whole] == blocks_of(text)
    tracemalloc.start()
    streamed = sum(1 for _ in read_text(str(plain), "s", "blocks.txt", split="blank_lines"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert streamed == len(blocks) and peak < 3 * CHUNK, peak  # the file is 2.9 MiB: held whole, 3 times that
    monkeypatch.setattr(readers, "CHUNK", 4093)
    assert block_rows(plain, limits) == whole
    assert [r[1:] for r in block_rows(tmp_path / "blocks.txt.zst", limits)] == [r[1:] for r in whole]


def test_a_bad_block_is_a_located_reject_and_the_blocks_after_it_still_arrive(tmp_path):
    """A block over max_document_bytes (its head only: never held whole), a block with invalid UTF-8, and a zstd
    file cut inside a block are each one reject with the block's line and byte offset; every other block is a
    document, so a file's rows are its blocks, documents + rejects."""
    from corpus.readers import CHUNK, HEAD_BYTES, Limits

    big = "x" * (3 * CHUNK)
    raw = b"first\n\n" + big.encode() + b"\n\nsecond\n\nbad \xff byte\n\nthird\n\nlast"
    path = tmp_path / "b.txt"
    path.write_bytes(raw)
    rows = list(read_text(str(path), "s", "b.txt", split="blank_lines", limits=Limits(max_document_bytes=CHUNK)))
    assert [(r["line"], r["offset"], r["reason"] or r["text"]) for r in rows] == [
        (1, 0, "first"),
        (3, 7, f"block over 1 MiB ({len(big):,} bytes): not read"),
        (5, 9 + len(big), "second"),
        (7, 17 + len(big), "invalid UTF-8: invalid start byte at byte 4"),
        (9, 29 + len(big), "third"),
        (11, 36 + len(big), "last")]
    assert rows[1]["head"] == "x" * HEAD_BYTES and rows[1]["id"] == "" and rows[3]["head"].startswith("bad ")
    assert [r["id"] for r in rows if not r["reason"]] == ["s/b.txt:1", "s/b.txt:5", "s/b.txt:9", "s/b.txt:11"]
    cctx = zstandard.ZstdCompressor()  # the cut frame's one compressed block: none of it can be decoded
    whole = cctx.compress(b"first\n\nsecond\n\nthi") + cctx.compress(b"rd " * 100 + b"\n\nlast")
    (tmp_path / "cut.txt.zst").write_bytes(whole[:-3])
    rows = list(read_text(str(tmp_path / "cut.txt.zst"), "s", "cut.txt.zst", split="blank_lines"))
    assert [(r["line"], r["offset"], r["reason"] or r["text"]) for r in rows] == [
        (1, 0, "first"), (3, 7, "second"), (5, 15, "truncated file: zstd stream ends inside a frame (file cut short?)")]
    assert rows[-1]["head"] == "thi"


HOSTILE = [
    (b'{"text": "a number too long to read", "n": ' + b"7" * 5000 + b"}",
     "unreadable JSON (ValueError: Exceeds the limit (4300 digits) for integer string conversion)"),
    (b'{"text": "nested", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     "unreadable JSON (RecursionError: maximum recursion depth exceeded while decoding a JSON array from a unicode string)"),
    (b'{"text": "caf\\u00e9 \\ud800 au lait"}', "a lone surrogate (U+D800) at character 5 of 'text': not UTF-8"),
    (b'{"text": "ok", "title": "\\udfff"}', "a lone surrogate (U+DFFF) at character 11 of 'meta': not UTF-8"),
    (b'{"text": "a pair is fine: \\ud83d\\ude00"}', None),
]


def test_a_hostile_record_is_a_located_reject_and_every_document_fits_arrow(tmp_path):
    """A 5,000-digit number, arrays nested 50,000 deep, and a lone surrogate in the text or in a field that goes
    to meta: each a reject with its reason and line, the lines around them documents, in jsonl, the Pile and
    PushShift alike; every row the readers yield is one Arrow can write (a lone surrogate failed at a part's
    flush, stopping ingest)."""
    import pyarrow as pa

    from corpus.parts import DOCUMENT_SCHEMA

    lines = [b'{"text": "first"}', *(line for line, _ in HOSTILE), b'{"text": "last"}']
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = list(read_jsonl(str(path), "web", "x.jsonl"))
    assert [r["reason"] or None for r in rows] == [None, *(why for _, why in HOSTILE), None]
    assert [r["line"] for r in rows] == list(range(1, len(lines) + 1))
    docs = [r for r in rows if not r["reason"]]
    assert [d["text"] for d in docs] == ["first", "a pair is fine: \U0001F600", "last"]
    pa.Table.from_pylist([{k: d[k] for k in DOCUMENT_SCHEMA.names} for d in docs], schema=DOCUMENT_SCHEMA)
    pa.Table.from_pylist([{"head": r["head"], "reason": r["reason"]} for r in rows])  # the rejects' rows, too
    pile = tmp_path / "p.jsonl"
    pile.write_bytes(b'{"text": "t", "meta": {"pile_set_name": "Pile-CC\\ud800"}}\n')
    (row,) = read_pile(str(pile), "pile", "p.jsonl")
    assert row["reason"] == "a lone surrogate (U+D800) at character 7 of 'subset': not UTF-8"
    (row,) = pushshift_rows(tmp_path, [b'{"id": "abc1", "parent_id": "t3_s1", "link_id": "t3_s1", '
                                       b'"created_utc": 1546300800, "body": "\\udc00"}'])
    assert row["reason"] == "a lone surrogate (U+DC00) at character 0 of 'body': not UTF-8"


def test_a_bomb_an_over_long_line_and_an_over_large_text_are_rejects_read_in_bounded_steps(tmp_path):
    """A 2 KB zstd file of 64 MiB of zeros is a reject once past the ratio; a line over max_line_bytes is a reject
    (its head only), the lines around it documents with their right offsets; a text file over
    max_document_bytes is a reject. Every step hands over at most CHUNK bytes."""
    from corpus import readers
    from corpus.readers import CHUNK, Limits, byte_chunks

    bomb = tmp_path / "bomb.jsonl.zst"
    bomb.write_bytes(zstandard.ZstdCompressor().compress(b"\0" * (64 << 20)))
    assert bomb.stat().st_size < 4096
    rows = list(read_jsonl(str(bomb), "web", "bomb.jsonl.zst"))
    assert len(rows) == 1 and rows[0]["reason"].startswith("decompresses beyond 1000 to 1 (")
    assert max(len(c) for c in byte_chunks(str(bomb), Limits(max_ratio=1e9))) <= CHUNK

    limits = Limits(max_line_bytes=3 * CHUNK)  # a line over three chunks: held no further
    long_line = b'{"text": "' + b"x" * (5 * CHUNK) + b'"}'
    lines = [b'{"text": "before"}', long_line, b'{"text": "after"}']
    for name, data in (("plain.jsonl", b"\n".join(lines) + b"\n"),
                       ("lines.jsonl.zst", zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))):
        (tmp_path / name).write_bytes(data)
        rows = list(read_jsonl(str(tmp_path / name), "web", name, limits=limits))
        assert [r["reason"] or r["text"] for r in rows] == [
            "before", f"line over 3 MiB ({len(long_line):,} bytes): not read", "after"], name
        assert [r["offset"] for r in rows] == [0, len(lines[0]) + 1, len(lines[0]) + len(long_line) + 2]
        assert rows[1]["head"].startswith('{"text": "xxx') and len(rows[1]["head"]) == readers.HEAD_BYTES

    book = tmp_path / "book.txt"
    book.write_bytes(b"word " * (CHUNK // 2))
    (row,) = read_text(str(book), "books", "book.txt", limits=Limits(max_document_bytes=CHUNK))
    assert row["reason"] == "text file over 1 MiB: not read (one document, held whole)"
    (row,) = read_text(str(book), "books", "book.txt")
    assert not row["reason"] and len(row["text"]) == 5 * (CHUNK // 2)


def test_the_frame_walker_knows_where_a_zstd_stream_may_end():
    """zstd's stream reader ends quietly at a cut; the frames' own layout says whether the last one ended, at
    every cut point of two frames (one with a checksum) and a skippable frame between them."""
    from corpus.readers import _FrameWalker

    first = zstandard.ZstdCompressor(write_checksum=True).compress(b"a" * 100_000 + bytes(range(256)) * 50)
    skippable = (0x184D2A50).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    second = zstandard.ZstdCompressor(write_content_size=False).compress(b"second frame\n" * 1000)
    stream = first + skippable + second
    ends = {0, len(first), len(first) + len(skippable), len(stream)}
    for cut in range(len(stream) + 1):
        walker = _FrameWalker()
        walker.feed(stream[:cut // 2])
        walker.feed(stream[cut // 2:cut])
        assert walker.complete == (cut in ends), cut


def test_a_file_name_that_is_not_utf8_is_data_and_its_rows_are_written(tmp_path):
    """A file name is bytes: one that is not UTF-8 came to Python with lone surrogates, into `id`, `meta` and
    `file`, and the Parquet write of its rows raised UnicodeEncodeError, which stopped the ingest task. Its bad
    bytes now read as escapes, in ids and rejects alike."""
    import os

    from corpus.ingest import REJECT_SCHEMA
    from corpus.parts import DOCUMENT_SCHEMA, Parts, iter_rows

    for name, data in ((b"caf\xe9.txt", b"a book"), (b"bad\xff.txt", b"\xff not UTF-8"), (b"n\xe9.jsonl", b'{"text": "hi"}\n')):
        Path(os.fsdecode(os.fsencode(tmp_path) + b"/" + name)).write_bytes(data)
    files = sorted(str(p) for p in tmp_path.iterdir())
    rel = relative_names(files)
    read = {".txt": lambda f: read_text(f, "books", rel[f]), ".jsonl": lambda f: read_jsonl(f, "misc", rel[f])}
    docs, rejects = Parts(tmp_path / "docs", "t", DOCUMENT_SCHEMA), Parts(tmp_path / "rejects", "t", REJECT_SCHEMA)
    for row in (r for f in files for r in read[Path(f).suffix](f)):
        parts = rejects if row["reason"] else docs
        parts.add({k: row[k] for k in parts.schema.names})
    assert (docs.close(), rejects.close()) == (2, 1)
    written = sorted(iter_rows(f"{tmp_path}/docs/t-0000.parquet"), key=lambda r: r["id"])
    assert [(r["id"], r["text"], json.loads(r["meta"])) for r in written] == [
        ("books/caf\\xe9.txt", "a book", {"file": "caf\\xe9.txt"}), ("misc/n\\xe9.jsonl:1", "hi", {})]
    (reject,) = iter_rows(f"{tmp_path}/rejects/t-0000.parquet")
    assert reject["file"] == f"{tmp_path}/bad\\xff.txt" and reject["reason"].startswith("invalid UTF-8")


def test_a_sources_zstd_window_log_reaches_its_ingest_task(sample, tmp_path):
    """`sources[].zstd_window_log` is what ingest's task reads with: a `jsonl` source of a `--long=31` dump is all
    rejects by default, and read whole with the setting at 31."""
    from corpus.config import IngestConfig, SourceConfig
    from corpus.ingest import limits_of, read_task, read_task_for

    out, planted = sample
    dump = sorted((out / "reddit").glob("RC_*.zst"))[0]
    documents = planted["files"][f"reddit/{dump.name}"]["documents"]
    for window_log, expected in ((None, 0), (31, documents)):
        source = SourceConfig(name="web", format="jsonl", paths=[str(dump)], text_field="body",
                              zstd_window_log=window_log)
        folders = {k: str(tmp_path / f"{window_log}-{k}") for k in ("output", "rejected", "subset_not_kept", "records")}
        task = read_task_for(source, [str(dump)], {str(dump): dump.name}, {str(dump): dump.stat().st_size}, "web-0",
                             folders, False, limits_of(IngestConfig(), source))
        counts = read_task(task)["counts"]
        assert counts.get("documents", 0) == expected, counts
        assert counts["rows_in"] == counts.get("documents", 0) + counts.get("rejected", 0), counts

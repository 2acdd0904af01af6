"""Readers for the raw formats: one generator per file, documents and rejects, nothing lost.

Every reader yields rows of one shape (ROW_FIELDS), a document or a reject, so that a file's
rows are counted in one place and `rows_in == documents + rejects` per file. A reject says where
(file, line, byte offset), why, and shows the first 200 bytes. The readable part of a cut file
is kept: its complete lines are read, and the cut itself is one reject.

Compressed input is streamed, never read whole: zstd with a window of up to 2 GiB (PushShift's
`zstd --long=31` dumps, which pyarrow refuses), gzip, or plain. python-zstandard's stream reader
ends quietly at a truncated frame, so frames are decoded with `decompressobj`, whose `eof`
says whether a frame really ended.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from typing import Iterator

import zstandard

from core.storage import open_input

ZSTD_MAX_WINDOW = 2**31  # PushShift dumps need the full 2 GiB window
CHUNK = 1 << 20
HEAD_BYTES = 200
# A UTF-16 surrogate alone: JSON's "\ud800" escape decodes to one (web and Reddit dumps have them), and UTF-8,
# so Arrow, cannot hold it. Such a record is rejected, not repaired: a replacement character would change the
# document's text (and its shingles) in a way no other reader of the dump sees, while ftfy's surrogate fix only
# rejoins pairs, which Python's JSON decoder already joins.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

ROW_FIELDS = ("id", "text", "source", "subset", "meta", "file", "line", "offset", "reason", "head")


class Truncated(Exception):
    """The compressed stream ended inside a frame, or the gzip stream before its end marker."""


def _zstd_chunks(path: str) -> Iterator[bytes]:
    dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    dobj, in_frame = dctx.decompressobj(), False
    with open_input(path) as fh:
        while chunk := fh.read(CHUNK):
            while chunk:
                in_frame = True
                yield dobj.decompress(chunk)
                if dobj.eof:  # a frame ended; what follows is the next frame (if anything)
                    chunk, dobj, in_frame = dobj.unused_data, dctx.decompressobj(), False
                else:
                    chunk = b""
    if in_frame:
        raise Truncated("zstd stream ends inside a frame (file cut short?)")


def _gzip_chunks(path: str) -> Iterator[bytes]:
    with open_input(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as fh:
        try:
            while chunk := fh.read1(CHUNK):  # read() would drop what it decoded before a cut
                yield chunk
        except EOFError as exc:
            raise Truncated(f"gzip stream ends early: {exc}") from None


def _plain_chunks(path: str) -> Iterator[bytes]:
    with open_input(path) as fh:
        while chunk := fh.read(CHUNK):
            yield chunk


# What a damaged file raises while it is streamed (gzip.BadGzipFile is an OSError).
STREAM_ERRORS = (Truncated, zstandard.ZstdError, zlib.error, OSError)


def stream_problem(exc: BaseException) -> str:
    """The reject reason for a file that could not be streamed to its end."""
    return f"{'truncated' if isinstance(exc, Truncated) else 'corrupt'} file: {exc}"


def byte_chunks(path: str) -> Iterator[bytes]:
    if path.endswith(".zst"):
        return _zstd_chunks(path)
    if path.endswith(".gz"):
        return _gzip_chunks(path)
    return _plain_chunks(path)


def read_lines(path: str) -> Iterator[tuple[int, int, bytes, str | None]]:
    """(line number, byte offset in the decompressed stream, line without newline, problem).

    `problem` is None for a complete line; the last row of a cut or corrupt file carries the
    reason (with whatever partial line was there).
    """
    buf, lineno, offset = b"", 0, 0
    try:
        for chunk in byte_chunks(path):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                lineno += 1
                yield lineno, offset, line, None
                offset += len(line) + 1
    except STREAM_ERRORS as exc:
        yield lineno + 1, offset, buf, stream_problem(exc)
        return
    if buf:  # a last line without a newline is still a line
        yield lineno + 1, offset, buf, None


def _reject(file: str, line: int, offset: int, reason: str, raw: bytes, source: str) -> dict:
    return {"id": "", "text": "", "source": source, "subset": "", "meta": "", "file": file, "line": line,
            "offset": offset, "reason": reason, "head": raw[:HEAD_BYTES].decode("utf-8", "replace")}


def _doc(doc_id: str, text: str, source: str, subset: str, meta: dict, file: str, line: int, offset: int) -> dict:
    return {"id": doc_id, "text": text, "source": source, "subset": subset,
            "meta": json.dumps(meta, ensure_ascii=False, sort_keys=True), "file": file, "line": line,
            "offset": offset, "reason": "", "head": ""}


def _records(path: str, source: str) -> Iterator[tuple[int, int, bytes, dict | None, dict | None]]:
    """JSON lines: (line, offset, raw, record, reject row)."""
    empty = True
    for lineno, offset, raw, problem in read_lines(path):
        if problem is not None:
            yield lineno, offset, raw, None, _reject(path, lineno, offset, problem, raw, source)
            continue
        empty = False
        if not raw.strip():
            yield lineno, offset, raw, None, _reject(path, lineno, offset, "empty line", raw, source)
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            yield lineno, offset, raw, None, _reject(path, lineno, offset, f"invalid UTF-8: {exc.reason} at byte {exc.start}", raw, source)
            continue
        except json.JSONDecodeError as exc:
            yield lineno, offset, raw, None, _reject(path, lineno, offset, f"malformed JSON: {exc.msg}", raw, source)
            continue
        except (ValueError, RecursionError) as exc:  # a number past Python's 4300 digits; arrays nested ~1000 deep
            why = str(exc).split(":")[0][:100]
            yield lineno, offset, raw, None, _reject(path, lineno, offset, f"unreadable JSON ({type(exc).__name__}: {why})",
                                                     raw, source)
            continue
        if not isinstance(record, dict):
            yield lineno, offset, raw, None, _reject(path, lineno, offset, f"a JSON {type(record).__name__}, not an object", raw, source)
            continue
        yield lineno, offset, raw, record, None
    if empty:
        yield 0, 0, b"", None, _reject(path, 0, 0, "empty file", b"", source)


def _checked(row: dict, path: str, lineno: int, offset: int, raw: bytes, source: str) -> dict:
    """`row`, or a reject when one of its strings holds a lone surrogate (LONE_SURROGATE: no UTF-8 for it)."""
    for key, value in row.items():
        found = LONE_SURROGATE.search(value) if isinstance(value, str) and not value.isascii() else None
        if found:
            return _reject(path, lineno, offset, f"a lone surrogate (U+{ord(found.group()):04X}) at "
                           f"character {found.start()} of '{key}': not UTF-8", raw, source)
    return row


def _text_of(record: dict, field: str) -> tuple[str | None, str | None]:
    if field not in record:
        return None, f"no '{field}' field"
    if not isinstance(record[field], str):
        return None, f"'{field}' is a {type(record[field]).__name__}, not a string"
    return record[field], None


def read_jsonl(path: str, source: str, rel: str, text_field: str = "text", id_field: str | None = None) -> Iterator[dict]:
    """Any corpus as JSON lines; `id_field` (when given) becomes the id unchanged."""
    for lineno, offset, raw, record, reject in _records(path, source):
        if reject:
            yield reject
            continue
        text, problem = _text_of(record, text_field)
        if problem is None and id_field is not None:
            if id_field not in record or not isinstance(record[id_field], (str, int)) or isinstance(record[id_field], bool):
                problem = f"no string or integer '{id_field}' field"
        if problem:
            yield _reject(path, lineno, offset, problem, raw, source)
            continue
        doc_id = str(record[id_field]) if id_field is not None else f"{source}/{rel}:{lineno}"
        meta = {k: v for k, v in record.items() if k not in (text_field, id_field)}
        yield _checked(_doc(doc_id, text, source, source, meta, path, lineno, offset), path, lineno, offset, raw, source)


def read_pile(path: str, source: str, rel: str) -> Iterator[dict]:
    """The Pile: `meta.pile_set_name` is the subset (which subsets are kept is decided later)."""
    for lineno, offset, raw, record, reject in _records(path, source):
        if reject:
            yield reject
            continue
        text, problem = _text_of(record, "text")
        meta = record.get("meta")
        if problem is None and (not isinstance(meta, dict) or not isinstance(meta.get("pile_set_name"), str)):
            problem = "no meta.pile_set_name"
        if problem:
            yield _reject(path, lineno, offset, problem, raw, source)
            continue
        yield _checked(_doc(f"{source}/{rel}:{lineno}", text, source, meta["pile_set_name"], meta, path, lineno, offset),
                       path, lineno, offset, raw, source)


def read_text(path: str, source: str, rel: str, split: str = "file") -> Iterator[dict]:
    """BookCorpus, CC-Stories: one document per file (or per blank-line block), bytes kept exactly.

    The file must be UTF-8: a Latin-1 book is rejected, not guessed at. With `split: blank_lines`
    each block between blank lines is a document (its id: the file and the block's first line).
    """
    data = bytearray()  # one document per file: the whole file is the document
    try:
        for chunk in byte_chunks(path):
            data += chunk
    except STREAM_ERRORS as exc:
        yield _reject(path, 0, len(data), stream_problem(exc), bytes(data), source)
        return
    data = bytes(data)
    if not data.strip():
        yield _reject(path, 0, 0, "empty file", data, source)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield _reject(path, 0, exc.start, f"invalid UTF-8: {exc.reason} at byte {exc.start}", data[exc.start:], source)
        return
    if split == "file":
        yield _doc(f"{source}/{rel}", text, source, source, {"file": rel}, path, 0, 0)
        return
    for line, offset, block in _blocks(text):
        yield _doc(f"{source}/{rel}:{line}", block, source, source, {"file": rel, "line": line}, path, line, offset)


_BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+|\n[^\S\n]*\Z")  # blank lines between blocks, or the file's end


def _blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """(first line, byte offset, block) for each block between blank lines; blank-only blocks are separators."""
    start = 0
    for match in [*_BLANK_LINES.finditer(text), None]:
        end = match.start() if match else len(text)
        block = text[start:end]
        if block.strip():
            yield text.count("\n", 0, start) + 1, len(text[:start].encode("utf-8")), block
        if match:
            start = match.end()


# --------------------------------------------------------------------------- PushShift Reddit

REDDIT_FIELDS = ("kind", "id", "link_id", "parent_id", "body", "created_utc", "subreddit", "title", "file", "line")
_BASE36 = re.compile(r"[0-9a-z]+")


def _utc(value: object) -> int | None:
    """created_utc: an integer, or (older dumps) an integer as a string or float."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _reddit_record(record: dict) -> tuple[dict | None, str | None]:
    """A comment (has `body`) or a submission (has `title`) as a REDDIT_FIELDS row, or why not."""
    rid = record.get("id")
    if not isinstance(rid, str) or not _BASE36.fullmatch(rid):
        return None, "no base-36 'id'"
    created = _utc(record.get("created_utc"))
    if created is None:
        return None, "no integer 'created_utc'"
    subreddit = record.get("subreddit") if isinstance(record.get("subreddit"), str) else ""
    if "body" in record or "parent_id" in record:
        body, link, parent = record.get("body"), record.get("link_id"), record.get("parent_id")
        if not isinstance(body, str):
            return None, "comment without a string 'body'"
        if not isinstance(link, str) or not link.startswith("t3_"):
            return None, "comment without a 't3_' 'link_id'"
        if not isinstance(parent, str) or not parent.startswith(("t1_", "t3_")):
            return None, "comment without a 't1_'/'t3_' 'parent_id'"
        return {"kind": "comment", "id": rid, "link_id": link, "parent_id": parent, "body": body,
                "created_utc": created, "subreddit": subreddit, "title": ""}, None
    if "title" in record:
        title, selftext = record.get("title"), record.get("selftext", "")
        if not isinstance(title, str) or not isinstance(selftext, str):
            return None, "submission without a string 'title' and 'selftext'"
        return {"kind": "submission", "id": rid, "link_id": f"t3_{rid}", "parent_id": "", "body": selftext,
                "created_utc": created, "subreddit": subreddit, "title": title}, None
    return None, "neither a comment ('body') nor a submission ('title')"


def read_pushshift(path: str, source: str, rel: str) -> Iterator[dict]:
    """RC_ comments and RS_ submissions: validated records (REDDIT_FIELDS), grouped into threads later."""
    for lineno, offset, raw, record, reject in _records(path, source):
        if reject:
            yield reject
            continue
        row, problem = _reddit_record(record)
        if problem:
            yield _reject(path, lineno, offset, problem, raw, source)
            continue
        row.update(file=path, line=lineno)
        yield _checked(row, path, lineno, offset, raw, source)


READERS = {"jsonl": read_jsonl, "pile": read_pile, "text": read_text, "pushshift": read_pushshift}


def relative_names(files: list[str]) -> dict[str, str]:
    """Each file's path below the source's common folder: the stable part of a document id
    (the same for a folder read as a path, a file:// URI or from a bucket with the same layout)."""
    if not files:
        return {}
    paths = {f: f.split("://", 1)[-1] for f in files}
    root = os.path.commonpath([os.path.dirname(p) for p in paths.values()])
    return {f: os.path.relpath(p, root) for f, p in paths.items()}

"""Readers for the raw formats: one generator per file, documents and rejects, nothing lost.

Every reader yields rows of one shape (ROW_FIELDS), a document or a reject, so that a file's
rows are counted in one place and `rows_in == documents + rejects` per file. A reject says where
(file, line, byte offset), why, and shows the first 200 bytes. The readable part of a cut file
is kept: its complete lines are read, and the cut itself is one reject.

Compressed input is streamed, never read whole, and in bounded steps: zstd, gzip, or plain. zstd's window (the
memory its decoder holds) is capped per source: 2 GiB only for PushShift's `zstd --long=31` dumps (which
pyarrow refuses), 128 MiB for the others (`Limits.zstd_window_log`). Each step gives at most CHUNK bytes, however
much they decompress to: python-zstandard's `decompressobj` would hand a 2 KB zstd bomb's 64 MiB over in one
piece, so zstd is read with its stream reader, which ends quietly at a truncated frame; the frames' own headers
and block sizes, walked beside it (`_FrameWalker`), say whether the last one really ended.
`Limits` bound the rest: a file that decompresses beyond `max_ratio` to 1 (judged over its recent output, not
the whole file: `_Ratio`) is a reject (a bomb), a line over
`max_line_bytes` is a reject and is never held whole (nor re-split as it grows), and so is a text file over
`max_document_bytes` when the file is one document; a text file split at blank lines is streamed, and only a
block over `max_document_bytes` is a reject (never held whole either).
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, replace
from typing import Iterator

import zstandard

from core.storage import open_input, printable

# zstd's window limits, as log2 bytes: libzstd's own default (ZSTD_WINDOWLOG_LIMIT_DEFAULT, 128 MiB: what `zstd -d`
# decodes without --long or --memory), and PushShift's, whose dumps are written with `zstd --long=31` (2 GiB).
ZSTD_WINDOW_LOG, PUSHSHIFT_WINDOW_LOG = 27, 31
CHUNK = 1 << 20
# The compressed bytes handed to a decoder at once: zstd's own input step (ZSTD_DStreamInSize, 128 KiB and a block
# header), and at least gzip's reads. The file itself is read CHUNK at a time (one request per CHUNK from a bucket).
READ = zstandard.DECOMPRESSION_RECOMMENDED_INPUT_SIZE
RATIO_FLOOR = 16 << 20  # decompressed bytes allowed before the ratio applies: a small file's headers are no bomb


@dataclass(frozen=True)
class Limits:
    """What one reader holds at most (IngestConfig's max_line_mb, max_document_mb and max_ratio)."""

    max_line_bytes: int = 64 << 20
    max_document_bytes: int = 256 << 20
    max_ratio: float = 1000.0  # decompressed bytes per compressed byte: text is 3-10, a bomb 1000s
    zstd_window_log: int | None = None  # the source's (SourceConfig.zstd_window_log); None: its format's default


LIMITS = Limits()
HEAD_BYTES = 200
# A UTF-16 surrogate alone: JSON's "\ud800" escape decodes to one (web and Reddit dumps have them), and UTF-8,
# so Arrow, cannot hold it. Such a record is rejected, not repaired: a replacement character would change the
# document's text (and its shingles) in a way no other reader of the dump sees, while ftfy's surrogate fix only
# rejoins pairs, which Python's JSON decoder already joins.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

ROW_FIELDS = ("id", "text", "source", "subset", "meta", "file", "line", "offset", "reason", "head")


class Truncated(Exception):
    """The compressed stream ended inside a frame, or the gzip stream before its end marker."""


class TooLarge(Exception):
    """A file past a Limits bound (a decompression bomb, a zstd window over the limit); str() is the reject's reason."""


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _FrameWalker:
    """zstd's frame layout followed over the compressed bytes, without decoding them: a frame's magic number and
    header, then blocks, each a 3-byte header giving its size and whether it is the last, then an optional
    4-byte checksum; skippable frames skipped (RFC 8878, 3.1). `complete` says whether the bytes seen so far
    end where a frame ends."""

    def __init__(self):
        self.state, self.buf, self.skip, self.checksum = "magic", bytearray(), 0, False
        self.known = True  # False once the bytes are not zstd's: the decoder reports that itself

    @property
    def complete(self) -> bool:
        return not self.known or (self.state == "magic" and not self.buf and not self.skip)

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while self.known and i < n:
            if self.skip:
                take = min(self.skip, n - i)
                self.skip, i = self.skip - take, i + take
                continue
            need = {"magic": 4, "descriptor": 1, "block": 3, "skippable": 4}[self.state]
            take = min(need - len(self.buf), n - i)
            self.buf += data[i:i + take]
            i += take
            if len(self.buf) == need:
                self._parse(bytes(self.buf))
                self.buf.clear()

    def _parse(self, field: bytes) -> None:
        if self.state == "magic":
            if field == ZSTD_MAGIC:
                self.state = "descriptor"
            elif field[1:] == b"\x2a\x4d\x18" and field[0] & 0xF0 == 0x50:
                self.state = "skippable"
            else:
                self.known = False
        elif self.state == "descriptor":
            d = field[0]
            single = (d >> 5) & 1
            self.checksum = bool((d >> 2) & 1)
            self.skip = (0 if single else 1) + (0, 1, 2, 4)[d & 3] + (single, 2, 4, 8)[d >> 6]
            self.state = "block"
        elif self.state == "block":
            v = int.from_bytes(field, "little")
            last, kind, size = v & 1, (v >> 1) & 3, v >> 3
            self.skip = 1 if kind == 1 else size  # an RLE block holds one byte
            if last:
                self.skip += 4 if self.checksum else 0
                self.state = "magic"
        else:  # a skippable frame's size
            self.skip, self.state = int.from_bytes(field, "little"), "magic"


class _Counted:
    """A file's bytes as the decoder reads them: read from the file CHUNK at a time, handed over at most READ at a
    time, counted (what the ratio is judged on, to within READ) and shown to a _FrameWalker on the way."""

    def __init__(self, fh, walker: _FrameWalker):
        self.fh, self.walker, self.bytes = fh, walker, 0
        self.buffer, self.at = b"", 0

    def read(self, size: int) -> bytes:
        if self.at == len(self.buffer):
            self.buffer, self.at = self.fh.read(CHUNK), 0
        data = self.buffer[self.at:self.at + min(size, READ)]
        self.at += len(data)
        self.bytes += len(data)
        self.walker.feed(data)
        return data


class _Ratio:
    """The decompression-ratio guard, judged over the recent output rather than the whole file: each compressed
    byte read pays for `max_ratio` bytes of output, RATIO_FLOOR bytes come free at the start, and no more than
    `window` bytes are ever paid for ahead (the output of one READ at `max_ratio`). Judged over the whole file, an
    incompressible prefix of N MB would buy `max_ratio` x N MB of output for a bomb after it; here, `window`."""

    def __init__(self, limits: Limits):
        self.max_ratio = limits.max_ratio
        self.window = max(RATIO_FLOOR, int(limits.max_ratio * READ))
        self.allowance, self.produced, self.consumed = RATIO_FLOOR, 0, 0

    def check(self, produced: int, consumed: int) -> None:
        """`produced` bytes of output so far from `consumed` bytes read; TooLarge once the output overdraws."""
        paid = self.max_ratio * (consumed - self.consumed)
        self.allowance = min(self.allowance + paid, self.window) - (produced - self.produced)
        self.produced, self.consumed = produced, consumed
        if self.allowance < 0:
            raise TooLarge(f"decompresses beyond {self.max_ratio:g} to 1 ({produced >> 20} MiB from {consumed:,} bytes "
                           f"read, judged over at most its last {self.window >> 20} MiB): a decompression bomb, not read "
                           "further")


def _zstd_chunks(path: str, limits: Limits, window_log: int) -> Iterator[bytes]:
    walker, produced, ratio = _FrameWalker(), 0, _Ratio(limits)
    with open_input(path) as fh:
        source = _Counted(fh, walker)
        reader = zstandard.ZstdDecompressor(max_window_size=1 << window_log).stream_reader(
            source, read_size=READ, read_across_frames=True, closefd=False)
        try:
            while chunk := reader.read(CHUNK):
                produced += len(chunk)
                ratio.check(produced, source.bytes)
                yield chunk
        except zstandard.ZstdError as exc:
            if "too much memory" not in str(exc):  # libzstd's frameParameter_windowTooLarge
                raise
            raise TooLarge(f"a zstd frame needs a window over 2^{window_log} bytes (zstd_window_log {window_log}): "
                           f"not read; raise the source's zstd_window_log (at most {PUSHSHIFT_WINDOW_LOG}) if its "
                           "dumps were written with zstd --long") from None
    if not walker.complete:
        raise Truncated("zstd stream ends inside a frame (file cut short?)")


def _gzip_chunks(path: str, limits: Limits) -> Iterator[bytes]:
    with open_input(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as fh:
        produced, ratio = 0, _Ratio(limits)
        try:
            while chunk := fh.read1(CHUNK):  # read() would drop what it decoded before a cut
                produced += len(chunk)
                ratio.check(produced, raw.tell())
                yield chunk
        except EOFError as exc:
            raise Truncated(f"gzip stream ends early: {exc}") from None


def _plain_chunks(path: str) -> Iterator[bytes]:
    with open_input(path) as fh:
        while chunk := fh.read(CHUNK):
            yield chunk


# What a damaged or hostile file raises while it is streamed (gzip.BadGzipFile is an OSError).
STREAM_ERRORS = (Truncated, TooLarge, zstandard.ZstdError, zlib.error, OSError)


def stream_problem(exc: BaseException) -> str:
    """The reject reason for a file that could not be streamed to its end."""
    if isinstance(exc, TooLarge):
        return str(exc)
    return f"{'truncated' if isinstance(exc, Truncated) else 'corrupt'} file: {exc}"


def byte_chunks(path: str, limits: Limits = LIMITS) -> Iterator[bytes]:
    """A file's bytes, decompressed, in pieces of at most CHUNK."""
    if path.endswith(".zst"):
        return _zstd_chunks(path, limits, limits.zstd_window_log or ZSTD_WINDOW_LOG)
    if path.endswith(".gz"):
        return _gzip_chunks(path, limits)
    return _plain_chunks(path)


def read_lines(path: str, limits: Limits = LIMITS) -> Iterator[tuple[int, int, bytes, str | None]]:
    """(line number, byte offset in the decompressed stream, line without newline, problem).

    `problem` is None for a complete line; a line over `limits.max_line_bytes` has one (and only its first
    HEAD_BYTES: it is never held whole); the last row of a cut, corrupt or over-large file carries the reason
    (with whatever partial line was there). Each chunk is split once: a line growing over many chunks is
    joined once, at its end, not re-split at every chunk.
    """
    pending: list[bytes] = []  # the current line's pieces so far
    held, skipped, lineno, offset, head = 0, -1, 0, 0, b""  # skipped >= 0: an over-long line's bytes passed so far

    def too_long(length: int) -> str:
        return f"line over {limits.max_line_bytes >> 20} MiB ({length:,} bytes): not read"

    try:
        for chunk in byte_chunks(path, limits):
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                lineno += 1
                if skipped >= 0:
                    length = skipped + end - start
                    yield lineno, offset, head, too_long(length)
                    skipped = -1
                else:
                    line = b"".join([*pending, chunk[start:end]]) if pending else chunk[start:end]
                    length = len(line)
                    if length > limits.max_line_bytes:
                        yield lineno, offset, line[:HEAD_BYTES], too_long(length)
                    else:
                        yield lineno, offset, line, None
                pending, held = [], 0
                offset += length + 1
                start = end + 1
            rest = chunk[start:]
            if skipped >= 0:
                skipped += len(rest)
            elif rest:
                pending.append(rest)
                held += len(rest)
                if held > limits.max_line_bytes:  # stop holding it: its head, then its length only
                    head, skipped, pending = b"".join(pending)[:HEAD_BYTES], held, []
    except STREAM_ERRORS as exc:
        yield lineno + 1, offset, head if skipped >= 0 else b"".join(pending), stream_problem(exc)
        return
    if skipped >= 0:
        yield lineno + 1, offset, head, too_long(skipped)
    elif pending:  # a last line without a newline is still a line
        yield lineno + 1, offset, b"".join(pending), None


def _reject(file: str, line: int, offset: int, reason: str, raw: bytes, source: str) -> dict:
    return {"id": "", "text": "", "source": source, "subset": "", "meta": "", "file": printable(file), "line": line,
            "offset": offset, "reason": reason, "head": raw[:HEAD_BYTES].decode("utf-8", "replace")}


def _doc(doc_id: str, text: str, source: str, subset: str, meta: dict, file: str, line: int, offset: int) -> dict:
    return {"id": doc_id, "text": text, "source": source, "subset": subset,
            "meta": json.dumps(meta, ensure_ascii=False, sort_keys=True), "file": printable(file), "line": line,
            "offset": offset, "reason": "", "head": ""}


def _records(path: str, source: str, limits: Limits) -> Iterator[tuple[int, int, bytes, dict | None, dict | None]]:
    """JSON lines: (line, offset, raw, record, reject row)."""
    empty = True
    for lineno, offset, raw, problem in read_lines(path, limits):
        if problem is not None:
            empty = empty and not raw.strip()  # an over-long or cut line: the file is not empty
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


def read_jsonl(path: str, source: str, rel: str, text_field: str = "text", id_field: str | None = None,
               limits: Limits = LIMITS) -> Iterator[dict]:
    """Any corpus as JSON lines; `id_field` (when given) becomes the id unchanged."""
    for lineno, offset, raw, record, reject in _records(path, source, limits):
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


def read_pile(path: str, source: str, rel: str, limits: Limits = LIMITS) -> Iterator[dict]:
    """The Pile: `meta.pile_set_name` is the subset (which subsets are kept is decided later)."""
    for lineno, offset, raw, record, reject in _records(path, source, limits):
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


def read_text(path: str, source: str, rel: str, split: str = "file", limits: Limits = LIMITS) -> Iterator[dict]:
    """BookCorpus, CC-Stories: one document per file (or per blank-line block), bytes kept exactly.

    The file must be UTF-8: a Latin-1 book is rejected, not guessed at. With `split: blank_lines`
    each block between blank lines is a document (its id: the file and the block's first line),
    and the file is streamed: a block is held, never the file (_BlockSplitter).
    """
    if split == "file":
        return _whole_file(path, source, rel, limits)
    return _block_rows(path, source, rel, limits)


def _whole_file(path: str, source: str, rel: str, limits: Limits) -> Iterator[dict]:
    """The file as one document: held whole, so a file over max_document_bytes is a reject."""
    data = bytearray()
    try:
        for chunk in byte_chunks(path, limits):
            data += chunk
            if len(data) > limits.max_document_bytes:
                yield _reject(path, 0, 0, f"text file over {limits.max_document_bytes >> 20} MiB: not read (one "
                              "document, held whole)", bytes(data[:HEAD_BYTES]), source)
                return
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
    yield _doc(f"{source}/{rel}", text, source, source, {"file": rel}, path, 0, 0)


def _block_rows(path: str, source: str, rel: str, limits: Limits) -> Iterator[dict]:
    """Each block a document, or a reject at its line and byte offset (over max_document_bytes, invalid UTF-8, cut
    short), so one bad block costs only itself; a file with no block is an empty file."""
    empty = True
    for line, offset, raw, problem in _blocks(path, limits):
        if problem is None:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                problem = f"invalid UTF-8: {exc.reason} at byte {exc.start}"
        if problem is not None:
            yield _reject(path, line, offset, problem, raw, source)
        elif text.strip():  # a blank block can only be the file's first line, alone
            yield _doc(f"{source}/{rel}:{line}", text, source, source, {"file": rel, "line": line}, path, line, offset)
        else:
            continue
        empty = False
    if empty:
        yield _reject(path, 0, 0, "empty file", b"", source)


def _blocks(path: str, limits: Limits) -> Iterator[tuple[int, int, bytes, str | None]]:
    """(first line, byte offset, block, problem) for each block of a text file, read in steps of CHUNK; a block
    cut short by a damaged stream is one reject with the reason."""
    splitter = _BlockSplitter(limits.max_document_bytes)
    try:
        for chunk in byte_chunks(path, limits):
            yield from splitter.feed(chunk)
    except STREAM_ERRORS as exc:
        yield splitter.cut(stream_problem(exc))
        return
    yield from splitter.end()


class _Held:
    """Bytes gathered in pieces, up to `limit`: past it only their first HEAD_BYTES are kept, and their count."""

    def __init__(self, limit: int):
        self.limit, self.pieces, self.size, self.head = limit, [], 0, None

    def add(self, piece: bytes, size: int | None = None) -> None:
        """`piece`; `size` when it stands for more bytes than it holds (the head of a longer line)."""
        self.size += len(piece) if size is None else size
        if self.head is None:
            self.pieces.append(piece)
            if self.size > self.limit:
                self.head, self.pieces = b"".join(self.pieces)[:HEAD_BYTES], []

    @property
    def data(self) -> bytes:
        return b"".join(self.pieces) if self.head is None else self.head


class _BlockSplitter:
    """A text file's blank-line blocks, fed its bytes in pieces; holds the block being read and the line being
    read (each up to `cap`, then their head and length only), never the file.

    The blocks are those of splitting the whole decoded text at runs of blank lines (whitespace only, as
    str.isspace has it, so \\r and U+3000 too): a block is its first line and the lines after it up to a blank one,
    without the newline that ends it; the blank lines after it are skipped, and the next line that is not blank
    begins the next block. Only the file's first line begins a block even when blank. A line's blankness is
    decided as its bytes arrive, so a character split between two reads is decoded whole.
    """

    def __init__(self, cap: int):
        self.cap = cap
        self.lineno, self.offset = 1, 0  # the line being read
        self.start: tuple[int, int] | None = (1, 0)  # the block being read: its first line and offset; None between
        self.block, self.lines = _Held(cap), 0
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self._new_line()

    def _new_line(self) -> None:
        self.line, self.blank = _Held(self.cap), True
        self.decoder.reset()

    def _add(self, piece: bytes) -> None:
        self.line.add(piece)
        if self.blank:
            try:
                self.blank = not self.decoder.decode(piece).strip()
            except UnicodeDecodeError:
                self.blank = False

    def feed(self, chunk: bytes) -> Iterator[tuple[int, int, bytes, str | None]]:
        """The blocks that end in `chunk`."""
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:end])
            if (done := self._end_line()) is not None:
                yield done
            start = end + 1
        if start < len(chunk):
            self._add(chunk[start:])

    def end(self) -> Iterator[tuple[int, int, bytes, str | None]]:
        """The last line (a file need not end with a newline), then the block it is in."""
        if (done := self._end_line()) is not None:
            yield done
        if self.start is not None:
            yield self._finish()

    def cut(self, reason: str) -> tuple[int, int, bytes, str]:
        """The reject for a stream that broke: at the block being read, or at the line between blocks."""
        line, offset = self.start or (self.lineno, self.offset)
        return line, offset, self.block.data if self.lines else self.line.data, reason

    def _end_line(self) -> tuple[int, int, bytes, str | None] | None:
        """The line joins the block, begins one or ends one (returned); a blank line between blocks is dropped."""
        if self.blank:
            try:
                self.decoder.decode(b"", final=True)
            except UnicodeDecodeError:  # a character cut at the line's end
                self.blank = False
        done = None
        if self.start is None and not self.blank:
            self.start = self.lineno, self.offset
        if self.start is not None and (self.lines == 0 or not self.blank):
            self._join()
        elif self.start is not None:
            done = self._finish()
        self.lineno, self.offset = self.lineno + 1, self.offset + self.line.size + 1
        self._new_line()
        return done

    def _join(self) -> None:
        """The line into the block, after a newline when the block has lines already."""
        if self.lines:
            self.block.add(b"\n")
        if self.line.head is None:
            for piece in self.line.pieces:
                self.block.add(piece)
        else:
            self.block.add(self.line.head, self.line.size)
        self.lines += 1

    def _finish(self) -> tuple[int, int, bytes, str | None]:
        (line, offset), block = self.start, self.block
        self.start, self.block, self.lines = None, _Held(self.cap), 0
        problem = None if block.head is None else f"block over {self.cap >> 20} MiB ({block.size:,} bytes): not read"
        return line, offset, block.data, problem


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


def read_pushshift(path: str, source: str, rel: str, limits: Limits = LIMITS) -> Iterator[dict]:
    """RC_ comments and RS_ submissions: validated records (REDDIT_FIELDS), grouped into threads later. Their
    zstd window may be PushShift's 2 GiB unless the source says otherwise."""
    if limits.zstd_window_log is None:
        limits = replace(limits, zstd_window_log=PUSHSHIFT_WINDOW_LOG)
    for lineno, offset, raw, record, reject in _records(path, source, limits):
        if reject:
            yield reject
            continue
        row, problem = _reddit_record(record)
        if problem:
            yield _reject(path, lineno, offset, problem, raw, source)
            continue
        row.update(file=printable(path), line=lineno)
        yield _checked(row, path, lineno, offset, raw, source)


READERS = {"jsonl": read_jsonl, "pile": read_pile, "text": read_text, "pushshift": read_pushshift}


def relative_names(files: list[str]) -> dict[str, str]:
    """Each file's path below the source's common folder: the stable part of a document id
    (the same for a folder read as a path, a file:// URI or from a bucket with the same layout), as
    `printable` text (a name that is not UTF-8 shows its bytes as escapes)."""
    if not files:
        return {}
    paths = {f: f.split("://", 1)[-1] for f in files}
    root = os.path.commonpath([os.path.dirname(p) for p in paths.values()])
    return {f: printable(os.path.relpath(p, root)) for f, p in paths.items()}

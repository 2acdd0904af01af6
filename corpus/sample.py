"""A small, deterministic sample corpus in the real on-disk formats of every OPT source.

    python -m corpus.sample OUT [--seed N] [--spiky-subset NAME[:N] ...]

Nothing is downloaded: the text is generated from a fixed vocabulary with a seeded RNG, so
the same seed gives the same bytes on every machine. The layout and formats are the real ones:

    OUT/pile/*.jsonl.zst        {"text": ..., "meta": {"pile_set_name": ...}}, all 22 subsets
    OUT/reddit/RC_YYYY-MM.zst   PushShift comment NDJSON, zstd with a 2 GiB window (--long=31)
    OUT/reddit/RS_YYYY-MM.zst   PushShift submission NDJSON, same compression
    OUT/bookcorpus/*.txt        one book per file, "Chapter One" headings
    OUT/stories/*.txt           one CC-Stories document per file
    OUT/ccnews/*.jsonl          {"id", "title", "text", "url", "date"}
    OUT/PLANTED.json            every defect planted, where it is, what it is

Defects a real dump has, planted on purpose and listed in PLANTED.json so that later stages'
tests can check their counts against it: exact and near duplicates across sources (with their
true word-5-gram Jaccard), messy whitespace, mojibake and HTML entities, Gutenberg licence
boilerplate, malformed JSON lines, a document that is not UTF-8, and a truncated .zst file.
Reddit threads span two monthly files, as real threads do.

`--spiky-subset NAME` plants a subset built to destabilise training (the screen's honest check):
one in six of the Pile subset NAME's documents carries a long run of one rare character, a
different one per document (a thousand and more identical rare tokens: every position pushes
the same embedding row, so a batch that holds some has a grad norm far above its neighbours').
`NAME:N` plants one in N instead (a weaker subset); the option repeats, so that one corpus can
hold several planted subsets at different strengths (the screen's power benchmark does).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import tempfile
import zlib
from pathlib import Path

import zstandard

from corpus.config import OPT_PILE_SUBSETS

# The Pile's 22 subsets, by their `meta.pile_set_name`; OPT kept the first 8.
PILE_SUBSETS_KEPT_BY_OPT = OPT_PILE_SUBSETS
PILE_SUBSETS_DROPPED_BY_OPT = [
    "ArXiv", "BookCorpus2", "Books3", "Enron Emails", "EuroParl", "FreeLaw", "Github",
    "NIH ExPorter", "PhilPapers", "PubMed Abstracts", "PubMed Central", "StackExchange",
    "Ubuntu IRC", "YoutubeSubtitles",
]
PILE_SUBSETS = PILE_SUBSETS_KEPT_BY_OPT + PILE_SUBSETS_DROPPED_BY_OPT

WORDS = """the of and to in a is that for it as was with be by on not he this are or his from at
which but have an they one you were her all she there would their we him been has when who will
more no if out so said what up its about into than them can only other new some could time these
two may then do first any my now such like our over man me even most made after also did many
before must through back years where much your way well down should because each just those
people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come
since against go came right used take three states himself few house use during without again
place american around however home small found thought went say part once general high upon
school every does got united left number course war until always away something fact though
water less public put think almost hand enough far took head yet government system better set
told nothing night end why called didn't eyes find going look asked later knew point next
program city business give group toward young days let room president side social given present
several order national possible rather second face per among form important often things looking
early white case john become large big need four within felt children along saw best church ever
least power development light thing seemed family interest want members mind country area others
done turned although open god service problem certain kind different thus began door help sense
whole matter perhaps itself york times law human line above name example action company hands
local show whether five history gave today either act feet across taken past quite anything having
seen death experience body word half really field car words already themselves information tell
together college shall money period held keep sure probably free seems political real behind
question air office making brought whose special major heard problems ago became federal study
available known result street economic boy position reason change south board individual job
society areas west close turn love community true court force full seem am age policy wife
music river theory data market model training language corpus token gradient""".split()

REDDIT_MONTHS = ["2019-01", "2019-02"]
PUSHSHIFT_WINDOW_LOG = 31  # the dumps are written with `zstd --long=31`: a 2 GiB window


def _rng(seed: int, *names: object) -> random.Random:
    """An RNG per (seed, purpose): independent streams, stable across Python versions."""
    return random.Random(zlib.crc32(repr((seed,) + names).encode()))


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....?!")


def paragraph(rng: random.Random, sentences: tuple[int, int] = (3, 7)) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(*sentences)))


def prose(rng: random.Random, paragraphs: tuple[int, int] = (2, 6)) -> str:
    return "\n\n".join(paragraph(rng) for _ in range(rng.randint(*paragraphs)))


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Lowercased word n-grams: how PLANTED.json measures the Jaccard of its duplicate pairs."""
    words = text.lower().split()
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def mutate(rng: random.Random, text: str, changes: int) -> str:
    """Replace `changes` words, evenly spaced, each by a different word."""
    words = text.split(" ")
    step = len(words) / (changes + 1)
    for k in range(1, changes + 1):
        i = int(k * step)
        words[i] = rng.choice([w for w in WORDS if w != words[i].lower().strip(".?!")])
    return " ".join(words)


def mutate_to_below(rng: random.Random, text: str, threshold: float) -> str:
    """The fewest changes that bring the Jaccard just under `threshold`: a hard negative."""
    changes = 1
    while jaccard(text, candidate := mutate(rng, text, changes)) >= threshold:
        changes += 1
    return candidate


# --------------------------------------------------------------------------- per-subset text


def pile_text(rng: random.Random, subset: str, i: int) -> str:
    if subset == "DM Mathematics":
        lines = []
        for _ in range(rng.randint(5, 12)):
            a, b = rng.randint(-99, 99), rng.randint(-99, 99)
            lines.append(f"What is {a} + {b}?\n{a + b}")
        return "\n".join(lines) + "\n"
    if subset == "Github":
        name = rng.choice(WORDS)
        return (
            f"def {name}_{i}(x, y):\n    \"\"\"{sentence(rng)}\"\"\"\n    path = \"C:\\\\data\\\\{name}\"\n"
            f"    return x * {rng.randint(2, 9)} + y  # {sentence(rng)}\n"
        )
    if subset == "Enron Emails":
        return f"From: {rng.choice(WORDS)}@enron.com\nSubject: {sentence(rng)}\n\n{prose(rng, (1, 3))}\n"
    if subset == "Gutenberg (PG-19)":
        title = " ".join(rng.choice(WORDS) for _ in range(3)).title()
        return (
            f"The Project Gutenberg EBook of {title}\n\n"
            "This eBook is for the use of anyone anywhere at no cost and with almost no restrictions "
            "whatsoever.\n\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n"
            f"CHAPTER I\n\n{prose(rng, (3, 6))}\n\n"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n"
        )
    if subset == "HackerNews":
        return "\n\n".join(f"{rng.choice(WORDS)}{rng.randint(1, 99)}: {paragraph(rng, (1, 3))}" for _ in range(rng.randint(2, 5)))
    return prose(rng)


SPIKY_EVERY = 6  # one in this many of the spiky subset's documents is spiky
SPIKY_RUN = 1500  # characters in a spiky document's run


def spiky_text(rng: random.Random, text: str) -> str:
    """`text` with a run of one rare character (a CJK ideograph) in the middle, space-separated so
    that a BPE cannot merge the run into a few long tokens: SPIKY_RUN identical rare tokens."""
    cut = text.find(". ") + 2
    return text[:cut] + " ".join([chr(rng.randint(0x4E00, 0x9FFF))] * SPIKY_RUN) + " " + text[cut:]


def messy(rng: random.Random, text: str, kind: str) -> str:
    """Damage real dumps have: what normalize must repair without touching anything else."""
    if kind == "whitespace":
        return "  " + text.replace(". ", ".   ").replace("\n\n", " \n\t\n\n\n") + " \u00a0 \n\n"
    if kind == "mojibake":  # UTF-8 read as cp1252, and HTML entities, after the first sentence
        cut = text.find(". ") + 2
        return text[:cut] + "The caf\u00c3\u00a9 don\u00e2\u20ac\u2122t close &amp; the &quot;bar&quot; opens. " + text[cut:]
    if kind == "crlf":
        return text.replace("\n", "\r\n")
    raise ValueError(kind)


# --------------------------------------------------------------------------- writers


def write_zst_lines(path: Path, lines: list[bytes], window_log: int | None = None) -> None:
    """NDJSON compressed with zstd; `window_log=31` writes PushShift's 2 GiB-window frames."""
    if window_log is None:
        params = zstandard.ZstdCompressionParameters.from_level(3)
    else:
        params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log, enable_ldm=True)
    with open(path, "wb") as fh:
        with zstandard.ZstdCompressor(compression_params=params).stream_writer(fh) as w:
            for line in lines:
                w.write(line + b"\n")


def _json_line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


class _Planted:
    def __init__(self, seed: int):
        self.data: dict = {"seed": seed, "files": {}, "malformed": [], "truncated_files": [],
                           "invalid_utf8_files": [], "duplicates": [], "messy": [], "reddit": {}}

    def file(self, rel: str, documents: int, lines: int | None = None) -> None:
        self.data["files"][rel] = {"documents": documents, **({"lines": lines} if lines is not None else {})}

    def malformed(self, rel: str, line: int, defect: str) -> None:
        self.data["malformed"].append({"file": rel, "line": line, "defect": defect})


MALFORMED_JSONL = [
    (b'{"text": "a line cut off in the middle of', "truncated JSON"),
    (b"this line is not JSON at all", "not JSON"),
    (b'{"meta": {"pile_set_name": "Pile-CC"}}', "no text field"),
    (b'{"text": 12345, "meta": {"pile_set_name": "Pile-CC"}}', "text is not a string"),
    (b'{"text": "bad bytes \xff\xfe in the middle", "meta": {"pile_set_name": "Pile-CC"}}', "invalid UTF-8"),
    (b"", "empty line"),
]


def _pile(out: Path, seed: int, planted: _Planted, shared: dict, spiky: dict[str, int]) -> None:
    (out / "pile").mkdir()
    docs: list[dict] = []
    for subset in PILE_SUBSETS:
        for i in range(40 if subset in PILE_SUBSETS_KEPT_BY_OPT else 15):
            text = pile_text(_rng(seed, "pile", subset, i), subset, i)
            if subset in spiky and i % spiky[subset] == 1:
                text = spiky_text(_rng(seed, "spiky", i), text)
                shared["spiky"].append(text)
            docs.append({"text": text, "meta": {"pile_set_name": subset}})
    # Text that breaks naive re-encoding: backslashes, quotes, JSON escapes, emoji, CJK, U+2028.
    docs.append({"text": 'Path C:\\new\\table, a "quoted" \\u0041 that is not an escape, \U0001f600 \u4e2d\u6587\u2028end\n',
                 "meta": {"pile_set_name": "Pile-CC"}})
    _rng(seed, "pile-order").shuffle(docs)
    base = shared["base"]
    docs[3] = {"text": base, "meta": {"pile_set_name": "Pile-CC"}}  # reappears in ccnews (exact)
    docs[5] = {"text": messy(_rng(seed, "m1"), docs[5]["text"], "whitespace"), "meta": docs[5]["meta"]}
    docs[7] = {"text": messy(_rng(seed, "m2"), docs[7]["text"], "mojibake"), "meta": docs[7]["meta"]}
    docs[9] = {"text": shared["pile_self_dup"], "meta": {"pile_set_name": "OpenWebText2"}}
    docs[10] = {"text": shared["pile_self_dup"], "meta": {"pile_set_name": "OpenWebText2"}}
    docs[11] = {"text": docs[11]["text"], "meta": {}}  # a record whose meta has no pile_set_name
    for idx, kind in ((5, "whitespace"), (7, "mojibake")):
        shared["messy"].append({"source": "pile", "index": idx, "kind": kind})
    planted_spiky = set(shared["spiky"])  # those the defects above did not overwrite
    shared["spiky"] = {subset: [d["text"] for d in docs if d["text"] in planted_spiky and d["meta"].get("pile_set_name") == subset]
                       for subset in spiky}

    half = len(docs) // 2
    parts = {"00.jsonl.zst": docs[:half], "01.jsonl.zst": docs[half:]}
    for name, part in parts.items():
        lines = [_json_line(d) for d in part]
        if name == "00.jsonl.zst":  # malformed lines at known places
            for k, (line, defect) in enumerate(MALFORMED_JSONL):
                at = 4 + 5 * k
                lines.insert(at, line)
            for lineno, line in enumerate(lines, start=1):
                for bad, defect in MALFORMED_JSONL:
                    if line == bad:
                        planted.malformed(f"pile/{name}", lineno, defect)
        write_zst_lines(out / "pile" / name, lines)
        planted.file(f"pile/{name}", documents=len(part), lines=len(lines))
        shared["pile_files"][name] = [d["text"] for d in part]
    no_subset = next(name for name, part in parts.items() if any(not d["meta"] for d in part))
    planted.data["missing_subset"] = {"file": f"pile/{no_subset}", "documents": 1}

    # A download cut short: the first half of a compressed file, no end of frame.
    lines = [_json_line({"text": prose(_rng(seed, "trunc", i)), "meta": {"pile_set_name": "Pile-CC"}}) for i in range(40)]
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(buf, closefd=False) as w:
        for i, line in enumerate(lines):
            w.write(line + b"\n")
            if i % 5 == 4:  # many blocks, as in a large dump: the part before the cut decodes
                w.flush(zstandard.FLUSH_BLOCK)
    data = buf.getvalue()
    (out / "pile" / "02.jsonl.zst").write_bytes(data[: len(data) // 2])
    planted.file("pile/02.jsonl.zst", documents=len(lines))
    planted.data["truncated_files"].append({"file": "pile/02.jsonl.zst", "documents_before_cut": len(lines),
                                            "note": "zstd frame cut at half its compressed size"})


def _reddit(out: Path, seed: int, planted: _Planted) -> None:
    """Submissions in January, comment trees whose replies run on into February."""
    (out / "reddit").mkdir()
    rng = _rng(seed, "reddit")
    next_id = [36**5]

    def new_id() -> str:
        next_id[0] += rng.randint(1, 50)
        n, digits = next_id[0], ""
        while n:
            n, r = divmod(n, 36)
            digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
        return digits

    t0 = 1546300800  # 2019-01-01 UTC
    feb = 1548979200  # 2019-02-01 UTC
    submissions, comments = [], []
    threads = []
    for t in range(60):
        sid = new_id()
        created = t0 + rng.randint(0, 27 * 86400)
        sub = rng.choice(["AskReddit", "science", "MachineLearning", "books", "history"])
        submissions.append({"id": sid, "name": f"t3_{sid}", "title": sentence(rng), "selftext": paragraph(rng, (1, 3)),
                            "author": f"user{rng.randint(1, 500)}", "created_utc": created, "subreddit": sub,
                            "score": rng.randint(0, 900), "num_comments": 0})
        nodes = []  # (comment id, depth, created)
        for c in range(rng.randint(2, 14)):
            parent = rng.choice(nodes) if nodes and rng.random() < 0.75 else None
            cid = new_id()
            created_c = (parent[2] if parent else created) + rng.randint(60, 6 * 86400)
            body = paragraph(rng, (1, 3))
            roll = rng.random()
            if roll < 0.07:
                body = "[deleted]"
            elif roll < 0.12:
                body = "[removed]"
            comment = {"id": cid, "parent_id": f"t1_{parent[0]}" if parent else f"t3_{sid}", "link_id": f"t3_{sid}",
                       "body": body, "author": "[deleted]" if body == "[deleted]" else f"user{rng.randint(1, 500)}",
                       "created_utc": created_c, "subreddit": sub, "score": rng.randint(-5, 300),
                       "retrieved_on": created_c + 3600}
            if rng.random() < 0.1:  # older dumps carry created_utc as a string
                comment["created_utc"] = str(created_c)
            comments.append(comment)
            nodes.append((cid, (parent[1] + 1) if parent else 1, created_c))
        submissions[-1]["num_comments"] = len(nodes)
        threads.append({"link_id": f"t3_{sid}", "comments": len(nodes)})

    by_month: dict[str, list[bytes]] = {m: [] for m in REDDIT_MONTHS}
    for c in sorted(comments, key=lambda c: int(c["created_utc"])):
        month = REDDIT_MONTHS[0] if int(c["created_utc"]) < feb else REDDIT_MONTHS[1]
        by_month[month].append(_json_line(c))
    spanning = sum(1 for th in threads if any(c["link_id"] == th["link_id"] and int(c["created_utc"]) >= feb for c in comments)
                   and any(c["link_id"] == th["link_id"] and int(c["created_utc"]) < feb for c in comments))
    bad = [(b'{"id": "zzzzz", "body": "cut off', "truncated JSON"), (b"<html>503 Service Unavailable</html>", "not JSON")]
    for month, lines in by_month.items():
        for k, (line, defect) in enumerate(bad):
            lines.insert(3 + 7 * k, line)
        for lineno, line in enumerate(lines, start=1):
            if any(line == b for b, _ in bad):
                planted.malformed(f"reddit/RC_{month}.zst", lineno, dict(bad)[line])
        write_zst_lines(out / "reddit" / f"RC_{month}.zst", lines, window_log=PUSHSHIFT_WINDOW_LOG)
        planted.file(f"reddit/RC_{month}.zst", documents=len(lines) - len(bad), lines=len(lines))
    write_zst_lines(out / "reddit" / f"RS_{REDDIT_MONTHS[0]}.zst", [_json_line(s) for s in submissions],
                    window_log=PUSHSHIFT_WINDOW_LOG)
    planted.file(f"reddit/RS_{REDDIT_MONTHS[0]}.zst", documents=len(submissions), lines=len(submissions))
    planted.data["reddit"] = {
        "threads": len(threads), "comments": len(comments), "submissions": len(submissions),
        "threads_spanning_months": spanning, "window_log": PUSHSHIFT_WINDOW_LOG,
        "deleted_or_removed": sum(c["body"] in ("[deleted]", "[removed]") for c in comments),
    }


def _books(out: Path, seed: int, planted: _Planted, shared: dict) -> None:
    (out / "bookcorpus").mkdir()
    for b in range(10):
        rng = _rng(seed, "book", b)
        chapters = [f"Chapter {n}\n\n{prose(rng, (3, 6))}" for n in ("One", "Two", "Three", "Four")[: rng.randint(2, 4)]]
        text = "\n\n\n".join(chapters) + "\n"
        if b == 1:
            text = messy(rng, text, "crlf")
            shared["messy"].append({"source": "bookcorpus", "file": f"bookcorpus/book_{b:03d}.txt", "kind": "crlf"})
        (out / "bookcorpus" / f"book_{b:03d}.txt").write_text(text, encoding="utf-8", newline="")
        planted.file(f"bookcorpus/book_{b:03d}.txt", documents=1)
    # A book saved as Latin-1, not UTF-8: a reader must reject it with a reason, not guess.
    latin = "Chapter One\n\nCaf\u00e9 na\u00efve r\u00e9sum\u00e9. " + prose(_rng(seed, "latin")) + "\n"
    (out / "bookcorpus" / "book_latin1.txt").write_bytes(latin.encode("latin-1"))
    planted.file("bookcorpus/book_latin1.txt", documents=1)
    planted.data["invalid_utf8_files"].append("bookcorpus/book_latin1.txt")


def _stories(out: Path, seed: int, planted: _Planted, shared: dict) -> None:
    (out / "stories").mkdir()
    for s in range(40):
        text = prose(_rng(seed, "story", s), (3, 8)) + "\n"
        if s == 0:  # CC-Stories shares documents with CC-News and the Pile: near duplicate
            text = shared["near"]
        if s == 1:
            text = messy(_rng(seed, "story-ws"), text, "whitespace")
            shared["messy"].append({"source": "stories", "file": "stories/story_001.txt", "kind": "whitespace"})
        (out / "stories" / f"story_{s:03d}.txt").write_text(text, encoding="utf-8", newline="")
        planted.file(f"stories/story_{s:03d}.txt", documents=1)


def _ccnews(out: Path, seed: int, planted: _Planted, shared: dict) -> None:
    (out / "ccnews").mkdir()
    for year in (2019, 2020):
        rng = _rng(seed, "ccnews", year)
        records = []
        for i in range(60):
            records.append({"id": f"ccnews-{year}-{i:04d}", "title": sentence(rng), "text": prose(rng, (2, 5)),
                            "url": f"https://news.example.com/{year}/{i}", "date": f"{year}-0{1 + i % 9}-1{i % 10}"})
        if year == 2019:
            records[2]["text"] = shared["base"]  # exact duplicate of a Pile-CC document
            records[6]["text"] = shared["far"]  # similar, but well below the threshold
            records[8]["text"] = shared["borderline"]  # just below the threshold
            records[10]["text"] = messy(rng, records[10]["text"], "mojibake")
            shared["messy"].append({"source": "ccnews", "id": records[10]["id"], "kind": "mojibake"})
            # Documents normalize must drop: nothing but whitespace, and a stub shorter than any sane minimum.
            records[12]["text"] = " \t\r\n\u00a0\n  "
            records[14]["text"] = "Read more."
            planted.data["normalize_drops"] = [
                {"source": "ccnews", "id": records[12]["id"], "kind": "whitespace only"},
                {"source": "ccnews", "id": records[14]["id"], "kind": "short", "chars": len(records[14]["text"])},
            ]
        lines = [_json_line(r) for r in records]
        if year == 2020:
            lines.insert(5, b'{"id": "ccnews-2020-broken", "title": "cut')
            planted.malformed("ccnews/2020.jsonl", 6, "truncated JSON")
            lines.insert(9, b'{"id": "ccnews-2020-notext", "title": "no text here"}')
            planted.malformed("ccnews/2020.jsonl", 10, "no text field")
        (out / "ccnews" / f"{year}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        planted.file(f"ccnews/{year}.jsonl", documents=len(records), lines=len(lines))


def write_sample(out: str | os.PathLike, seed: int = 0, spiky: dict[str, int] | None = None) -> dict:
    """Write the sample corpus to `out` (atomically: a crash leaves no half corpus); returns PLANTED.
    `spiky`: {Pile subset: N}, one in N of the subset's documents made spiky."""
    spiky = dict(spiky or {})
    for subset, every in spiky.items():
        if subset not in PILE_SUBSETS:
            raise ValueError(f"--spiky-subset: {subset!r} is not a Pile subset; they are: {', '.join(PILE_SUBSETS)}")
        if not isinstance(every, int) or every < 2:
            raise ValueError(f"--spiky-subset {subset}:{every}: expected one in N documents with N an integer >= 2")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; the sample corpus is written to a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        planted = _Planted(seed)
        base = prose(_rng(seed, "base"), (8, 10)) + "\n"
        near = mutate(_rng(seed, "near"), base, changes=1)  # J ~0.98: must be removed at 0.95
        borderline = mutate_to_below(_rng(seed, "borderline"), base, 0.95)  # J just under: must stay
        far = mutate(_rng(seed, "far"), base, changes=40)
        shared = {"base": base, "near": near, "borderline": borderline, "far": far, "messy": [], "pile_files": {},
                  "pile_self_dup": prose(_rng(seed, "selfdup"), (4, 6)) + "\n", "spiky": []}
        _pile(tmp, seed, planted, shared, spiky)
        _reddit(tmp, seed, planted)
        _books(tmp, seed, planted, shared)
        _stories(tmp, seed, planted, shared)
        _ccnews(tmp, seed, planted, shared)
        pile_file = next(n for n, texts in shared["pile_files"].items() if base in texts)
        planted.data["duplicates"] = [
            {"kind": "exact", "a": {"source": "pile", "file": f"pile/{pile_file}"}, "b": {"source": "ccnews", "id": "ccnews-2019-0002"},
             "jaccard": 1.0},
            {"kind": "exact", "a": {"source": "pile", "subset": "OpenWebText2"}, "b": {"source": "pile", "subset": "OpenWebText2"},
             "jaccard": 1.0, "note": "the same document twice inside one source"},
            {"kind": "near", "a": {"source": "pile", "file": f"pile/{pile_file}"}, "b": {"source": "stories", "file": "stories/story_000.txt"},
             "jaccard": round(jaccard(base, near), 4)},
            {"kind": "below threshold", "a": {"source": "pile", "file": f"pile/{pile_file}"}, "b": {"source": "ccnews", "id": "ccnews-2019-0008"},
             "jaccard": round(jaccard(base, borderline), 4)},
            {"kind": "far", "a": {"source": "pile", "file": f"pile/{pile_file}"}, "b": {"source": "ccnews", "id": "ccnews-2019-0006"},
             "jaccard": round(jaccard(base, far), 4)},
        ]
        planted.data["messy"] = shared["messy"]
        if spiky:
            planted.data["spiky"] = {subset: {"every": every, "documents": len(shared["spiky"][subset]), "run": SPIKY_RUN,
                                              "note": "each carries a run of one rare character (screen/ should drop the subset)"}
                                     for subset, every in spiky.items()}
        (tmp / "PLANTED.json").write_text(json.dumps(planted.data, indent=2, sort_keys=True) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return planted.data


def parse_spiky(item: str) -> tuple[str, int]:
    """'NAME' or 'NAME:N' -> (NAME, N)."""
    name, _, every = item.rpartition(":") if item.rpartition(":")[2].isdigit() else (item, "", str(SPIKY_EVERY))
    return name, int(every)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m corpus.sample", description="Write the sample corpus.")
    p.add_argument("out", help="a folder that does not exist yet")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed: the same seed, the same bytes (default 0)")
    p.add_argument("--spiky-subset", metavar="NAME[:N]", action="append", default=[],
                   help=f"make one in N (default {SPIKY_EVERY}) of this Pile subset's documents spiky (built to destabilise "
                   "training), for the screen to catch; repeat it for several subsets")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        planted = write_sample(args.out, args.seed, dict(parse_spiky(item) for item in args.spiky_subset))
    except (ValueError, FileExistsError) as exc:
        p.error(str(exc))
    total = sum(f["documents"] for f in planted["files"].values())
    print(f"wrote {len(planted['files'])} files, {total} documents, {len(planted['malformed'])} malformed lines to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

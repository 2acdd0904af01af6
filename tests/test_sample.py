"""The generated sample corpus: real formats, deterministic, and every planted defect really there."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import zstandard

from conftest import ROOT
from corpus.sample import PILE_SUBSETS, jaccard, write_sample


def zst_lines(path: Path, **kw) -> list[bytes]:
    with zstandard.ZstdDecompressor(**kw).stream_reader(io.BytesIO(path.read_bytes())) as r:
        return r.read().split(b"\n")[:-1]


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, sample):
    write_sample(tmp_path / "again")
    write_sample(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(sample[0]) for p in sample[0].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*") if p.is_file())
    assert all((sample[0] / f).read_bytes() == (tmp_path / "again" / f).read_bytes() for f in files)
    assert (sample[0] / "pile/00.jsonl.zst").read_bytes() != (tmp_path / "other/pile/00.jsonl.zst").read_bytes()
    with pytest.raises(FileExistsError):
        write_sample(tmp_path / "again")
    size = sum((sample[0] / f).stat().st_size for f in files)
    assert 200_000 < size < 5_000_000


def test_layout_matches_the_config(sample):
    out, _ = sample
    for pattern in ["pile/*.jsonl.zst", "reddit/RC_*.zst", "reddit/RS_*.zst", "bookcorpus/*.txt", "stories/*.txt", "ccnews/*.jsonl"]:
        assert list(out.glob(pattern)), pattern


def test_pile_is_zstd_jsonl_over_all_22_subsets_with_planted_bad_lines(sample):
    out, planted = sample
    subsets, bad = Counter(), {}
    for name in ("00.jsonl.zst", "01.jsonl.zst"):
        lines = zst_lines(out / "pile" / name)
        assert len(lines) == planted["files"][f"pile/{name}"]["lines"]
        for lineno, line in enumerate(lines, start=1):
            try:
                record = json.loads(line.decode("utf-8"))
                assert isinstance(record["text"], str)
                subsets[record["meta"].get("pile_set_name")] += 1
            except (ValueError, KeyError, AssertionError):
                bad[(f"pile/{name}", lineno)] = True
    assert set(subsets) - {None} == set(PILE_SUBSETS) and len(PILE_SUBSETS) == 22
    assert subsets[None] == planted["missing_subset"]["documents"]
    planted_bad = {(m["file"], m["line"]) for m in planted["malformed"] if m["file"].startswith("pile/")}
    assert set(bad) == planted_bad
    assert {m["defect"] for m in planted["malformed"]} >= {"truncated JSON", "not JSON", "invalid UTF-8", "empty line"}


def test_truncated_file_is_cut_part_way(sample):
    out, planted = sample
    (entry,) = planted["truncated_files"]
    data = (out / entry["file"]).read_bytes()
    dobj = zstandard.ZstdDecompressor().decompressobj()
    got = dobj.decompress(data)
    assert not dobj.eof  # the frame never ends: a reader must notice, not stop quietly
    assert 0 < got.count(b"\n") < entry["documents_before_cut"]
    whole = zstandard.ZstdDecompressor().decompressobj()
    whole.decompress((out / "pile" / "00.jsonl.zst").read_bytes())
    assert whole.eof  # while a complete file does end


def test_pushshift_files_need_the_2gib_window(sample):
    out, planted = sample
    rc = out / "reddit" / "RC_2019-01.zst"
    assert zstandard.get_frame_parameters(rc.read_bytes()).window_size == 2**31
    with pytest.raises(zstandard.ZstdError, match="too much memory"):
        zst_lines(rc)
    with pytest.raises(OSError, match="too much memory"):  # pyarrow's reader refuses, as on the real dumps
        with pa.input_stream(str(rc), compression="zstd") as f:
            f.read()
    comments = []
    for month in ("2019-01", "2019-02"):
        for line in zst_lines(out / "reddit" / f"RC_{month}.zst", max_window_size=2**31):
            try:
                comments.append(json.loads(line))
            except ValueError:
                pass
    assert len(comments) == planted["reddit"]["comments"]
    assert {c["link_id"][:3] for c in comments} == {"t3_"} and {c["parent_id"][:3] for c in comments} == {"t1_", "t3_"}
    ids = {c["id"] for c in comments}
    assert all(c["parent_id"][3:] in ids for c in comments if c["parent_id"].startswith("t1_"))
    months = {}
    for month in ("2019-01", "2019-02"):
        for line in zst_lines(out / "reddit" / f"RC_{month}.zst", max_window_size=2**31):
            if line.startswith(b'{"id": "') and b"link_id" in line:
                months.setdefault(json.loads(line)["link_id"], set()).add(month)
    assert sum(len(m) == 2 for m in months.values()) == planted["reddit"]["threads_spanning_months"] > 0
    assert sum(c["body"] in ("[deleted]", "[removed]") for c in comments) == planted["reddit"]["deleted_or_removed"] > 0
    assert any(isinstance(c["created_utc"], str) for c in comments)
    submissions = [json.loads(l) for l in zst_lines(out / "reddit" / "RS_2019-01.zst", max_window_size=2**31)]
    assert {f"t3_{s['id']}" for s in submissions} == set(months)


def test_duplicates_are_planted_at_the_jaccard_they_claim(sample):
    out, planted = sample
    by_kind = {d["kind"]: d for d in planted["duplicates"]}
    assert by_kind["near"]["jaccard"] >= 0.95 > by_kind["below threshold"]["jaccard"] >= 0.9
    assert by_kind["far"]["jaccard"] < 0.6
    pile = []
    for n in ("00", "01"):
        for line in zst_lines(out / "pile" / f"{n}.jsonl.zst"):
            try:
                pile.append(json.loads(line)["text"])
            except (ValueError, KeyError):
                pass
    news = {json.loads(l)["id"]: json.loads(l)["text"] for l in (out / "ccnews" / "2019.jsonl").read_bytes().splitlines()}
    story = (out / "stories" / "story_000.txt").read_text()
    assert news["ccnews-2019-0002"] in pile  # exact, across sources
    base = news["ccnews-2019-0002"]
    assert jaccard(base, story) == pytest.approx(by_kind["near"]["jaccard"], abs=1e-4)
    assert jaccard(base, news["ccnews-2019-0008"]) == pytest.approx(by_kind["below threshold"]["jaccard"], abs=1e-4)
    assert Counter(pile).most_common(1)[0][1] == 2  # the same document twice inside the Pile


def test_messy_text_and_encodings(sample):
    out, planted = sample
    assert planted["invalid_utf8_files"] == ["bookcorpus/book_latin1.txt"]
    with pytest.raises(UnicodeDecodeError):
        (out / "bookcorpus" / "book_latin1.txt").read_bytes().decode("utf-8")
    assert b"\r\n" in (out / "bookcorpus" / "book_001.txt").read_bytes()
    assert "Chapter One" in (out / "bookcorpus" / "book_000.txt").read_text()
    news = (out / "ccnews" / "2019.jsonl").read_text(encoding="utf-8")
    assert "\u00e2\u20ac\u2122" in news and "&amp;" in news  # mojibake and HTML entities
    pile = b"".join(zst_lines(out / "pile" / "00.jsonl.zst") + zst_lines(out / "pile" / "01.jsonl.zst")).decode("utf-8", "replace")
    assert "START OF THIS PROJECT GUTENBERG EBOOK" in pile
    assert "C:\\\\new\\\\table" in pile  # a backslash-heavy document, JSON-escaped on disk
    assert {m["kind"] for m in planted["messy"]} == {"whitespace", "mojibake", "crlf"}


def test_module_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "corpus.sample", str(tmp_path / "s")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "malformed lines" in proc.stdout
    assert (tmp_path / "s" / "PLANTED.json").is_file()


def test_a_spiky_subset_is_planted_only_where_asked(tmp_path, sample):
    out, _ = sample
    planted = write_sample(tmp_path / "spiky", spiky={"HackerNews": 6, "ArXiv": 12})
    assert "spiky" not in json.loads((out / "PLANTED.json").read_text())

    def pile_docs(folder: Path) -> list[dict]:
        out = []
        for name in ("00.jsonl.zst", "01.jsonl.zst"):
            with zstandard.ZstdDecompressor().stream_reader(open(folder / "pile" / name, "rb")) as r:
                for line in io.TextIOWrapper(r, encoding="utf-8", errors="replace"):
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # the planted malformed lines
                    if isinstance(record, dict) and isinstance(record.get("text"), str) and record.get("meta"):
                        out.append(record)
        return out

    def has_run(text: str) -> bool:
        words = text.split()
        return any(len(w) == 1 and ord(w) > 0x4DFF and words.count(w) >= 1000 for w in set(words))

    spiky = [d for d in pile_docs(tmp_path / "spiky") if has_run(d["text"])]
    by_subset = Counter(d["meta"]["pile_set_name"] for d in spiky)
    assert by_subset == {s: planted["spiky"][s]["documents"] for s in ("HackerNews", "ArXiv")}
    assert by_subset["HackerNews"] >= 5 and 1 <= by_subset["ArXiv"] < by_subset["HackerNews"]  # one in 12 < one in 6
    assert not any(has_run(d["text"]) for d in pile_docs(out))
    for arg, message in (("Nope", "'Nope' is not a Pile subset"), ("ArXiv:1", "expected one in N documents with N an integer >= 2")):
        proc = subprocess.run([sys.executable, "-m", "corpus.sample", str(tmp_path / "x"), "--spiky-subset", arg],
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2 and message in proc.stderr

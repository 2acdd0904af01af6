"""Normalize: the text rules OPT applied to every subset, as pure functions with their own names.

OPT did "ad-hoc whitespace normalization" and removed "repetitive non-informative text such as
'Chapter One' or Project Gutenberg licence boilerplate". Ours, in order:

1. `ftfy`: ftfy.fix_text: mojibake (UTF-8 read as cp1252), HTML entities, bad unicode.
2. `whitespace`: CRLF and CR -> LF; within a line every run of other whitespace (tabs, no-break
   spaces, U+2028 ...) -> one space; trailing spaces stripped; 3+ newlines -> 2; the document
   stripped.
3. `gutenberg`: the Project Gutenberg licence header (through the "*** START OF ..." line) and
   footer (from the "*** END OF ..." line) removed, when both markers are there.
4. `chapter_headings`: lone "Chapter One" / "CHAPTER IV." lines at the start of a book removed.
5. minimum length: a document shorter than `min_chars` characters is dropped, with the reason.

Then the held-out evaluation set is drawn from the documents kept (corpus/evalset.py): `eval.fraction`
of each source, by a seeded hash of (source, id), set aside in `eval/` with its fingerprint in the
manifest. Every later stage, and so every data ablation, sees the rest.

`normalize_text` is idempotent (normalize(normalize(x)) == normalize(x); the tests check it with
hypothesis on random unicode): it repeats the rules until the text stops changing.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import ftfy
from corpus import evalset
from corpus.parts import (DOCUMENT_SCHEMA, DROPPED_SCHEMA, Parts, check_read, check_written, input_parts, iter_rows,
                          parquet_bytes, row_group_ranges, run_tasks, task_bytes)
from corpus.config import EvalConfig, NormalizeConfig
from core.dag import StageContext, StageResult

RULES = ("ftfy", "whitespace", "gutenberg", "chapter_headings")

_HSPACE = re.compile(r"[^\S\n]+")  # any whitespace but a newline
_BLANK_RUNS = re.compile(r"\n{3,}")
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG E-?BOOK.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG E-?BOOK.*$", re.IGNORECASE | re.MULTILINE)
_NUMBER_WORDS = ("one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|"
                 "sixteen|seventeen|eighteen|nineteen|twenty|first|second|third|fourth|fifth")
_CHAPTER = re.compile(rf"(chapter|CHAPTER|Chapter) +(\d+|[IVXLC]+|(?i:{_NUMBER_WORDS}))\.?")


def fix_unicode(text: str) -> str:
    return ftfy.fix_text(text)


def fix_whitespace(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(_HSPACE.sub(" ", line).rstrip(" ") for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip()


def strip_gutenberg(text: str) -> str:
    start, end = _GUTENBERG_START.search(text), _GUTENBERG_END.search(text)
    if not start or not end or end.start() < start.end():
        return text
    return text[start.end() : end.start()]


def strip_chapter_headings(text: str) -> str:
    """Drop heading lines (and blank lines) at the very start, until the first line of prose."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and (not lines[i].strip() or _CHAPTER.fullmatch(lines[i].strip())):
        i += 1
    if i == 0 or not any(_CHAPTER.fullmatch(line.strip()) for line in lines[:i]):
        return text
    return "\n".join(lines[i:])


@dataclass
class Normalized:
    text: str
    changed_by: list[str] = field(default_factory=list)  # the rules that changed the text
    dropped: str | None = None  # why the document is dropped, if it is


MAX_PASSES = 5


def normalize_text(text: str, config: NormalizeConfig) -> Normalized:
    """The rules, repeated until the text stops changing.

    One pass is not always a fixed point: ftfy's mojibake detection looks at context, and a
    whitespace change can reveal a sequence it fixes on the next pass. A document that one
    pass leaves unchanged (most of them) costs one pass.
    """
    out = Normalized(text)
    for _ in range(MAX_PASSES):
        before = out.text
        _one_pass(out, config)
        if out.text == before:
            break
    if len(out.text) < max(config.min_chars, 1):
        out.dropped = "empty after normalization" if not out.text.strip() else f"shorter than {config.min_chars} characters"
    return out


def _one_pass(out: Normalized, config: NormalizeConfig) -> None:
    steps = [
        ("ftfy", config.ftfy, fix_unicode),
        ("whitespace", config.whitespace, fix_whitespace),
        ("gutenberg", config.gutenberg, strip_gutenberg),
        ("chapter_headings", config.chapter_headings, strip_chapter_headings),
    ]
    for name, enabled, rule in steps:
        if not enabled:
            continue
        fixed = rule(out.text)
        if name in ("gutenberg", "chapter_headings") and fixed != out.text and config.whitespace:
            fixed = fix_whitespace(fixed)  # what is left after a cut is normalized like the rest
        if fixed != out.text:
            if name not in out.changed_by:
                out.changed_by.append(name)
            out.text = fixed


# --------------------------------------------------------------------------- the stage

TASK_BYTES = 64 << 20  # of ingest's documents per task, at most


@dataclass(frozen=True)
class NormalizeTask:
    """A run of row groups of one of ingest's parts, normalized by `normalize_task`."""
    path: str
    row_groups: tuple[int, ...]
    stem: str  # of the part files it writes
    config: NormalizeConfig
    eval: EvalConfig
    output: str
    dropped: str
    eval_folder: str


def normalize_task(task: NormalizeTask) -> dict:
    """One part of ingest's documents -> normalized documents, the evaluation set's and dropped ones, with counts
    per rule and the sum of the evaluation documents' hashes (`eval_hash`)."""
    config, held_out = task.config, task.eval
    docs = Parts(task.output, task.stem, DOCUMENT_SCHEMA)
    evaluation = Parts(task.eval_folder, task.stem, DOCUMENT_SCHEMA)
    dropped = Parts(task.dropped, task.stem, DROPPED_SCHEMA)
    counts: collections.Counter = collections.Counter()
    for row in iter_rows(task.path, row_groups=list(task.row_groups)):
        counts["rows_in"] += 1
        counts["chars_in"] += len(row["text"])
        out = normalize_text(row["text"], config)
        if out.dropped:
            dropped.add({**row, "reason": out.dropped}, len(row["text"]))
            counts["dropped"] += 1
            counts[f"dropped.{out.dropped}"] += 1
            continue
        counts.update(f"changed.{rule}" for rule in out.changed_by)  # of the documents kept
        counts["chars_out"] += len(out.text)
        if evalset.drawn([row["source"]], [row["id"]], held_out.fraction, held_out.seed)[0]:
            evaluation.add({**row, "text": out.text}, len(out.text))
            counts[evalset.REASON] += 1
            counts[f"eval.documents.{row['source']}"] += 1
            counts["eval_hash"] += evalset.document_hash(row["source"], row["id"], out.text)
        else:
            docs.add({**row, "text": out.text}, len(out.text))
            counts["rows_out"] += 1
    docs.close()
    evaluation.close()
    dropped.close()
    return dict(counts)


def run(ctx: StageContext) -> StageResult:
    """Ingest's parts in runs of row groups, one Ray Data task each; part names carry over."""
    folders = {"output": str(ctx.output), "dropped": str(ctx.aside("dropped")), "eval_folder": str(ctx.aside(evalset.REASON))}
    parts = input_parts(ctx.inputs, "ingest")
    target = task_bytes(parquet_bytes(parts), TASK_BYTES)
    tasks = [NormalizeTask(p, tuple(groups), f"{Path(p).stem}-{groups[0]:05d}", ctx.section, ctx.config.eval, **folders)
             for p, groups in row_group_ranges(parts, target)]
    counts: collections.Counter = collections.Counter()
    for result in run_tasks(normalize_task, tasks, stage="normalize"):
        counts.update(result)
    check_read(counts["rows_in"], ctx.inputs, "ingest")
    check_written(ctx.output, counts["rows_out"], "rows_out")
    check_written(folders["dropped"], counts["dropped"], "dropped")
    check_written(folders["eval_folder"], counts[evalset.REASON], "held out for evaluation")
    total = counts.pop("eval_hash", 0) + ctx.config.eval.identity()  # the documents, and how training is decontaminated
    fingerprint = evalset.fingerprint(total, counts[evalset.REASON])
    ctx.log.info("evaluation set: %d documents, fingerprint %s", counts[evalset.REASON], fingerprint)
    metrics = {k: v for k, v in counts.items() if k not in ("rows_in", "rows_out", "dropped", evalset.REASON)}
    for rule in RULES:
        metrics.setdefault(f"changed.{rule}", 0)
    return StageResult(counts["rows_in"], counts["rows_out"], {"dropped": counts["dropped"], evalset.REASON: counts[evalset.REASON]},
                       metrics, fields={"eval": {"fingerprint": fingerprint, "documents": counts[evalset.REASON],
                                                 **dataclasses.asdict(ctx.config.eval)}})

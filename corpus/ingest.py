"""The ingest stage: every source's raw files -> documents, and a written reason for every other record.

Each raw record (a JSON line, a text file or block) ends in exactly one place, so that
rows_in == rows_out + the rest, and the stage checks that (and that each folder holds the rows
it claims) before the runner commits its output:

| fate                          | where                         | what                                    |
|-------------------------------|-------------------------------|-----------------------------------------|
| rows_out                      | output/                       | a document (Reddit: one per thread)     |
| rejected                      | rejects/                      | unreadable, or a link out: file, line, offset, reason, first 200 bytes |
| subset_not_kept               | subset_not_kept/              | a Pile document outside `keep_subsets`  |
| off_longest_chain             | off_longest_chain/            | Reddit comments off the longest chain (OPT dropped ~66%) |
| joined_into_thread            | (the thread's document)       | the chain's other comments and the submission, named in its meta |
| empty_thread                  | empty_thread/                 | a thread whose chain messages were all deleted or removed |
| submission_without_comments   | submission_without_comments/  | a submission nobody answered            |
| repeated_record               | repeated_record/              | a Reddit record seen twice (overlapping dumps) |

Three phases: (1) file tasks on Ray Data (corpus.parts.run_tasks) read and validate every file,
writing documents and set-aside rows straight into their folders and Reddit records into a
staging folder; (2) a Ray Data groupby on `link_id` over the records of every month builds the
threads (a thread's replies run on into later monthly files); (3) file tasks split the staged
threads into documents and set-aside rows. The staging folder is deleted before the commit.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from corpus import reddit
from corpus.parts import DOCUMENT_SCHEMA, Parts, check_written, group_by_size, iter_rows, parquet_files, run_tasks, task_bytes
from corpus.readers import LIMITS, READERS, REDDIT_FIELDS, Limits, relative_names
from core import storage
from core.ray_session import RayConfig
from corpus.config import IngestConfig, SourceConfig
from core.console import note
from core.dag import StageContext, StageResult
from core.ray_session import groupby

REJECT_SCHEMA = pa.schema([("source", pa.string()), ("file", pa.string()), ("line", pa.int64()),
                           ("offset", pa.int64()), ("reason", pa.string()), ("head", pa.string())])
NOT_KEPT_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("subset", pa.string()),
                             ("file", pa.string()), ("line", pa.int64()), ("chars", pa.int64())])
RECORD_SCHEMA = pa.schema([(f, pa.int64() if f in ("created_utc", "line") else pa.string()) for f in REDDIT_FIELDS])
THREAD_ASIDE_SCHEMA = pa.schema([("source", pa.string()), ("link_id", pa.string()), ("ids", pa.list_(pa.string()))])

REASONS = ("rejected", "subset_not_kept", "off_longest_chain", "joined_into_thread", "empty_thread",
           "submission_without_comments", "repeated_record")
FOLDERS = {"rejected": "rejects"}  # every other reason's rows are in a folder of its own name


class BadInput(RuntimeError):
    """on_bad_input: fail, and a record could not be read."""


def folder_of(reason: str) -> str:
    return FOLDERS.get(reason, reason)


# --------------------------------------------------------------------------- phase 1: read files


@dataclass(frozen=True)
class ReadTask:
    """Some files of one source, read by `read_task`."""
    source: SourceConfig
    files: tuple[tuple[str, str, int], ...]  # (path, its name relative to the source's files, bytes)
    stem: str  # of the part files it writes
    folders: dict[str, str]  # where each kind of row goes: output, each reason's folder, records (Reddit's)
    fail_on_bad_input: bool
    limits: Limits = LIMITS  # what a reader holds at most (ingest.max_line_mb, max_document_mb, max_ratio)
    refused: tuple[tuple[str, str], ...] = ()  # (path, why): named by the source's paths, not read (storage.listing)


def read_task(task: ReadTask) -> dict:
    """Read a group of files of one source; write documents, rejects and set-aside rows; count."""
    source = task.source
    name, fmt = source.name, source.format
    reader = functools.partial(READERS[fmt], limits=task.limits)
    if fmt == "jsonl":
        reader = functools.partial(reader, text_field=source.text_field, id_field=source.id_field)
    elif fmt == "text":
        reader = functools.partial(reader, split=source.split)
    keep = set(source.keep_subsets) if source.keep_subsets else None
    folders, stem = task.folders, task.stem
    docs = Parts(folders["output"], stem, DOCUMENT_SCHEMA)
    rejects = Parts(folders["rejected"], stem, REJECT_SCHEMA)
    not_kept = Parts(folders["subset_not_kept"], stem, NOT_KEPT_SCHEMA)
    records = Parts(folders["records"], stem, RECORD_SCHEMA)
    counts: collections.Counter = collections.Counter()
    subsets: collections.Counter = collections.Counter()
    first_bad = None

    def rows() -> Iterator[dict]:
        for path, why in task.refused:  # a file left unread is one reject, like a file that cannot be read
            yield {"source": name, "file": storage.printable(path), "line": 0, "offset": 0, "reason": why, "head": ""}
        for path, rel, nbytes in task.files:
            counts["bytes_read"] += nbytes
            yield from reader(path, name, rel)

    for row in rows():
        counts["rows_in"] += 1
        if row.get("reason"):
            rejects.add({k: row[k] for k in REJECT_SCHEMA.names})
            counts["rejected"] += 1
            if task.fail_on_bad_input:
                first_bad = f"{row['file']}:{row['line']} (byte {row['offset']}): {row['reason']}"
                break
        elif "kind" in row:
            records.add({k: row[k] for k in RECORD_SCHEMA.names}, len(row["body"]))
            counts["reddit_records"] += 1
        elif keep is not None and row["subset"] not in keep:
            not_kept.add({"id": row["id"], "source": name, "subset": row["subset"], "file": row["file"],
                          "line": row["line"], "chars": len(row["text"])})
            counts["subset_not_kept"] += 1
        else:
            docs.add({k: row[k] for k in DOCUMENT_SCHEMA.names}, len(row["text"]))
            counts["documents"] += 1
            counts["chars_out"] += len(row["text"])
            subsets[f"{name}/{row['subset']}"] += 1
    for parts in (docs, rejects, not_kept, records):
        parts.close()
    return {"counts": dict(counts), "subsets": dict(subsets), "first_bad": first_bad}


def read_task_for(source: SourceConfig, files: list[str], rel: dict[str, str], sizes: dict[str, int], stem: str,
                  folders: dict[str, str], fail_on_bad_input: bool, limits: Limits = LIMITS,
                  refused: dict[str, str] | None = None) -> ReadTask:
    """The task `read_task` runs for some files of a source (and for the files it leaves unread, with why)."""
    return ReadTask(source, tuple((f, rel[f], sizes[f]) for f in files), stem,
                    {**folders, "records": os.path.join(folders["records"], source.name)}, fail_on_bad_input, limits,
                    tuple(sorted((refused or {}).items())))


def limits_of(ingest: IngestConfig, source: SourceConfig) -> Limits:
    """What a reader of `source` holds at most: ingest's limits, and the source's zstd window."""
    return Limits(ingest.max_line_mb << 20, ingest.max_document_mb << 20, ingest.max_ratio,
                  zstd_window_log=source.zstd_window_log)


def read_tasks(ctx: StageContext, folders: dict[str, str]) -> list[ReadTask]:
    """One task per group of files of a source: small files packed together, up to `ingest.task_mb`
    (and fewer per task when that leaves cores idle). One file is never split: a zstd stream is
    read from its start."""
    # Each file's size is asked for once (a request per file when the sources are in a bucket).
    listed = {source.name: listing(source) for source in ctx.config.sources}
    sizes_of = {name: {f: storage.size(f) for f in files} for name, (files, _) in listed.items()}
    total = sum(n for sizes in sizes_of.values() for n in sizes.values())
    target = task_bytes(total, ctx.config.ingest.task_mb << 20)
    tasks = []
    for source in ctx.config.sources:
        sizes = sizes_of[source.name]
        rel = relative_names(list(sizes))
        for i, group in enumerate(group_by_size(sizes, target)):
            tasks.append(read_task_for(source, group, rel, sizes, f"{source.name}-{i:05d}", folders,
                                       ctx.config.ingest.on_bad_input == "fail", limits_of(ctx.config.ingest, source)))
        if refused := listed[source.name].refused:
            tasks.append(read_task_for(source, [], rel, sizes, f"{source.name}-refused", folders,
                                       ctx.config.ingest.on_bad_input == "fail", limits_of(ctx.config.ingest, source), refused))
    return tasks


def listing(source: SourceConfig) -> storage.Listing:
    """The files a source reads (as `source_files` lists them) and those its paths name but it leaves unread (a
    link out of the source's folder, a FIFO: storage.listing), with why: each of those is a reject."""
    listings = [storage.listing(pattern) for pattern in source.paths]
    return storage.Listing(sorted({f for each in listings for f in each.files}),
                           {f: why for each in listings for f, why in each.refused.items()})


# --------------------------------------------------------------------------- phases 2-3: threads


GROUP_PARTITION_BYTES = 128 << 20  # of staged records per shuffle partition


def build_threads(records: str, staged: str, source: str, ray_config: RayConfig) -> None:
    """Every record of a source grouped by link_id across all its files (a Ray Data groupby).

    Partitions scale with the data (Ray's default of 200 would write 200 tiny parts locally).
    """
    import ray.data

    size = sum(os.path.getsize(p) for p in parquet_files(records))
    ds = ray.data.read_parquet(records)
    threads = groupby(ds, "link_id", size, ray_config, num_partitions=max(1, -(-size // GROUP_PARTITION_BYTES)))
    threads.map_groups(functools.partial(reddit.thread_row, source=source), batch_format="pyarrow").write_parquet(staged)


@dataclass(frozen=True)
class ThreadsTask:
    """A staged part of a Reddit source's threads, split by `split_threads_task`."""
    path: str
    stem: str
    folders: dict[str, str]  # as ReadTask's


def split_threads_task(task: ThreadsTask) -> dict:
    """A staged thread part -> documents in output/, the other records' fates in their folders."""
    folders, stem = task.folders, task.stem
    docs = Parts(folders["output"], stem, DOCUMENT_SCHEMA)
    aside = {r: Parts(folders[r], stem, THREAD_ASIDE_SCHEMA)
             for r in ("off_longest_chain", "empty_thread", "submission_without_comments", "repeated_record")}
    counts: collections.Counter = collections.Counter()
    for row in iter_rows(task.path):
        fates = reddit.thread_fates(row)
        counts.update(fates)
        counts["threads"] += row["outcome"] != "no_comments"
        counts["comments_in"] += row["comments"]
        counts["comments_on_chain"] += row["on_chain"]
        counts["comments_kept"] += row["kept"]
        if row["outcome"] == "document":
            docs.add({k: row[k] for k in DOCUMENT_SCHEMA.names}, len(row["text"]))
            counts["chars_out"] += len(row["text"])
        ids = {"off_longest_chain": row["off_chain_ids"], "repeated_record": row["repeated"],
               "empty_thread": row["chain_ids"] if row["outcome"] == "empty_thread" else [],
               "submission_without_comments": [row["link_id"][3:]] if row["outcome"] == "no_comments" else []}
        for reason, values in ids.items():
            if values:
                aside[reason].add({"source": row["source"], "link_id": row["link_id"], "ids": values})
    docs.close()
    for parts in aside.values():
        parts.close()
    return dict(counts)


# --------------------------------------------------------------------------- the stage


def run(ctx: StageContext) -> StageResult:
    staging = ctx.folder / "staging"
    folders = {"output": str(ctx.output), "records": str(staging / "records")}
    folders.update({r: str(ctx.aside(folder_of(r))) for r in REASONS if r != "joined_into_thread"})

    results = run_tasks(read_task, read_tasks(ctx, folders), stage="ingest")
    counts: collections.Counter = collections.Counter()
    subsets: collections.Counter = collections.Counter()
    for result in results:
        if result["first_bad"]:
            raise BadInput(f"bad input (ingest.on_bad_input is 'fail'): {result['first_bad']}")
        counts.update(result["counts"])
        subsets.update(result["subsets"])

    reddit_counts: collections.Counter = collections.Counter()
    for source in ctx.config.sources:
        records = Path(folders["records"]) / source.name
        if source.format != "pushshift" or not parquet_files(records):
            continue
        staged = staging / "threads" / source.name
        build_threads(str(records), str(staged), source.name, ctx.config.ray)
        tasks = [ThreadsTask(p, f"{source.name}-threads-{i:05d}", folders) for i, p in enumerate(parquet_files(staged))]
        for result in run_tasks(split_threads_task, tasks):
            reddit_counts.update(result)
            subsets[f"{source.name}/{source.name}"] += result.get("documents", 0)
    shutil.rmtree(staging, ignore_errors=True)

    return _result(ctx, counts, reddit_counts, subsets)


def _result(ctx: StageContext, counts: collections.Counter, threads: collections.Counter,
            subsets: collections.Counter) -> StageResult:
    records = counts["reddit_records"]
    thread_fates = sum(threads[k] for k in ("documents", *REASONS))
    if thread_fates != records:
        raise RuntimeError(f"Reddit records do not add up: {records} read, {thread_fates} accounted for by threads")
    set_aside = {r: counts[r] + threads[r] for r in REASONS}
    result = StageResult(rows_in=counts["rows_in"], rows_out=counts["documents"] + threads["documents"], set_aside=set_aside)
    for reason in ("rejected", "subset_not_kept"):  # each of these is one row in its folder
        check_written(ctx.folder / folder_of(reason), set_aside[reason], reason)
    check_written(ctx.output, result.rows_out, "documents")
    if set_aside["rejected"]:
        note("ingest", f"{set_aside['rejected']} input records rejected as unreadable: file, line and reason of each "
                       f"in {folder_of('rejected')}/ beside the output")
    metrics = {"bytes_read": counts["bytes_read"], "chars_out": counts["chars_out"] + threads["chars_out"]}
    if threads["comments_in"]:
        metrics.update({"reddit_threads": threads["threads"], "reddit_comments_in": threads["comments_in"],
                        "reddit_comments_on_chain": threads["comments_on_chain"],
                        "reddit_comments_kept": threads["comments_kept"],
                        "reddit_comments_dropped_fraction": 1 - threads["comments_kept"] / threads["comments_in"]})
    metrics.update({f"documents.{key}": n for key, n in sorted(subsets.items())})
    result.metrics = metrics
    return result

"""A small but real pipeline for testing the DAG runner: Ray Data stages with real rejects.

ingest (jsonl, malformed lines rejected) -> normalize (whitespace; empty documents dropped)
-> dedup (exact text duplicates removed, each written with the id it duplicates) -> report.
Each stage accounts for every row, so the runner's bookkeeping is tested on real outputs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray.data

from corpus.parts import parquet_bytes, parquet_files
from corpus.config import source_files
from core.dag import Stage, StageContext, StageResult
from core.ray_session import groupby
from pipelines.stages import raw_files_identity


def _parse_file(row: dict) -> list[dict]:
    path, out = row["path"], []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            reason, text = "", ""
            try:
                record = json.loads(raw)
                text = record["text"]
                if not isinstance(text, str):
                    reason = "text is not a string"
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"malformed line: {type(exc).__name__}"
            out.append({"id": f"{Path(path).name}:{lineno}", "text": text if not reason else "",
                        "raw": raw.decode("utf-8", "replace") if reason else "", "reason": reason})
    return out


def _split(ds: ray.data.Dataset, column: str):
    ds = ds.materialize()
    return ds.filter(lambda r: r[column] == ""), ds.filter(lambda r: r[column] != ""), ds.count()


def ingest(ctx: StageContext) -> StageResult:
    files = [p for s in ctx.config.sources for p in source_files(s)]
    rows = ray.data.from_items([{"path": p} for p in files], override_num_blocks=len(files)).flat_map(_parse_file)
    ok, bad, total = _split(rows, "reason")
    ok.select_columns(["id", "text"]).write_parquet(str(ctx.output))
    bad.select_columns(["id", "raw", "reason"]).write_parquet(str(ctx.aside("rejects")))
    return StageResult(total, ok.count(), {"rejected": bad.count()})


def _normalize(batch: dict) -> dict:
    texts = [" ".join(t.split()) for t in batch["text"]]
    batch["text"] = texts
    batch["reason"] = ["" if t else "empty after whitespace normalization" for t in texts]
    return batch


def normalize(ctx: StageContext) -> StageResult:
    if ctx.config.normalize.min_chars == 99999:  # a way for tests to make a stage fail for real
        raise RuntimeError("planted failure")
    ds = ray.data.read_parquet(str(ctx.input_output("ingest"))).map_batches(_normalize, batch_format="numpy")
    ok, dropped, total = _split(ds, "reason")
    ok.select_columns(["id", "text"]).write_parquet(str(ctx.output))
    dropped.write_parquet(str(ctx.aside("dropped")))
    return StageResult(total, ok.count(), {"dropped": dropped.count()})


def _dedup_group(group: dict) -> dict:
    order = sorted(range(len(group["id"])), key=lambda i: group["id"][i])
    kept = group["id"][order[0]]
    return {"id": [group["id"][i] for i in order], "text": [group["text"][i] for i in order],
            "kept_id": ["" if k == 0 else kept for k in range(len(order))]}


def dedup(ctx: StageContext) -> StageResult:
    ds = ray.data.read_parquet(str(ctx.input_output("normalize")))
    ds = groupby(ds, "text", parquet_bytes(parquet_files(ctx.input_output("normalize"))), ctx.config.ray)
    ds = ds.map_groups(_dedup_group, batch_format="numpy")
    ok, dups, total = _split(ds, "kept_id")
    ok.select_columns(["id", "text"]).write_parquet(str(ctx.output))
    dups.select_columns(["id", "kept_id"]).write_parquet(str(ctx.aside("duplicates")))
    return StageResult(total, ok.count(), {"duplicate": dups.count()})


def report(ctx: StageContext) -> StageResult:
    table = pq.read_table(str(ctx.input_output("dedup")))
    (ctx.output / "report.json").write_text(json.dumps({"documents": table.num_rows}))
    return StageResult(table.num_rows, table.num_rows)


def mini_stages(normalize_run=normalize, code=("minipipeline",)) -> tuple[Stage, ...]:
    return (
        Stage("ingest", (), "sources", ingest, code=code, external=raw_files_identity),
        Stage("normalize", ("ingest",), "normalize", normalize_run, code=code),
        Stage("dedup", ("normalize",), "dedup", dedup, code=code),
        Stage("report", ("dedup",), "tokenize", report, code=code),
    )


def write_inputs(folder: Path) -> dict:
    """Two jsonl files: 7 good documents (2 exact duplicates after whitespace, 1 empty), 2 bad lines."""
    folder.mkdir(parents=True, exist_ok=True)
    a = [{"text": "the first  document"}, {"text": "a second one"}, {"text": "   "}, {"text": "the first document"}]
    b = [{"text": "a third\tdocument"}, {"text": "a second one"}, {"text": 'backslash \\ "quote"'}]
    (folder / "a.jsonl").write_text("\n".join(json.dumps(r) for r in a) + "\n{not json\n")
    (folder / "b.jsonl").write_text("\n".join(json.dumps(r) for r in b) + '\n{"no_text": 1}\n')
    return {"lines": 9, "rejected": 2, "dropped": 1, "duplicate": 2, "kept": 4}


def slow_normalize(ctx: StageContext) -> StageResult:
    """Writes part of an output, then blocks: the kill test stops the process here."""
    (ctx.output / "part-0.parquet").write_bytes(b"half")
    (Path(ctx.config.workdir) / "normalize-started").write_text(str(ctx.folder))
    time.sleep(600)
    raise AssertionError("should have been killed")

"""What a completed stage folder holds, written down when it is committed and checked before it is reused.

A cache hit is only as good as the files behind it: a workdir copied in part, an output deleted to free
disk, an object-store lifecycle rule, a truncated copy. So the runner writes `files.json` beside every
manifest: each file of the stage's folder (its output and every set-aside folder) with its size and, for
Parquet and Arrow IPC files, its rows. Before an output is reused, `damage` compares the folder with that
list:

- quick (every cache hit): each listed file is there with its size, and the output folder holds no file
  the list does not name. A stat per file, nothing read.
- full (`--verify`): also every Parquet and Arrow file read to the end, its rows against the list: what a
  same-size corruption would take.

The paths are relative to the stage folder, so the list moves with the workdir.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FILES = "files.json"
NOT_LISTED = {"manifest.json", FILES, "stage.log"}  # the folder's own records, rewritten in place


def rows_of(path: Path, full: bool = False) -> int | None:
    """Rows of a Parquet (from its footer) or Arrow IPC file (from its batches' headers); None for other files.
    `full`: every column of every row group or batch decoded, which raises on damaged data."""
    if path.suffix == ".parquet":
        if full:
            return pq.read_table(path).num_rows
        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix == ".arrow":
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            if full:
                return reader.read_all().num_rows
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    return None


def listed_files(folder: Path, under: Path | None = None) -> list[Path]:
    """The files of a stage folder (or of its subfolder `under`) that its list holds: all but its manifest, the
    list itself, its log and hidden files; sorted."""
    out = []
    for path in sorted(p for p in (under or folder).rglob("*") if p.is_file()):
        relative = path.relative_to(folder)
        if str(relative) not in NOT_LISTED and not any(part.startswith(".") for part in relative.parts):
            out.append(path)
    return out


def list_files(folder: Path) -> list[dict]:
    """Every listed file of a stage folder: path, bytes, rows."""
    out = []
    for path in listed_files(folder):
        entry = {"path": str(path.relative_to(folder)), "bytes": path.stat().st_size}
        try:
            rows = rows_of(path)
        except (OSError, pa.ArrowException):  # not ours to judge at commit: its size is still listed
            rows = None
        if rows is not None:
            entry["rows"] = rows
        out.append(entry)
    return out


def write_list(folder: Path) -> dict:
    """files.json in `folder`; returns its totals for the manifest."""
    files = list_files(folder)
    (folder / FILES).write_text(json.dumps(files, indent=0))
    return {"count": len(files), "bytes": sum(f["bytes"] for f in files)}


def damage(folder: Path, full: bool = False) -> str | None:
    """Why the completed stage folder cannot be used as it is, naming the file and where it was expected;
    None when it matches its list. A folder committed before lists were written is checked for its
    output folder only."""
    if not folder.is_dir():
        return f"{folder}: the stage folder is missing"
    listing = folder / FILES
    if not listing.is_file():
        return None if (folder / "output").is_dir() else f"{folder / 'output'}: missing"
    try:
        files = json.loads(listing.read_text())
    except json.JSONDecodeError as exc:
        return f"{listing}: not valid JSON ({exc})"
    for entry in files:
        path = folder / entry["path"]
        if not path.is_file():
            return f"{path}: missing ({entry['bytes']} bytes listed in {FILES})"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path}: {size} bytes, {entry['bytes']} listed in {FILES} (truncated or replaced)"
        if full and "rows" in entry:
            try:
                rows = rows_of(path, full=True)
            except (OSError, pa.ArrowException) as exc:
                return f"{path}: cannot be read ({type(exc).__name__}: {exc})"
            if rows != entry["rows"]:
                return f"{path}: {rows} rows, {entry['rows']} listed in {FILES}"
    listed = {entry["path"] for entry in files}
    output = folder / "output"
    for path in listed_files(folder, output) if output.is_dir() else []:
        if str(path.relative_to(folder)) not in listed:
            return f"{path}: not listed in {FILES} (a later stage would read it as part of the output)"
    return None

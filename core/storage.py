"""Where data lives: a local folder, a shared mount, or a URI that a pyarrow filesystem serves.

Two kinds of path in a config, because they need different things from storage:

- Inputs that are only read (the sources' raw dumps): any URI pyarrow knows (`s3://`, `gs://`,
  `abfs://`, `hdfs://`, `file://`), or that fsspec knows, or a plain path. 800 GB of dumps sit
  in a bucket; the ingest tasks stream them from there on whatever node they run.
- Folders the pipeline writes and commits (the workdir, train.storage, the sample corpus, the
  tokenizer files): a POSIX file system every node mounts (a local folder on one machine, FSx for
  Lustre or NFS on a cluster), given as a path or a `file://` URI. The workdir contract commits a
  stage by an atomic rename, DeepSpeed writes one checkpoint file per rank and the loader
  memory-maps the token shards: none of that exists on an object store. A bucket goes behind the
  mount instead (FSx for Lustre's S3 data repository, docs/cluster.md).

MLflow's artifact store is the third case: `mlflow.artifact_location` takes any URI MLflow
writes to (s3://, gs://, file://), passed to MLflow as is.
"""

from __future__ import annotations

import glob
import os
import re
import urllib.parse
from typing import BinaryIO, NamedTuple

import pyarrow.fs as pafs

_GLOB_CHARS = re.compile(r"[*?\[]")


def is_uri(path: str) -> bool:
    return "://" in path


def local_path(path: str) -> str:
    """A path or `file://` URI as an absolute local path; ValueError for any other URI."""
    if not is_uri(path):
        return os.path.abspath(os.path.expanduser(path))
    parsed = urllib.parse.urlparse(path)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ValueError(
            f"{path!r} is not a file system path: this folder is written with atomic renames, per-rank "
            "files and memory maps, so it must be a local folder or a mount every node shares (NFS, FSx for "
            "Lustre), as a path or file:// URI; put a bucket behind the mount (docs/cluster.md)")
    return urllib.parse.unquote(parsed.path)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem serving a URI (pyarrow's own, else fsspec's) and the path on it."""
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # pyarrow raises ArrowInvalid for an unknown scheme, OSError for a missing library
        pyarrow_error = exc
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"no filesystem for {uri!r}: pyarrow says {pyarrow_error}; fsspec says {exc}") from None
    return PyFileSystem(FSSpecHandler(fs)), path


class Listing(NamedTuple):
    files: list[str]  # to read, sorted
    refused: dict[str, str]  # named by the pattern but not read: path -> why


def expand(pattern: str) -> list[str]:
    """The files a path or glob names, sorted, each once (`**` crosses folders). URIs stay URIs. Never a link out
    of the pattern's folder, nor anything but a regular file: `listing` says which were left out, and why."""
    return listing(pattern).files


def listing(pattern: str) -> Listing:
    """The files a path or glob names, and those refused. On a local or shared folder, anyone who can write
    there can plant a link (`books/zz.txt -> ~/.ray/auth_token`), and the readers would follow it into a document
    or a reject's `head`: a file that resolves outside the folder above the first wildcard (the named file's
    folder, for a path without one) is refused, and so is a FIFO, device, socket or broken link, which no reader
    can read. A link that stays inside that folder is read. An object store holds objects, never links."""
    local = not is_uri(pattern) or urllib.parse.urlparse(pattern).scheme == "file"
    if not local:
        return Listing(_matches(pattern), {})
    first = _GLOB_CHARS.search(pattern)
    root = os.path.realpath(local_path(os.path.dirname(pattern[: first.start()] if first else pattern)))
    files, refused = [], {}
    for path in _matches(pattern):
        real = os.path.realpath(local_path(path))
        if os.path.commonpath([real, root]) != root:
            refused[path] = (f"resolves through a symbolic link to {printable(real)}, outside the source's folder: "
                             "not read")
        elif not os.path.isfile(real):
            refused[path] = "not a regular file (a FIFO, device, socket or broken link): not read"
        else:
            files.append(path)
    return Listing(files, refused)


def printable(path: str) -> str:
    """A path as text that UTF-8, so Arrow and a terminal, can hold. A file name is bytes: one that is not UTF-8
    comes to Python with its bad bytes as lone surrogates, which would stop the Parquet write of any row naming
    it; here those bytes read as `\\xff` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _matches(pattern: str) -> list[str]:
    """Everything but folders that a path or glob names, sorted."""
    if not is_uri(pattern):
        return sorted(p for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p))
    first = _GLOB_CHARS.search(pattern)
    if first is None:  # one file
        fs, path = filesystem(pattern)
        return [pattern] if fs.get_file_info(path).type in (pafs.FileType.File, pafs.FileType.Unknown) else []
    prefix = pattern[: pattern.rfind("/", 0, first.start()) + 1]  # the URI of the folder above the first wildcard
    fs, base = filesystem(prefix)
    base = base.rstrip("/")
    wanted = re.compile(_translate(pattern[len(prefix):]))
    found = []
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)):
        rest = info.path[len(base):].lstrip("/")
        if info.type in (pafs.FileType.File, pafs.FileType.Unknown) and wanted.fullmatch(rest):
            found.append(prefix + rest)
    return sorted(found)


def _translate(pattern: str) -> str:
    """A glob as a regex where `*`, `?` and `[...]` stay inside one folder and `**` crosses folders."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def size(path: str) -> int:
    return stat(path)[0]


def stat(path: str) -> tuple[int, int | None]:
    """(size in bytes, modification time in ns; None where the filesystem keeps none)."""
    if not is_uri(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    fs, inner = filesystem(path)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(path)
    return info.size, info.mtime_ns


def open_input(path: str) -> BinaryIO:
    """A binary stream of the file's bytes as stored: never decompressed here (pyarrow would, by
    extension), so that the readers see a cut .zst or .gz and reject it with its reason."""
    if not is_uri(path):
        return open(path, "rb")
    fs, inner = filesystem(path)
    return fs.open_input_stream(inner, compression=None)

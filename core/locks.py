"""One run at a time per workdir: an exclusive `flock` on WORKDIR/.lock, held for the whole run.

Two runs on one workdir (a base run and an ablation submitted together, or a resubmit after Ctrl-C that left
the first job running) would remove each other's `.partial-*` folders and share run folders. The second run
stops instead, naming the first. The kernel drops a `flock` when its process dies, however it dies, so a lock
is never stale. Only the note of who held it can be: a run that finds a note but no lock takes over, and says
so. FSx for Lustre takes `flock` when mounted with `-o flock`, the default of its client. A folder on NFS without
`flock` support would refuse the lock: the run then stops with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Iterator

LOCK_FILE = ".lock"


class WorkdirBusy(RuntimeError):
    """Another run holds the workdir, or its lock file is not one a run made; str() is the command line's one line."""


@contextlib.contextmanager
def hold(folder: str | os.PathLike, what: str) -> Iterator[str | None]:
    """Hold `folder`'s lock while the block runs (`what`: this run, for the note another run reads). Yields the
    note of a run that died holding it (taken over), else None; WorkdirBusy while another run holds it."""
    path = Path(folder) / LOCK_FILE
    try:  # never through a link: one planted in a shared workdir would have its target's head printed, then emptied
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise WorkdirBusy(f"{path} is a symbolic link (to {os.readlink(path)}), not a lock a run made: not opened; "
                          "remove it, or give this run a --workdir of its own") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a run that has not written its note yet"
            raise WorkdirBusy(f"workdir {folder} is in use by another run ({holder}): wait for it to end, "
                              "or give this run a --workdir of its own") from None
        stale = os.pread(fd, 4096, 0).decode(errors="replace").strip() or None
        note = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: {what}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode(), 0)
        try:
            yield stale
        finally:
            os.ftruncate(fd, 0)  # a clean end leaves no note: a note without a lock is a run that died
    finally:
        os.close(fd)  # and with it the lock

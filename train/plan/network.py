"""Which network NCCL chose, checked where EFA is configured.

A cluster whose NCCL quietly fell back to TCP sockets still trains, at a fraction of its speed:
each OPT-175B node moves about a terabyte per step. The image (Dockerfile) sets `FI_PROVIDER=efa`
and writes NCCL's start-up log to a file per process (`NCCL_DEBUG=INFO`, `NCCL_DEBUG_SUBSYS=INIT,NET`,
`NCCL_DEBUG_FILE`); after the first collective of a job that spans nodes, every rank reads its own
log: the aws-ofi-nccl plugin names the libfabric provider it selected ("Selected Provider is efa"),
and NCCL the network it uses ("Using network Libfabric" or "Using network Socket"). Anything but
EFA fails the start-up with what was found, instead of a run that is ten times slower.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

PROVIDER = re.compile(r"selected provider is ([\w-]+)", re.IGNORECASE)
# libfabric's EFA provider: "efa", or "efa-direct" where the plugin names the direct-path fabric it took
# (libfabric 2.x has both; aws-ofi-nccl logs the selected one's name).
EFA_PROVIDERS = ("efa", "efa-direct")
NETWORK = re.compile(r"Using network ([\w ]+?)\s*$", re.MULTILINE)


def nccl_choice(log: str) -> tuple[str | None, str | None]:
    """(libfabric provider, NCCL network) named in an NCCL debug log, either None when not there."""
    provider, network = PROVIDER.search(log), NETWORK.search(log)
    return (provider.group(1).lower() if provider else None, network.group(1) if network else None)


def debug_file(pattern: str, host: str | None = None, pid: int | None = None) -> Path:
    """NCCL_DEBUG_FILE's name for this process (NCCL substitutes %h and %p)."""
    return Path(pattern.replace("%h", host or socket.gethostname()).replace("%p", str(pid or os.getpid())))


def efa_problem(environ=os.environ, spans_nodes: bool = True) -> str | None:
    """Why NCCL is not on EFA here, or None (also None where nothing says EFA is meant: no FI_PROVIDER=efa,
    or a job on one node, whose traffic stays on NVLink)."""
    if environ.get("FI_PROVIDER") != "efa" or not spans_nodes:
        return None
    pattern = environ.get("NCCL_DEBUG_FILE")
    if not pattern or environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return ("FI_PROVIDER=efa, but NCCL's log is off (NCCL_DEBUG=INFO and NCCL_DEBUG_FILE, as the Dockerfile "
                "sets them): which network NCCL chose cannot be checked")
    path = debug_file(pattern)
    log = path.read_text(errors="replace") if path.is_file() else ""
    provider, network = nccl_choice(log)
    if provider in EFA_PROVIDERS:
        return None
    return (f"NCCL is not using EFA on {socket.gethostname()}: libfabric provider {provider or 'none'}, network "
            f"{network or 'not logged'} (NCCL's log: {path}). Check the EFA devices in the container "
            "(--device=/dev/infiniband, --ulimit memlock=-1:-1, cluster.yaml) and the aws-ofi-nccl plugin on "
            "LD_LIBRARY_PATH")

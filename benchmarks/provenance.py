"""What every benchmark prints first: the commit it measured and the machine it ran on."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The short hash of the checked-out commit (uncommitted changes are not in it: commit first)."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def machine() -> str:
    return platform.processor() or platform.machine()

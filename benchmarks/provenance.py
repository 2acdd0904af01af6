"""What every benchmark prints first: the commit it measured and the machine it ran on, down to the CPU's model
and the instruction sets that change our speed (core/cpu.py): hosts of one machine kind ran our matmuls 2.5-4x
apart, so a figure without its CPU cannot be compared with another."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cpu import isa_limits, numpy_kernels, this_cpu, torch_kernels  # noqa: E402


def commit() -> str:
    """The short hash of the checked-out commit (uncommitted changes are not in it: commit first)."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def machine() -> str:
    """The CPU in one line: model, cores, ISA features (and the environment's ISA limits, if any)."""
    return "; ".join(filter(None, [this_cpu().describe(), isa_limits()]))


def header() -> str:
    """A benchmark's first lines: the commit, the CPU, and what torch and numpy make of it."""
    return (f"commit {commit()}; Python {platform.python_version()}\n"
            f"CPU: {machine()}\n"
            f"{torch_kernels()}; {numpy_kernels()}")


if __name__ == "__main__":
    print(header())

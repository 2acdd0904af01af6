"""The node health probe (train/health.py) on this machine: its matmul rate called cold and warm, its memory test,
NVML's counters, and the whole check of this node through a local Ray, as the training stage runs it.

    .venv/bin/python benchmarks/bench_health.py        # on a GPU machine: every GPU; on a CPU: the CPU

The rate a healthy device reaches in the probe is what `REFERENCE_TFLOPS` holds (a GPU's verdict is a fraction
of it), so a new GPU kind is measured with this before its row is added.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402
from train import records  # noqa: E402
from train.config import HealthConfig  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it):
    no flags, and --help prints what the script measures."""
    return argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def main() -> int:
    parser().parse_args()
    print(provenance.header(), flush=True)
    import ray
    import torch

    from train import health

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [torch.device("cuda", i) for i in range(gpus)] or [torch.device("cpu")]
    dtype = torch.bfloat16 if gpus else torch.float32
    print("| device | matmul, 1st call (TFLOP/s) | 2nd | 3rd | memory test | seconds |")
    print("|---|---|---|---|---|---|")
    for d in devices:
        rates = [health._matmul_tflops(d, dtype) for _ in range(3)]
        began = time.perf_counter()
        ok = health._memory_ok(d, None if gpus else 256)
        print(f"| {torch.cuda.get_device_name(d) if gpus else 'cpu'} {d} | {rates[0]:.1f} | {rates[1]:.1f} | "
              f"{rates[2]:.1f} | {'ok' if ok else 'BAD'} | {time.perf_counter() - began:.1f} |")
    print(f"NVML: {health._nvml_problems() if gpus else 'no GPU'}")
    ray.init(include_dashboard=False)
    try:
        nodes = health.trainable_nodes(1, 1 if gpus else 0)
        run = Path(tempfile.mkdtemp())
        began = time.perf_counter()
        checked = health.check(run, nodes, HealthConfig(min_fraction=0.5, max_excluded_fraction=0.25), population=len(nodes))
        print(f"check of {len(nodes)} node(s): {time.perf_counter() - began:.1f} s; excluded {checked.excluded}, "
              f"refused {checked.refused}, systemic {checked.systemic}")
        for row in records.read(run, records.PROBE):
            print(json.dumps(row))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

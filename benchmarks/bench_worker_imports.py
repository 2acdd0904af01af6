"""What a training worker imports before its ZeRO engine's first step, with DeepSpeed's Muon module eager and as
DeepSpeed imports it.

    .venv/bin/python benchmarks/bench_worker_imports.py [--rounds 5]

Each side in a fresh Python, the two in turns (a 2-core cloud machine's speed drifts): torch, then DeepSpeed, a
torch AdamW (whose constructor imports torch._dynamo) and DeepSpeed's Muon module, which every ZeRO engine imports
(`is_zero_supported_optimizer`). "eager": `train.deepspeed_import.import_deepspeed`, as a worker starts
(train/loop/__init__.py), which imports that module with torch.compile off; "as DeepSpeed does": DeepSpeed imported
as that function did before (without MLflow), and the module's `torch.compile` decorators resolve their backend
(inductor) as DeepSpeed imports it. Reports the median seconds of each side, after torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]

SIDE = """
import json, sys, time
import torch
t0 = time.perf_counter()
if sys.argv[1] == "eager":
    from train.deepspeed_import import import_deepspeed
    import_deepspeed()
else:  # as import_deepspeed did before: without MLflow, the Muon module left to DeepSpeed
    sys.modules["mlflow"] = None
    import deepspeed
    del sys.modules["mlflow"]
torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
import deepspeed.runtime.zero.muon.muon_optimizer
from deepspeed.runtime.zero.muon import original_muon
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "compiled": hasattr(original_muon.muon_update, "_torchdynamo_orig_callable")}))
"""


def side(name: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SIDE, name], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return json.loads(out.stdout.splitlines()[-1])


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds of the two sides in turns")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    seen: dict[str, list[dict]] = {"as DeepSpeed does": [], "eager": []}
    for _ in range(args.rounds):
        for name in seen:
            seen[name].append(side("compiled" if name != "eager" else "eager"))
    base = statistics.median(r["seconds"] for r in seen["as DeepSpeed does"])
    print("| Muon's module | median s after torch | range | kernels compiled | against DeepSpeed's import |")
    print("|---|---:|---:|---|---:|")
    for name, rows in seen.items():
        times = [r["seconds"] for r in rows]
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f}-{max(times):.2f} | "
              f"{'yes' if all(r['compiled'] for r in rows) else 'no'} | {statistics.median(times) / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

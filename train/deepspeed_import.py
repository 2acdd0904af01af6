"""DeepSpeed imported without MLflow, at the start of each training worker.

`import deepspeed` imports its autotuner (deepspeed/runtime/config.py -> deepspeed/autotuning), which imports mlflow
if it can, to log tuning trials we never run. MLflow's own imports (its GenAI judges, pandas) made a Ray Train
worker's DeepSpeed and loop imports 0.74 s against 0.16 s without them (2 cores; 1.2 s in a bare process, which has
no pandas yet): a cost every Ray Train job pays per worker and again per restart, the screen's proxy jobs and the
tests' many small jobs most of all (docs/benchmarks.md). Nothing in a worker uses MLflow; the driver tracks (core/tracking.py)."""

from __future__ import annotations

import sys


def import_deepspeed() -> None:
    """Import DeepSpeed with `import mlflow` failing for that import only: the autotuner then takes itself to have
    no MLflow (`has_mlflow = False`), the one place DeepSpeed reads it. A later `import mlflow` in this process
    works as ever. Where MLflow or DeepSpeed is already imported (the driver, a test's process), nothing changes."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # the import system's mark for "not importable": ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]

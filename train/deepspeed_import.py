"""DeepSpeed imported without MLflow, and its Muon optimizer without inductor, at the start of each training worker.

`import deepspeed` imports its autotuner (deepspeed/runtime/config.py -> deepspeed/autotuning), which imports mlflow
if it can, to log tuning trials we never run. MLflow's own imports (its GenAI judges, pandas) made a Ray Train
worker's DeepSpeed and loop imports 0.74 s against 0.16 s without them (2 cores; 1.2 s in a bare process, which has
no pandas yet): a cost every Ray Train job pays per worker and again per restart, the screen's proxy jobs and the
tests' many small jobs most of all (docs/benchmarks.md). Nothing in a worker uses MLflow; the driver tracks (core/tracking.py).

Every ZeRO engine imports DeepSpeed's Muon optimizer (`is_zero_supported_optimizer`, and ZeRO-1/2's
`average_tensor`, unguarded), whose module decorates its kernels with `torch.compile`: resolving that backend
imports inductor, 0.8 s at rest in each worker beyond the torch._dynamo that torch's optimizers import anyway.
We never run Muon (train/optim.py: AdamW)."""

from __future__ import annotations

import os
import sys


def import_deepspeed() -> None:
    """Import DeepSpeed with `import mlflow` failing for that import only: the autotuner then takes itself to have
    no MLflow (`has_mlflow = False`), the one place DeepSpeed reads it. A later `import mlflow` in this process
    works as ever. Then its Muon module, eager (import_muon_eager). Where MLflow or DeepSpeed is already imported (the
    driver, a test's process), nothing changes."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # the import system's mark for "not importable": ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]
    import_muon_eager()


def import_muon_eager() -> None:
    """Import DeepSpeed's Muon module with torch.compile off for that import only (`TORCHDYNAMO_DISABLE`, which
    torch._dynamo reads at each `torch.compile`): its decorators then return its kernels as they are, eager, and
    no backend is resolved. Later `torch.compile` calls (`train.compile`) compile as ever."""
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before

"""What DeepSpeed's optimizers hold per parameter, measured on real engines, against the layout planner.

    .venv/bin/python benchmarks/state_bytes.py

Each setting's engine is built on 2 and on 4 gloo ranks for a 2-layer and a 10-layer tiny model; the bytes
alive at the end of the backward pass and at the end of the optimizer's step, in a step after the first,
give what it holds per parameter at its peak (tests/test_parallel.py's `_state_bytes` and `per_parameter`,
which the suite runs for four of these settings on 4 ranks). Printed beside `train/plan/layout.py`'s
`state_bytes`, as a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

# ZeRO-3 partitions the tiny model's matrices only with the persistence threshold at 0 (tests/test_parallel.py)
WHOLE_MATRICES = ("zero_optimization", "stage3_param_persistence_threshold", 0)
SETTINGS = [
    (("bf16", 1, True, ("bf16", "immediate_grad_update", False)), "bf16, 1, pipeline engine (BF16_Optimizer), DeepSpeed's default"),
    (("bf16", 1, True), "bf16, 1, pipeline engine, immediate_grad_update (train/optim.py)"),
    (("bf16", 1, False), "bf16, 1, no pipeline (BF16_Optimizer)"),
    (("fp16", 1, False), "fp16, 1 (DeepSpeedZeroOptimizer)"),
    (("fp16", 2, False), "fp16, 2"),
    (("bf16", 2, False), "bf16, 2 (fp32 gradient sums)"),
    (("fp16", 3, False, WHOLE_MATRICES), "fp16, 3 (DeepSpeedZeroOptimizer_Stage3)"),
    (("bf16", 3, False, WHOLE_MATRICES), "bf16, 3"),
]


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it):
    no flags, and --help prints what the script measures."""
    return argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def main() -> None:
    parser().parse_args()
    print(provenance.header(), flush=True)
    from test_parallel import _state_bytes, per_parameter, run_ranks

    from train.plan.layout import state_bytes

    print("| precision, ZeRO stage (DeepSpeed's optimizer) | dp | measured B per parameter | planner |")
    print("|---|---:|---:|---:|")
    for dp in (2, 4):
        measured = run_ranks(dp, _state_bytes, [setting for setting, _ in SETTINGS])[0]
        for (setting, label), (small, big) in zip(SETTINGS, measured):
            counted = sum(state_bytes(setting[0], setting[1], dp=dp).values())
            print(f"| {label} | {dp} | {per_parameter(small, big):.2f} | {counted:.2f} |")


if __name__ == "__main__":
    main()

"""What DeepSpeed's optimizers hold per parameter, measured on real engines, against the layout planner.

    .venv/bin/python benchmarks/state_bytes.py

Each setting's engine is built on 2 gloo ranks for a 2-layer and a 10-layer tiny model; the slope of the
bytes alive at the end of the optimizer's step is what it holds per parameter (tests/test_parallel.py's
`_state_bytes`, which the suite runs for four of these settings). Printed beside `train/plan/layout.py`'s
`state_bytes` at dp = 2, as a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SETTINGS = [
    (("bf16", 1, True, ("bf16", "immediate_grad_update", False)), "bf16, 1, pipeline engine (BF16_Optimizer), DeepSpeed's default"),
    (("bf16", 1, True), "bf16, 1, pipeline engine, immediate_grad_update (train/optim.py)"),
    (("bf16", 1, False), "bf16, 1, no pipeline (BF16_Optimizer)"),
    (("fp16", 1, False), "fp16, 1 (DeepSpeedZeroOptimizer)"),
    (("fp16", 2, False), "fp16, 2"),
    (("bf16", 2, False), "bf16, 2 (fp32 gradient sums)"),
    (("fp16", 3, False), "fp16, 3 (DeepSpeedZeroOptimizer_Stage3)"),
    (("bf16", 3, False), "bf16, 3"),
]


def main() -> None:
    from test_parallel import _state_bytes, run_ranks

    from train.plan.layout import state_bytes

    measured = run_ranks(2, _state_bytes, [setting for setting, _ in SETTINGS])[0]
    print("| precision, ZeRO stage (DeepSpeed's optimizer) | measured B per parameter | planner |")
    print("|---|---:|---:|")
    for (setting, label), ((small, small_bytes), (big, big_bytes)) in zip(SETTINGS, measured):
        counted = sum(state_bytes(setting[0], setting[1], dp=2).values())
        print(f"| {label} | {(big_bytes - small_bytes) / (big - small):.2f} | {counted:.1f} |")


if __name__ == "__main__":
    main()

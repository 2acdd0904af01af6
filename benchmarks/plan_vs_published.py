"""The layout planner's predictions against Narayanan et al. 2021 (arXiv 2104.04473), Table 2.

A 174.6B GPT (96 layers, 96 heads, d_model 12288, vocabulary 51200, sequences of 2048, batch 1536,
fp16, activation recompute, unfused attention) on DGX A100 nodes (8 x 200 Gb/s InfiniBand): ZeRO-3
without model parallelism against PTD-P (tensor 8 x pipeline 12, micro batch 1), as published and
as train/plan/layout.py predicts them. TFLOP/s count the recompute, as the paper does.

    .venv/bin/python benchmarks/plan_vs_published.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

from model.configs import get  # noqa: E402
from train.plan.hardware import GPUS, NODES  # noqa: E402
from train.plan.layout import Cluster, Layout, Prediction, Workload, predict  # noqa: E402

# GPUs: (ZeRO-3 TFLOP/s, its micro batch, PTD-P TFLOP/s), Table 2's 174.6B rows
TABLE_2 = {384: (144, 4, 153), 768: (88, 2, 149), 1536: (44, 1, 141)}
RECOMPUTE = 8 / 6  # the paper's FLOPs include the recomputed forward; ours are model FLOPs


def compare() -> list[tuple[int, tuple[int, int, int], Prediction, Prediction]]:
    """(GPUs, the published row, the predicted ZeRO-3 alone, the predicted PTD-P) per row of Table 2."""
    work = Workload(get("175b").replace(vocab_size=51200), 2048, 1536, "fp16", 300e9, fused_attention=False)
    node = NODES["dgx-a100"]
    gpu = GPUS[node.gpu]
    rows = []
    for gpus, (zero3, micro, ptdp) in TABLE_2.items():
        cluster = Cluster(gpu, gpus, node.gpus, gpu.nvlink_bytes_s * 8 / 1e9 * node.gpus, node.inter_gbps)
        rows.append((gpus, (zero3, micro, ptdp), predict(Layout(1, 1, gpus, 3, micro, "full"), work, cluster),
                     predict(Layout(8, 12, gpus // 96, 0, 1, "full"), work, cluster)))
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it):
    no flags, and --help prints what the script measures."""
    return argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def main() -> None:
    parser().parse_args()
    print(provenance.header(), flush=True)
    print("| GPUs | ZeRO-3 alone: published / predicted TFLOP/s | PTD-P: published / predicted | ZeRO-3 / PTD-P: published / predicted |")
    print("|---|---|---|---|")
    for gpus, (zero3, micro, ptdp), z, p in compare():
        print(f"| {gpus:,} | {zero3} / {z.tflops_per_gpu * RECOMPUTE:.0f} (micro batch {micro}) | {ptdp} / "
              f"{p.tflops_per_gpu * RECOMPUTE:.0f} | {zero3 / ptdp:.2f} / {z.tflops_per_gpu / p.tflops_per_gpu:.2f} |")

if __name__ == "__main__":
    main()

"""Effective training time (ETTR) of OPT-175B on our stack, projected at OPT's and Llama 3's failure rates.

    python benchmarks/goodput_at_scale.py [--detect-seconds 30] [--schedule-seconds 60] [--build-seconds 120]

First-order model (each failure costs a restart and, on average, half a checkpoint interval of work;
each checkpoint costs its blocked time):

    ETTR = 1 - rate x (restart + interval / 2) - blocked / interval

with the checkpoint interval that maximizes it, Young/Daly's sqrt(2 x blocked x MTBF), but never shorter
than four writes (a background save waits for the one before, and the shared file system is not to be
kept busy with checkpoints more than a quarter of the time). The terms at 175B (configs/opt-175b.yaml:
tensor 8 x pipeline 4 x data 31 on 992 A100s, 20 s per step from the planner, a checkpoint every 250
steps) are priced from docs/scale.md's figures. The restart's fixed terms cannot be measured here (the
chaos drill's are seconds on one machine: docs/benchmarks.md); the defaults are estimates for 124 nodes,
given as options. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math

import provenance  # benchmarks/provenance.py: a script's folder is on sys.path

STEP_SECONDS = 20.0  # the planner's best 175B layout (docs/scale.md)
CHECKPOINT_EVERY = 250  # steps, configs/opt-175b.yaml
FSX_GBPS = 24.0  # /fsx read and write (docs/scale.md)
CHECKPOINT_TB = 2.44  # fp16 weights + fp32 optimizer state, written once per save
# Every data-parallel replica (31) reads its stages' fp16 weights (350 GB) on a restart; the ZeRO-1
# optimizer shards (2.1 TB) are read once in all (pipe/module.py load_state_dir).
RESTART_READ_TB = 31 * 0.35 + 2.1
ONE_READ_TB = 0.35 + 2.1  # each stage's weights read once and broadcast over the data-parallel group (train/checkpoint_files.py)
STORAGE_DUTY = 4.0  # a checkpoint interval at least this many writes long: the shared FSx is not kept busy
HOST_COPY_GBPS = 10.0  # device to host, per GPU (PCIe 4 x16, pageable memory: a conservative figure)
PER_RANK_GB = 2.46  # one rank's share of a checkpoint
GPUS = 992
RATES = {  # failures per hour, as reported
    "OPT-175B (105 restarts in ~60 days, 992 GPUs)": 105 / (60 * 24),
    "Llama 3 405B (466 interruptions in 54 days, 16,384 GPUs)": 466 / (54 * 24),
    "Llama 3's per-GPU rate on our 992 GPUs": 466 / (54 * 24) * GPUS / 16384,
}


def ettr(rate_per_s: float, restart_s: float, interval_s: float, blocked_s: float) -> float:
    return 1 - rate_per_s * (restart_s + interval_s / 2) - blocked_s / interval_s


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule-seconds", type=float, default=60.0,
                   help="scheduling 992 workers on a replacement node set (the local drill's is seconds)")
    p.add_argument("--build-seconds", type=float, default=120.0,
                   help="model build, NCCL and DeepSpeed start-up at 992 ranks (not measurable here)")
    p.add_argument("--detect-seconds", type=float, default=30.0,
                   help="from a crash to Ray Train's restart (its health-check poll and the teardown)")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    fixed = args.detect_seconds + args.schedule_seconds + args.build_seconds
    read_s, read_once_s = RESTART_READ_TB * 1e3 / FSX_GBPS, ONE_READ_TB * 1e3 / FSX_GBPS
    write_s = CHECKPOINT_TB * 1e3 / FSX_GBPS
    floor = STORAGE_DUTY * write_s  # a background save every interval keeps FSx busy write_s of it
    setups = {"in place, every replica reads": (write_s, fixed + read_s),
              "in the background, every replica reads": (PER_RANK_GB / HOST_COPY_GBPS, fixed + read_s),
              "in the background, one read per stage": (PER_RANK_GB / HOST_COPY_GBPS, fixed + read_once_s)}
    configured = CHECKPOINT_EVERY * STEP_SECONDS
    print(f"restart: detection {args.detect_seconds:.0f} s + scheduling {args.schedule_seconds:.0f} + build "
          f"{args.build_seconds:.0f} + checkpoint read {read_s:.0f} ({RESTART_READ_TB:.1f} TB at {FSX_GBPS:g} GB/s; "
          f"{read_once_s:.0f} s read once per stage); checkpoint write {write_s:.0f} s; configured interval "
          f"{configured / 3600:.2f} h; shortest interval {floor / 3600:.2f} h (FSx busy at most 1/{STORAGE_DUTY:g} of the time)\n")
    print("| failure rate | MTBF h | checkpoint save, restart read | restart s | ETTR at the configured interval "
          "| best interval h (Young/Daly) | ETTR at the best |\n|---|---:|---|---:|---:|---:|---:|")
    for name, per_hour in RATES.items():
        rate = per_hour / 3600
        for how, (blocked_s, restart_s) in setups.items():
            best = max(math.sqrt(2 * blocked_s / rate), floor)
            print(f"| {name} | {1 / per_hour:.1f} | {how} | {restart_s:.0f} | "
                  f"{ettr(rate, restart_s, configured, blocked_s):.1%} | {best / 3600:.2f} | "
                  f"{ettr(rate, restart_s, best, blocked_s):.1%} |")


if __name__ == "__main__":
    main()

"""The plan for the real run (docs/scale.md), computed from the rates our benchmarks measured.

Nothing is run here: the per-core rates are the stage benchmarks' numbers (docs/benchmarks.md,
each named with its section), the model sizes come from model/configs.py, and the assumptions
that are not ours to measure (OPT's corpus size, OPT's MFU, FSx throughput) are named
constants. Change one and rerun:

    .venv/bin/python benchmarks/scale_plan.py [--nodes 1 4 16] [--mfu 0.47 0.35] [--fsx-gbps 24]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.configs import flops_per_token, get, param_count  # noqa: E402

# The corpus (opt-facts.md): ~800 GB of text, ~180B GPT-2 tokens after dedup.
TEXT_BYTES = 800e9
TOKENS = 180e9
DOC_BYTES = 4_000  # mean document size: an assumption (Pile-CC's is ~4 KB; OPT gave no count)

# Per-core stage rates measured on this repo's 2-vCPU x86_64 machine (docs/benchmarks.md):
# stage: (bytes of text per second per core, where it was measured, bytes it moves through FSx as a
# multiple of the text: read + write, and dedup's extra read of the documents for its join)
RATES = {
    "ingest": (54.9e6, "Corpus: ingest, stage on 1 CPU", 2),
    "normalize": (8.5e6, "Corpus: normalize, stage on 1 CPU (ftfy is the cost)", 2),
    # Dedup at 100k and 400k documents: 109 -> 436 MB in 32.8 -> 59.1 s on 2 cores: the marginal
    # rate, without the fixed start-up costs that dominate the small run.
    "dedup": ((436e6 - 109e6) / (59.1 - 32.8) / 2, "Dedup: the stage at 100k and 400k documents (marginal, per core)", 3),
}
TOKENS_PER_CORE_S = (790_537, "Tokenize: stage on 1 CPU")
BYTES_PER_TOKEN = TEXT_BYTES / TOKENS
VCPUS_PER_NODE = 96  # p4de.24xlarge; Ray counts vCPUs

# Dedup's shuffles (dedup/stage.py): every document's band rows (bands x (8-byte key + id + source
# + partition)), then every document's text twice (the verification join meets each pair's first,
# then its second document: both groupbys take all documents as well as the pairs).
BANDS, BAND_ROW_BYTES = 10, 8 + 40 + 8 + 8
# Tokenize's shuffle: one small row per document (key, source, id, where its tokens are).
TOKENIZE_ROW_BYTES = 8 + 8 + 40 + 24

# Training (OPT-175B as configs/opt-175b.yaml sets it up).
GPUS, PEAK_TFLOPS, GPU_GB = 992, 312.0, 80  # A100 80GB, dense fp16/bf16 peak
BATCH_TOKENS, SEQ, MICRO = 2_031_616, 2048, 1
TRAIN_TOKENS = 300e9
CHECKPOINT_EVERY = 250  # steps (configs/opt-175b.yaml)
KEEP_CHECKPOINTS = 3


def gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def hours(seconds: float) -> str:
    return f"{seconds / 3600:,.2f} h" if seconds >= 360 else f"{seconds / 60:,.1f} min"


def data_stages(nodes: list[int], fsx_bytes_s: float) -> None:
    docs = TEXT_BYTES / DOC_BYTES
    print(f"## Data stages: {gb(TEXT_BYTES)} of text, {TOKENS / 1e9:.0f}B tokens, ~{docs / 1e6:.0f}M documents "
          f"(mean {DOC_BYTES:,} bytes, assumed)\n")
    header = "| stage | rate per core (measured) | core-hours | " + " | ".join(f"wall, {n} node{'s' * (n > 1)}" for n in nodes) + \
             " | bytes through FSx | FSx floor |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for stage, (rate, _, io) in RATES.items():
        rows.append((stage, f"{rate / 1e6:.1f} MB/s", TEXT_BYTES / rate, io * TEXT_BYTES))
    tok_rate = TOKENS_PER_CORE_S[0]
    # tokenize reads the text, writes the tokens (uint16) per task, gathers them per bucket, packs shards
    rows.append(("tokenize", f"{tok_rate / 1e3:.0f}k tokens/s", TOKENS / tok_rate, TEXT_BYTES + 3 * 2 * TOKENS))
    total_core_s = 0.0
    for stage, rate, core_s, io in rows:
        total_core_s += core_s
        walls = " | ".join(hours(max(core_s / (n * VCPUS_PER_NODE), io / fsx_bytes_s)) for n in nodes)
        print(f"| {stage} | {rate} | {core_s / 3600:,.0f} | {walls} | {gb(io)} | {hours(io / fsx_bytes_s)} |")
    print(f"\nAll four: {total_core_s / 3600:,.0f} core-hours.\n")
    for stage, (_, where, _) in RATES.items():
        print(f"- {stage}: docs/benchmarks.md, \"{where}\"")
    print(f"- tokenize: docs/benchmarks.md, \"{TOKENS_PER_CORE_S[1]}\"\n")
    print("Shuffle volumes:\n")
    print(f"- dedup, candidates: {BANDS} band rows per document x {BAND_ROW_BYTES} B = {gb(docs * BANDS * BAND_ROW_BYTES)}")
    print(f"- dedup, verification join: every document's text, twice = {gb(2 * TEXT_BYTES)} (plus the pairs)")
    print(f"- tokenize: one {TOKENIZE_ROW_BYTES}-byte row per document = {gb(docs * TOKENIZE_ROW_BYTES)}; "
          f"the tokens ({gb(2 * TOKENS)} as uint16) move through files, not the shuffle\n")


def screen(mfus: list[float]) -> None:
    """The screen's proxy runs (configs/opt-175b.yaml): 8 subsets + the baseline, 3 seeds, 2000 steps of
    1M tokens of the 1.3B model, one 8-GPU node per run."""
    cfg = get("1.3b")
    runs, steps, batch, gpus = 9 * 3, 2000, 1_048_576, 8
    flops = flops_per_token(cfg, SEQ) * steps * batch
    print(f"## The screen: {runs} proxy runs of OPT-1.3B, {steps} steps x {batch:,} tokens each, one 8-GPU node per run\n")
    print("| MFU | one run | 27 runs, 8 at a time (the config) | 27 runs on 27 nodes |\n|---|---|---|---|")
    for mfu in mfus:
        run = flops / (gpus * PEAK_TFLOPS * 1e12 * mfu)
        print(f"| {mfu:.0%} | {hours(run)} | {hours(-(-runs // 8) * run)} | {hours(run)} |")
    print(f"\nEach mixture task holds its role's sample in memory: {steps} x {batch:,} tokens x {BYTES_PER_TOKEN:.1f} B x 1.5 "
          f"(oversampling) = {gb(steps * batch * BYTES_PER_TOKEN * 1.5)} of text.\n")


def training(mfus: list[float], fsx_bytes_s: float) -> None:
    cfg = get("175b")
    psi = param_count(cfg)
    d, layers, heads = cfg.d_model, cfg.n_layer, cfg.n_head
    states = 16 * psi / GPUS  # fp16 params (2) + fp16 grads (2) + fp32 master, Adam m, v (12), all sharded (ZeRO-3)
    layer_inputs = 2 * SEQ * MICRO * d * layers  # activation checkpointing keeps each block's input (fp16)
    one_layer = SEQ * MICRO * d * (34 + 5 * heads * SEQ / d)  # a block's activations while it is recomputed (Korthikanti et al.)
    gathered = 2 * 2 * (12 * d * d)  # ZeRO-3 gathers a block's fp16 weights; with prefetch, two blocks
    logits = 4 * SEQ * MICRO * cfg.vocab_size * 2  # fp32 logits and their gradient (only before the loss)
    total = states + layer_inputs + one_layer + gathered + logits
    print(f"## Training OPT-175B: {psi / 1e9:.1f}B parameters on {GPUS} A100 80GB, ZeRO-3, fp16, micro batch {MICRO}\n")
    print("| per GPU | bytes |\n|---|---|")
    print(f"| model states, 16 bytes x params / {GPUS} | {gb(states)} |")
    print(f"| checkpointed block inputs, {layers} x seq x d_model x 2 B | {gb(layer_inputs)} |")
    print(f"| one block's activations during its recompute | {gb(one_layer)} |")
    print(f"| two gathered blocks' fp16 weights (ZeRO-3 prefetch) | {gb(gathered)} |")
    print(f"| logits and their gradient, fp32 | {gb(logits)} |")
    print(f"| total, before allocator slack and NCCL buffers | {gb(total)} of {GPU_GB} GB |\n")
    fpt = flops_per_token(cfg, SEQ)
    step_flops = fpt * BATCH_TOKENS
    steps = TRAIN_TOKENS / BATCH_TOKENS
    print(f"{fpt / 1e12:.2f} TFLOP per token (model FLOPs, recompute not counted); a step of {BATCH_TOKENS:,} tokens "
          f"= {step_flops / 1e18:.2f} EFLOP; {steps:,.0f} steps for {TRAIN_TOKENS / 1e9:.0f}B tokens.\n")
    print("| MFU | TFLOP/s per GPU | step time | tokens/s | days for 300B tokens (pure compute) | checkpoint every |")
    print("|---|---|---|---|---|---|")
    for mfu in mfus:
        rate = GPUS * PEAK_TFLOPS * 1e12 * mfu
        step = step_flops / rate
        print(f"| {mfu:.0%} | {PEAK_TFLOPS * mfu:.0f} | {step:.1f} s | {BATCH_TOKENS / step / 1e3:,.0f}k | "
              f"{steps * step / 86400:.1f} | {hours(CHECKPOINT_EVERY * step)} |")
    ckpt = 14 * psi  # fp16 weights (2) + fp32 master and Adam m, v (12); gradients are not saved
    print(f"\nCheckpoint: 14 bytes x params = {ckpt / 1e12:.2f} TB ({ckpt / GPUS / 1e9:.2f} GB per rank, one file each); "
          f"write at {fsx_bytes_s / 1e9:.0f} GB/s of FSx: {ckpt / fsx_bytes_s:.0f} s; "
          f"{KEEP_CHECKPOINTS} kept: {KEEP_CHECKPOINTS * ckpt / 1e12:.1f} TB on /fsx.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16], help="p4de nodes running the data stages")
    parser.add_argument("--mfu", type=float, nargs="+", default=[0.47, 0.35],
                        help="model FLOPs utilisation (OPT reported 147 TFLOP/s = 47%% of an A100's peak)")
    parser.add_argument("--fsx-gbps", type=float, default=24.0,
                        help="FSx for Lustre aggregate throughput, GB/s (e.g. 48 TiB at 500 MB/s/TiB)")
    args = parser.parse_args()
    data_stages(args.nodes, args.fsx_gbps * 1e9)
    screen(args.mfu)
    training(args.mfu, args.fsx_gbps * 1e9)


if __name__ == "__main__":
    main()

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

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

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
    # Dedup at 400k and 3M documents (issue 19's stage): 435 -> 3,268 MB in 29.5 -> 144.3 s on 2 cores:
    # the marginal rate, without the fixed start-up costs that dominate the small run.
    "dedup": ((3268e6 - 435e6) / (144.3 - 29.5) / 2, "Dedup without the corpus in any shuffle (marginal, per core)", 3),
}
TOKENS_PER_CORE_S = (790_537, "Tokenize: stage on 1 CPU")
BYTES_PER_TOKEN = TEXT_BYTES / TOKENS
VCPUS_PER_NODE = 96  # p4de.24xlarge; Ray counts vCPUs

# Dedup's shuffles (dedup/stage.py), per unit, from `bench_dedup.py scale --docs 400000 --planted 0.1`
# (docs/benchmarks.md, "Dedup without the corpus in any shuffle"): each phase's bytes over what it scales with.
BANDS = 10
SHUFFLE_NOW = {
    "exact": 20.6e6 / 400_000,  # per document: its text hash, key, id, source; then each copy's key
    "candidates": 80.0e6 / ((400_000 - 5_095) * BANDS),  # per band row (band, partition, key) of each non-copy
    "candidate documents": 4.48e6 / (0.141 * 400_000),  # per candidate document: its key, the part that needs it
    # per byte of the candidate documents' text: the shingle sets (8 B a shingle) of those whose pair is
    # verified in another part, and the pairs
    "verification": 50.5e6 / (0.141 * 400_000 * 1088),
}
# The code before issue 19 (commit 57f9f91), the same run: band rows with ids and sources, and every
# document's text through both verification groupbys (2.2x the corpus).
SHUFFLE_BEFORE = {"candidates": 140.0e6 / (400_000 * BANDS), "verification": 960.7e6 / (400_000 * 1088)}
# The candidate documents' share, measured at 10% planted duplicates (1.3% exact copies): 14.1%,
# 1.6x the near-duplicate rate (a duplicate and its original are both candidates).
CANDIDATES_PER_NEAR_DUPLICATE = 0.141 / (0.1 - 5_095 / 400_000)
# Components: an edge per removed document (a verified pair or an exact copy; 18,608 for 18,486 removed
# at 400k) goes through each round's two groupbys (both directions, then one: 3 x 24 B), then the
# join with its label and the groupby by component (~2 x 100 B with the ids).
EDGE_ROUND_BYTES, EDGE_ASSEMBLY_BYTES = 3 * 24, 2 * 100
COMPONENT_ROUNDS = 15  # bench_dedup.py components: 14-15 rounds from 1M to 16M edges (docs/benchmarks.md)
# Tokenize's shuffle: one small row per document (key, source, id, where its tokens are).
TOKENIZE_ROW_BYTES = 8 + 8 + 40 + 24

# The screen's proxies and OPT-175B's checkpoints (configs/opt-175b.yaml); training's layout and speed are
# the layout planner's (python -m pipelines.plan).
GPUS, PEAK_TFLOPS, SEQ = 992, 312.0, 2048  # A100 80GB, dense fp16/bf16 peak
# The screen's schedules: (proxy runs, run times with 8 at a time) per screen of 8 subsets + the baseline, from
# `bench_screen.py power` (docs/benchmarks.md): its rounds replayed with 8 slots a round, at the configs' rule (ratio 2,
# alpha 0.05). The laptop's tiny proxy measured them; the 1.3B proxy's noise is not measured (no GPU lent): an assumption.
# (proxy runs, run times with 8 at a time) per screen: the power benchmark's replay of 12 draws
# (`bench_screen.py power`, docs/benchmarks.md), the adaptive schedule with 8 slots a round.
SCREEN_SCHEDULES = {"adaptive, seeds 2 up to 6 (the configs)": (23.7, 3.92), "fixed 3 seeds (before)": (27, 4),
                    "fixed 6 seeds": (54, 7)}
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
    dedup_shuffles()
    print(f"- tokenize: one {TOKENIZE_ROW_BYTES}-byte row per document = {gb(docs * TOKENIZE_ROW_BYTES)}; "
          f"the tokens ({gb(2 * TOKENS)} as uint16) move through files, not the shuffle\n")


def dedup_shuffles() -> None:
    """Dedup's bytes through Ray's object store at OPT's size and at 10x, before and after issue 19."""
    cases = [("800 GB (OPT's), 10% duplicates, 1.3% exact", TEXT_BYTES, 0.1, 0.013),
             ("10 TB, 40% duplicates, half of them exact", 10e12, 0.4, 0.2)]
    print("| dedup | " + " | ".join(c[0] for c in cases) + " |\n|---|" + "---|" * len(cases))
    rows: dict[str, list[float]] = {}
    for _, text, dup, exact in cases:
        docs = text / DOC_BYTES
        candidate = min(1.0, CANDIDATES_PER_NEAR_DUPLICATE * (dup - exact))
        now = {"exact": SHUFFLE_NOW["exact"] * docs,
               "candidates": SHUFFLE_NOW["candidates"] * docs * (1 - exact) * BANDS,
               "candidate documents": SHUFFLE_NOW["candidate documents"] * candidate * docs,
               "verification": SHUFFLE_NOW["verification"] * candidate * text,
               "components": dup * docs * (EDGE_ROUND_BYTES * COMPONENT_ROUNDS + EDGE_ASSEMBLY_BYTES)}
        before = SHUFFLE_BEFORE["candidates"] * docs * BANDS + SHUFFLE_BEFORE["verification"] * text
        for k, v in now.items():
            rows.setdefault(f"now: {k}", []).append(v)
        rows.setdefault("**now: total**", []).append(sum(now.values()))
        rows.setdefault("before (57f9f91): total", []).append(before)
        rows.setdefault("before / now", []).append(before / sum(now.values()))
    for name, values in rows.items():
        cells = [f"{v:.1f}x" if name == "before / now" else gb(v) for v in values]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nThe components: {COMPONENT_ROUNDS} rounds (measured: 14-15 from 1M to 16M edges, `bench_dedup.py components`); "
          f"their edges are one per removed document.\n")


def screen(mfus: list[float]) -> None:
    """The screen's proxy runs (configs/opt-175b.yaml): 8 subsets + the baseline, 2000 steps of 1M tokens of the
    1.3B model, one 8-GPU node per run, 8 at a time; adaptive seeds (2, up to 6) against fixed ones."""
    cfg = get("1.3b")
    steps, batch, gpus = 2000, 1_048_576, 8
    flops = flops_per_token(cfg, SEQ) * steps * batch
    print(f"## The screen: proxy runs of OPT-1.3B, {steps} steps x {batch:,} tokens each, one 8-GPU node per run, "
          f"8 at a time\n")
    print("| schedule | proxy runs | run times, 8 at a time | " + " | ".join(f"node-hours at {m:.0%} MFU | days at {m:.0%}"
                                                                          for m in mfus) + " |")
    print("|---|---|---|" + "---|---|" * len(mfus))
    for name, (runs, waves) in SCREEN_SCHEDULES.items():
        cells = []
        for mfu in mfus:
            run = flops / (gpus * PEAK_TFLOPS * 1e12 * mfu)
            cells += [f"{runs * run / 3600:,.0f}", f"{waves * run / 86400:.2f}"]
        print(f"| {name} | {runs:.1f} | {waves:.2f} | " + " | ".join(cells) + " |")
    print(f"\nEach mixture task holds its role's sample in memory: {steps} x {batch:,} tokens x {BYTES_PER_TOKEN:.1f} B x 1.5 "
          f"(oversampling) = {gb(steps * batch * BYTES_PER_TOKEN * 1.5)} of text.\n")


def checkpoints(fsx_bytes_s: float) -> None:
    """OPT-175B's checkpoints (the training layout, step time and memory are the planner's: python -m pipelines.plan)."""
    psi = param_count(get("175b"))
    ckpt = 14 * psi  # fp16 weights (2) + fp32 master and Adam m, v (12); gradients are not saved
    print(f"## Checkpoints of OPT-175B\n\n14 bytes x params = {ckpt / 1e12:.2f} TB ({ckpt / GPUS / 1e9:.2f} GB per rank "
          f"on {GPUS} GPUs); write at {fsx_bytes_s / 1e9:.0f} GB/s of FSx: {ckpt / fsx_bytes_s:.0f} s; "
          f"{KEEP_CHECKPOINTS} kept: {KEEP_CHECKPOINTS * ckpt / 1e12:.1f} TB on /fsx.")


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16], help="p4de nodes running the data stages")
    p.add_argument("--mfu", type=float, nargs="+", default=[0.47, 0.35],
                   help="model FLOPs utilisation (OPT reported 147 TFLOP/s = 47%% of an A100's peak)")
    p.add_argument("--fsx-gbps", type=float, default=24.0,
                   help="FSx for Lustre aggregate throughput, GB/s (e.g. 48 TiB at 500 MB/s/TiB)")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    data_stages(args.nodes, args.fsx_gbps * 1e9)
    screen(args.mfu)
    checkpoints(args.fsx_gbps * 1e9)


if __name__ == "__main__":
    main()

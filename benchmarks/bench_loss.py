"""The output layer and its loss a block at a time (model/loss.py) against F.linear then F.cross_entropy, the
whole logits at once (the baseline), in one process, alternating, on the shapes the laptop trains.

    python benchmarks/bench_loss.py [--threads 1] [--repeats 20]

Two rows per shape: the loss alone (forward and backward of the output layer and its cross-entropy) and a
whole training step of the tiny model (forward, backward, AdamW), so the ratio is what a proxy run or a seed
gains. Shapes: the screen's proxy (one micro-batch of 32 x 64 tokens, vocabulary 4,096) and the train stage's
(8 x 128 tokens per micro-batch and worker, vocabulary 4,096). One thread, as each of the screen's proxy
workers has. Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.configs import get  # noqa: E402
from model.loss import linear_cross_entropy  # noqa: E402
from model.opt import OPT  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

SHAPES = {"screen proxy": (32, 64), "train stage": (8, 128)}  # (sequences, tokens) per micro-batch
VOCAB = 4096


def whole_logits(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The baseline: what TokenEmbedding.output computed before model/loss.py."""
    return F.cross_entropy(F.linear(x, weight).reshape(-1, weight.size(0)).float(), targets.reshape(-1))


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def contenders(batch: int, seq: int) -> dict[str, dict[str, callable]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, 64, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, 64, generator=gen, requires_grad=True)
    targets = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    model = OPT(dataclasses.replace(get("tiny"), vocab_size=VOCAB), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)

    def loss_only(fn):
        return lambda: fn(x, weight, targets).backward()

    def step(fn):
        def run():
            loss = fn(model.hidden(ids[:, :-1]), model.decoder.embed_tokens.weight, ids[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return run

    return {"loss": {"whole logits": loss_only(whole_logits), "blockwise": loss_only(linear_cross_entropy)},
            "training step": {"whole logits": step(whole_logits), "blockwise": step(linear_cross_entropy)}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (a proxy worker has one)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls of each contender, alternating")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {args.threads}; median of {args.repeats} alternating repeats\n")
    print("| shape | what | whole logits (ms) | blockwise (ms) | blockwise / whole |")
    print("|---|---|---|---|---|")
    for name, (batch, seq) in SHAPES.items():
        for what, pair in contenders(batch, seq).items():
            times = {k: [] for k in pair}
            for fn in pair.values():
                fn()  # warm: the allocator, the kernels
            for _ in range(args.repeats):  # alternating, so a slow spell of the machine hits both
                for k, fn in pair.items():
                    times[k].append(timed(fn))
            base, ours = (statistics.median(times[k]) * 1e3 for k in ("whole logits", "blockwise"))
            print(f"| {name}, {batch} x {seq} tokens | {what} | {base:.1f} | {ours:.1f} | {ours / base:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

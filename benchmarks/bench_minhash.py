"""MinHash signatures per second per core: ours (numpy, whole batches) against datasketch and rensa.

    python benchmarks/bench_minhash.py [--docs 2000] [--kb 1 4 8.6] [--num-perm 128]

One process, one core, the same documents and num_perm for every contender, shingle building
included for all (lowercased word 5-grams; datasketch and rensa are given the shingles as
strings, the way their users build them):

- datasketch `MinHash.update` per shingle (the loop: the baseline the ratios are against),
- datasketch `MinHash.bulk` (its batch path, `update_batch` for every document),
- rensa `RMinHash.update` (Rust, per document),
- ours: `dedup.minhash.MinHasher.signatures` over batches of 500 documents.

Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corpus.sample import _rng, sentence  # noqa: E402
from dedup.minhash import MinHasher  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

BATCH = 500


def documents(count: int, kb: float) -> list[str]:
    out = []
    for i in range(count):
        rng, parts, size = _rng(11, kb, i), [], 0
        while size < kb * 1000:
            parts.append(sentence(rng))
            size += len(parts[-1]) + 1
        out.append(" ".join(parts))
    return out


def string_shingles(text: str, n: int = 5) -> list[bytes]:
    words = text.lower().split()
    return [" ".join(words[i : i + n]).encode() for i in range(max(len(words) - n + 1, 1))]


def datasketch_loop(texts: list[str], num_perm: int) -> None:
    from datasketch import MinHash

    for text in texts:
        m = MinHash(num_perm=num_perm, seed=1)
        for s in string_shingles(text):
            m.update(s)


def datasketch_bulk(texts: list[str], num_perm: int) -> None:
    from datasketch import MinHash

    MinHash.bulk([string_shingles(t) for t in texts], num_perm=num_perm, seed=1)


def rensa(texts: list[str], num_perm: int) -> None:
    from rensa import RMinHash

    for text in texts:
        m = RMinHash(num_perm=num_perm, seed=1)
        m.update([s.decode() for s in string_shingles(text)])
        m.digest()


def ours(texts: list[str], num_perm: int) -> None:
    hasher = MinHasher(num_perm=num_perm, ngram=5, seed=1)
    for lo in range(0, len(texts), BATCH):
        hasher.signatures(texts[lo : lo + BATCH])


CONTENDERS = {"datasketch loop (update)": datasketch_loop, "datasketch bulk (update_batch)": datasketch_bulk,
              "rensa RMinHash": rensa, "ours (numpy MinHasher)": ours}


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--kb", type=float, nargs="+", default=[1.0, 4.0, 8.6])
    p.add_argument("--num-perm", type=int, default=128)
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    print(f"{args.docs} documents per size, num_perm {args.num_perm}, word 5-grams; 1 core")
    print()
    print("| document size | contender | docs/s | vs datasketch loop |")
    print("|---|---|---|---|")
    for kb in args.kb:
        texts = documents(args.docs, kb)
        rates = {}
        for name, fn in CONTENDERS.items():
            sample = texts if name != "datasketch loop (update)" else texts[: max(args.docs // 10, 50)]
            t0 = time.perf_counter()
            fn(sample, args.num_perm)
            rates[name] = len(sample) / (time.perf_counter() - t0)
        for name, rate in rates.items():
            print(f"| {kb:g} KB | {name} | {rate:,.0f} | {rate / rates['datasketch loop (update)']:.1f}x |")


if __name__ == "__main__":
    main()

"""LSH banding chosen for recall at the threshold, and the band keys documents are grouped by.

A pair of documents with Jaccard J shares one band of r signature rows with probability J^r,
so it becomes a candidate (shares at least one of b bands) with probability
P(J) = 1 - (1 - J^r)^b. datasketch's MinHashLSH(threshold=0.95) balances false positives
against false negatives and, with 128 permutations, picks b=3, r=42: P(0.95) = 0.31, so it misses
two pairs in three that sit at the threshold. We want every pair >= threshold found and let the
exact-Jaccard check throw out the false candidates, so we choose the largest r (fewest false
candidates, cheapest to verify) whose P(threshold) still reaches `recall` (default 0.999).

For num_perm = 128 and threshold 0.95 that is b = 10 bands of r = 12 rows:
P(0.95) = 0.99958, P(0.90) = 0.964, P(0.80) = 0.51, P(0.50) = 0.0024.
"""

from __future__ import annotations

import numpy as np

from dedup.minhash import splitmix64


def candidate_probability(j: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - j**rows) ** bands


def choose_banding(num_perm: int, threshold: float, recall: float = 0.999) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm, P(threshold) >= recall and the most rows."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= recall:
            return bands, rows
    raise ValueError(f"no banding of {num_perm} permutations reaches recall {recall} at Jaccard {threshold}")


def band_keys(signatures: np.ndarray, bands: int, rows: int, seed: int = 0) -> np.ndarray:
    """(n_docs, bands) uint64: equal keys <=> equal rows in that band (up to a 2^-64 collision)."""
    n, num_perm = signatures.shape
    if bands * rows > num_perm:
        raise ValueError(f"{bands} bands x {rows} rows needs {bands * rows} permutations, the signatures have {num_perm}")
    rng = np.random.Generator(np.random.PCG64(seed))
    mult = rng.integers(0, 2**63, size=rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    sig = signatures[:, : bands * rows].astype(np.uint64).reshape(n, bands, rows)
    combined = (sig * mult).sum(axis=2, dtype=np.uint64)  # wraps mod 2^64
    return splitmix64(combined ^ (np.arange(bands, dtype=np.uint64) << np.uint64(56)))

"""The dedup stage's config section (dedup/): MinHash-LSH's threshold, shingles and bands."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, at_least


@dataclass
class DedupConfig:
    """dedup/minhash.py says why 5-word shingles; dedup/lsh.py how bands and rows are chosen."""

    threshold: float = 0.95  # OPT: drop documents with Jaccard >= 0.95 to another one
    ngram: int = 5  # word n-gram shingles
    lowercase: bool = True
    num_perm: int = 128
    bands: int | None = None  # None (with rows): the most rows that still find 99.9% of pairs at the threshold
    rows: int | None = None
    seed: int = 1234
    # A verification task checks the pairs of at most this many consecutive documents of one part, and holds
    # them with their partners (dedup/verify.py); a component of more documents is assembled over several tasks
    # (dedup/assemble.py), no groupby gathers more rows of one key (a text, a band bucket, a node: dedup/heavy.py),
    # and a graph of up to 64 edges per such document is labelled in one task (dedup/assemble.py): no task grows
    # with the largest duplicate cluster. In a hot cluster a document has about 5 partners over 10 bands
    # (tests/test_dedup.py): ~80k shingle sets, ~0.5 GB.
    task_documents: int = 1 << 14

    def validate(self, key: str) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"{key}.threshold", f"expected a Jaccard similarity in (0, 1], got {self.threshold}")
        at_least(self, key, 1, "ngram", "num_perm", "bands", "rows", "task_documents")
        if (self.bands is None) != (self.rows is None):
            raise ConfigError(f"{key}.{'rows' if self.rows is None else 'bands'}", "set bands and rows together, or neither")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ConfigError(f"{key}.bands", f"{self.bands} bands x {self.rows} rows needs more than num_perm={self.num_perm} permutations")

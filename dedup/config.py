"""The dedup stage's config section (dedup/): MinHash-LSH's threshold, shingles and bands."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, at_least


@dataclass
class DedupConfig:
    """dedup/minhash.py says why 5-word shingles; dedup/lsh.py how bands and rows are chosen."""

    threshold: float = 0.95
    """Documents whose exact [Jaccard similarity](glossary.md#jaccard-similarity) to another one, over all sources
    together, is at least this are duplicates, in (0, 1]. 0.95 is OPT's. Of each cluster of duplicates, the
    document of the source listed first in `sources` stays (then the smallest id)."""
    ngram: int = 5
    """Words per shingle. Five: long enough that unrelated documents share almost none, short enough that a
    one-word edit changes few of a document's shingles."""
    lowercase: bool = True
    """Lowercase the text before it is cut into shingles."""
    num_perm: int = 128
    """Hash functions (permutations) per [MinHash](glossary.md#minhash-lsh) signature: more estimate the Jaccard
    similarity more closely, at more compute. Every candidate pair is then checked with its exact Jaccard."""
    bands: int | None = None
    """LSH bands a signature is cut into; set with `rows`, and `bands` x `rows` at most `num_perm`. `null` (both):
    the most rows that still make 99.9% of the pairs at `threshold` candidates."""
    rows: int | None = None
    """Signature rows per LSH band; set with `bands`. `null` (both): chosen from `threshold` and `num_perm`, as
    for `bands`."""
    seed: int = 1234
    """The seed of the MinHash hash functions and the band keys: the same seed gives the same signatures on
    every machine."""
    # The tasks it bounds: a verification task holds at most this many consecutive documents of one part and
    # their partners' shingle sets (dedup/verify.py); a bigger component is assembled over several tasks
    # (dedup/assemble.py); no groupby gathers more rows of one key (dedup/heavy.py).
    task_documents: int = 1 << 11
    """The most documents of one kind that a dedup task holds: a verification task's documents, a component
    assembled in one task, the rows of one key a groupby gathers. So no task grows with the largest duplicate
    cluster. Lower it to make dedup's largest tasks smaller. Why 2,048: at 16,384 a hot
    cluster still grew the largest worker (docs/benchmarks.md, "Dedup's tasks at 2,048 documents")."""

    def validate(self, key: str) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"{key}.threshold", f"expected a Jaccard similarity in (0, 1], got {self.threshold}")
        at_least(self, key, 1, "ngram", "num_perm", "bands", "rows", "task_documents")
        if (self.bands is None) != (self.rows is None):
            raise ConfigError(f"{key}.{'rows' if self.rows is None else 'bands'}", "set bands and rows together, or neither")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ConfigError(f"{key}.bands", f"{self.bands} bands x {self.rows} rows needs more than num_perm={self.num_perm} permutations")

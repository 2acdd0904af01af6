"""Shingles and MinHash signatures for whole batches of documents, in numpy, the same on every machine.

Shingles: word n-grams (default n = 5, lowercased) of the normalized text, where a word is a
maximal run of bytes that are not ASCII whitespace (normalize has already turned every other
space into ' '). Five words: long enough that two unrelated documents share almost no shingles
(common 3-grams like "one of the" would inflate the Jaccard of unrelated texts), short enough
that one edited word changes only 5 of a document's shingles, so a one-word edit in a
2000-word document stays at J ~ 0.995 while a 15% edit falls far below 0.95. A document of
fewer than n words has one shingle: all its words. This matches how `corpus/sample.py` measures
the Jaccard of the duplicates it plants.

Hashing, without a Python loop per word or shingle: the batch's texts are joined into one byte
array; each word's hash is a polynomial hash over its bytes taken from prefix sums (uint64
arithmetic wraps mod 2^64, which is what makes the prefix sums exact), mixed with splitmix64;
an n-gram's hash mixes its n word hashes, each with its own odd multiplier, so order counts.
Signatures: each shingle's top 32 bits x, and for each of num_perm seeded hash functions
h_p(x) = (a_p * x + b_p) mod 2^32 (a_p odd: a bijection), the minimum over the document's
shingles, uint32. 32-bit lanes are twice as many per SIMD instruction as 64-bit ones, the
(num_perm, block) scratch array is reused, and minima are taken along contiguous rows: the
difference between 14x and 40x datasketch's loop (docs/benchmarks.md). tests/test_minhash.py
checks that the estimated Jaccard is unbiased.

Everything derives from `seed` through numpy's PCG64, so the same seed gives the same
signatures on every machine and in every Ray worker.
"""

from __future__ import annotations

import numpy as np

_SPACE = np.zeros(256, dtype=bool)
_SPACE[list(b" \t\n\r\x0b\x0c")] = True
_BASE = np.uint64(0x100000001B3)  # odd: invertible mod 2^64
_BASE_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_BLOCK = 4096  # shingles per block when taking minima: a (num_perm, block) uint32 scratch of 2 MB
_CHUNK_BYTES = 256 << 10  # texts are hashed in chunks of about this many bytes (a longer text alone): 10 MB of
# arrays at most, and faster than 8 MB chunks (in cache); 53 MB of text: 8 MB chunks 3.9 s, peak 321 MB; 1 MB 3.1 s,
# 48 MB; 14 MB of text: 1 MB chunks 0.64-0.73 s, 256 KB 0.61 s


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al.): every input bit affects every output bit."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^i mod 2^64 for i < n, as (base^(K*j)) * (base^k): two short cumprods and one multiply,
    instead of one n-long cumprod (a sequential chain, the slowest thing here)."""
    k = 4096
    low = np.full(k, base, dtype=np.uint64)
    low[0] = 1
    low = np.cumprod(low, dtype=np.uint64)  # wraps mod 2^64
    high = np.full(-(-n // k), (low[-1:] * base)[0], dtype=np.uint64)  # array op: wraps without a warning
    high[0] = 1
    high = np.cumprod(high, dtype=np.uint64)
    return np.multiply.outer(high, low).ravel()[:n]


class MinHasher:
    """`MinHasher(num_perm, ngram, seed).signatures(texts) -> (len(texts), num_perm) uint32`."""

    def __init__(self, num_perm: int = 128, ngram: int = 5, seed: int = 1234, lowercase: bool = True):
        if num_perm < 1 or ngram < 1:
            raise ValueError("num_perm and ngram must be >= 1")
        self.num_perm, self.ngram, self.seed, self.lowercase = num_perm, ngram, seed, lowercase
        rng = np.random.Generator(np.random.PCG64(seed))
        self._salt = rng.integers(0, 2**63, dtype=np.uint64)
        self._gram_mult = rng.integers(0, 2**63, size=ngram, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._a = (rng.integers(0, 2**31, size=num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1))[:, None]
        self._b = rng.integers(0, 2**32, size=num_perm, dtype=np.uint32)[:, None]

    # ------------------------------------------------------------------ shingles

    def shingles(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(shingle hashes uint64, start offset of each document's; len(texts) + 1 offsets), in
        document order; within a document in text order, repeats included (a multiset)."""
        grams, counts = [np.zeros(0, dtype=np.uint64)], [np.zeros(0, dtype=np.int64)]
        for g, offsets in self._chunks(texts):
            grams.append(g)
            counts.append(np.diff(offsets))
        return np.concatenate(grams), np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)

    def _chunks(self, texts: list[str]):
        """`_chunk_shingles` of each run of texts of about _CHUNK_BYTES (a longer text alone), in order: what one
        chunk's arrays cost (about 40 bytes per byte of text) is all a caller holds at once, whatever the batch."""
        chunk, size = [], 0
        for text in texts:
            chunk.append((text.lower() if self.lowercase else text).encode("utf-8"))
            size += len(chunk[-1]) + 1
            if size >= _CHUNK_BYTES:
                yield self._chunk_shingles(chunk)
                chunk, size = [], 0
        if chunk:
            yield self._chunk_shingles(chunk)

    def _chunk_shingles(self, encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        words, word_doc = self._word_hashes(encoded)
        n = self.ngram
        counts = np.bincount(word_doc, minlength=len(encoded))
        m = max(len(words) - n + 1, 0)
        grams = np.zeros(m, dtype=np.uint64)
        for k in range(n):  # n array passes, not a loop over shingles
            grams += words[k : k + m] * self._gram_mult[k]
        inside = word_doc[:m] == word_doc[n - 1 : n - 1 + m]  # the n-gram does not cross documents
        grams, gram_doc = grams[inside], word_doc[:m][inside]
        short = np.flatnonzero((counts > 0) & (counts < n))  # fewer than n words: one shingle of them all
        if len(short):
            starts = np.concatenate([[0], np.cumsum(counts)])[short]
            extra = np.zeros(len(short), dtype=np.uint64)
            for k in range(n - 1):
                has = counts[short] > k
                extra[has] += words[starts[has] + k] * self._gram_mult[k]
            order = np.argsort(np.concatenate([gram_doc, short]), kind="stable")
            grams, gram_doc = np.concatenate([grams, extra])[order], np.concatenate([gram_doc, short])[order]
        offsets = np.concatenate([[0], np.cumsum(np.bincount(gram_doc, minlength=len(encoded)))])
        return splitmix64(grams ^ self._salt), offsets

    def shingle_sets(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's shingles as a sorted array without repeats: its set, for exact Jaccard."""
        return [np.unique(grams[offsets[i] : offsets[i + 1]]) for grams, offsets in self._chunks(texts)
                for i in range(len(offsets) - 1)]

    def _word_hashes(self, encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        data = np.frombuffer(b" ".join(encoded) + b" ", dtype=np.uint8)
        doc_start = np.concatenate([[0], np.cumsum([len(e) + 1 for e in encoded])])
        space = _SPACE[data]
        edge = np.flatnonzero(np.diff(np.concatenate([[True], space]).astype(np.int8)))
        starts, ends = edge[0::2], edge[1::2]  # data ends with a space, so every word ends
        # Prefix sums of byte * BASE^-i: the hash of bytes [s, e) is (P[e] - P[s]) * BASE^s.
        up, down = _powers(_BASE, len(data)), _powers(_BASE_INV, len(data))
        prefix = np.zeros(len(data) + 1, dtype=np.uint64)
        np.cumsum(data * down[: len(data)], dtype=np.uint64, out=prefix[1:])
        poly = (prefix[ends] - prefix[starts]) * up[starts]
        lengths = (ends - starts).astype(np.uint64)
        words = splitmix64(poly ^ (lengths << np.uint64(56)) ^ self._salt)
        word_doc = np.searchsorted(doc_start, starts, side="right") - 1
        return words, word_doc

    # ------------------------------------------------------------------ signatures

    def signatures(self, texts: list[str]) -> np.ndarray:
        """A chunk of texts at a time: only the signatures (512 bytes a document at num_perm 128) outlive a chunk."""
        return np.concatenate([np.zeros((0, self.num_perm), np.uint32),
                               *(self.signatures_of(grams, offsets) for grams, offsets in self._chunks(texts))])

    def signatures_of(self, grams: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Signatures from `shingles()` output; a document without shingles gets all 0xFFFFFFFF."""
        n_docs = len(offsets) - 1
        out = np.full((self.num_perm, n_docs), np.iinfo(np.uint32).max, dtype=np.uint32)
        x = (grams >> np.uint64(32)).astype(np.uint32)
        doc_of = np.repeat(np.arange(n_docs), np.diff(offsets))
        scratch = np.empty((self.num_perm, _BLOCK), dtype=np.uint32)
        for lo in range(0, len(x), _BLOCK):
            block, docs = x[lo : lo + _BLOCK], doc_of[lo : lo + _BLOCK]
            hashed = scratch[:, : len(block)]
            np.multiply(self._a, block[None, :], out=hashed)  # wraps mod 2^32
            hashed += self._b
            first = np.flatnonzero(np.concatenate([[True], docs[1:] != docs[:-1]]))
            rows = docs[first]
            out[:, rows] = np.minimum(out[:, rows], np.minimum.reduceat(hashed, first, axis=1))  # a document may span two blocks
        return np.ascontiguousarray(out.T)


def jaccard_of_sets(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique shingle arrays (1.0 for two empty sets)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)

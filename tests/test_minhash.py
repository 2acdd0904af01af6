"""MinHash signatures and LSH banding: exact shingle sets, unbiased estimates, the same on every machine."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dedup.minhash
from conftest import ROOT
from corpus.sample import _rng, jaccard, mutate, prose
from dedup.lsh import band_keys, candidate_probability, choose_banding
from dedup.minhash import MinHasher, jaccard_of_sets


def pairs(count: int) -> tuple[list[str], list[str]]:
    docs = [prose(_rng(3, i), (4, 10)) for i in range(count)]
    return docs, [mutate(_rng(4, i), d, i % 25) for i, d in enumerate(docs)]


def test_shingle_sets_are_exactly_the_lowercased_word_5grams():
    docs, variants = pairs(150)
    extra = ["One two", "one TWO", "a b c d e f", "a b c d e g", "x", "", "naïve café déjà vu über straße naïve"]
    texts = docs + extra[::2] + variants + extra[1::2]
    sets = MinHasher().shingle_sets(texts)
    half = len(texts) // 2
    for i in range(half):
        assert jaccard_of_sets(sets[i], sets[half + i]) == pytest.approx(jaccard(texts[i], texts[half + i]), abs=1e-12)
    for text, s in zip(texts, sets):
        words = text.lower().split()
        assert len(s) == (len({tuple(words[k : k + 5]) for k in range(len(words) - 4)}) if len(words) >= 5 else int(bool(words)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab cdé\nX"), max_size=60), min_size=1, max_size=8))
def test_shingles_do_not_depend_on_batching_or_chunking(texts):
    hasher = MinHasher(num_perm=16)
    together = hasher.signatures(texts)
    alone = np.vstack([hasher.signatures([t]) for t in texts])
    assert (together == alone).all()
    sets = hasher.shingle_sets(texts)
    for t, s in zip(texts, sets):
        (single,) = hasher.shingle_sets([t])
        assert (s == single).all()


def test_small_chunks_give_the_same_signatures(monkeypatch):
    docs, _ = pairs(40)
    expected = MinHasher().signatures(docs)
    monkeypatch.setattr(dedup.minhash, "_CHUNK_BYTES", 5000)
    monkeypatch.setattr(dedup.minhash, "_BLOCK", 64)
    assert (MinHasher().signatures(docs) == expected).all()


def test_estimated_jaccard_is_unbiased():
    docs, variants = pairs(400)
    sig = MinHasher(num_perm=128).signatures(docs + variants)
    estimate = (sig[:400] == sig[400:]).mean(axis=1)
    exact = np.array([jaccard(a, b) for a, b in zip(docs, variants)])
    assert exact.min() < 0.6 and exact.max() == 1.0
    error = estimate - exact
    assert abs(error.mean()) < 0.006  # the mean of 400 errors of sd ~0.03
    assert error.std() < 1.3 * np.sqrt(exact * (1 - exact) / 128).mean() + 0.005


def test_signature_shape_seed_and_empty_documents():
    a = MinHasher(num_perm=64, seed=1).signatures(["the same words in a row here", ""])
    assert a.shape == (2, 64) and a.dtype == np.uint32
    assert (a[1] == np.iinfo(np.uint32).max).all()
    assert (MinHasher(num_perm=64, seed=1).signatures(["the same words in a row here"]) == a[0]).all()
    assert (MinHasher(num_perm=64, seed=2).signatures(["the same words in a row here"]) != a[0]).mean() > 0.9


def test_same_seed_same_signatures_in_another_process():
    """Nothing depends on Python's per-process hash seed: a fresh interpreter agrees."""
    code = ("from dedup.minhash import MinHasher; import sys; "
            "sys.stdout.write(MinHasher(seed=7).signatures(['A quick brown fox jumps over the lazy dog again'])[0].tobytes().hex())")
    env = {"PYTHONHASHSEED": "123", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    here = MinHasher(seed=7).signatures(["A quick brown fox jumps over the lazy dog again"])[0].tobytes().hex()
    assert out == here


def test_banding_reaches_the_recall_datasketch_does_not():
    bands, rows = choose_banding(128, 0.95)
    assert (bands, rows) == (10, 12)
    assert candidate_probability(0.95, bands, rows) >= 0.999
    assert candidate_probability(0.95, 3, 42) < 0.32  # datasketch's "optimal" for threshold 0.95
    assert candidate_probability(0.5, bands, rows) < 0.003
    with pytest.raises(ValueError, match="no banding"):
        choose_banding(4, 0.95, recall=0.999999)


def test_band_keys_match_exactly_when_band_rows_match():
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 2**32, size=(6, 128), dtype=np.uint32)
    sig[1] = sig[0]
    sig[2, :12] = sig[0, :12]  # shares band 0 only
    keys = band_keys(sig, 10, 12)
    assert keys.shape == (6, 10) and keys.dtype == np.uint64
    assert (keys[0] == keys[1]).all()
    assert keys[0, 0] == keys[2, 0] and (keys[0, 1:] != keys[2, 1:]).all()
    assert len(np.unique(keys[3:])) == 30  # different bands never share a key
    with pytest.raises(ValueError, match="needs 130 permutations"):
        band_keys(sig, 10, 13)

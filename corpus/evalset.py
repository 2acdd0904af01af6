"""The held-out evaluation set: one yardstick that every data ablation is measured with.

Drawn in the normalize stage, before dedup and the screen, by a seeded hash of each document's
(source, id): a document is in the set or not whatever dedup, the screen or any later setting does,
so the base run and an ablation are evaluated on the same documents (and the same texts: the set is
normalized like the corpus). It leaves the training corpus there, as a reason of its own in
normalize's counts (`eval`). The dedup stage's first phase (dedup/decontaminate.py), before its own
phases and with settings of its own (`eval.decontaminate`: word 13-grams, half of the smaller
document's shared with one evaluation document), removes every training document that overlaps one
of its documents (`near_eval`): no dedup.* setting changes which, so every dedup ablation trains
without the same documents. The subsets the screen drops stay in the set: their rows say what
dropping them cost on that kind of text.

The tokenize stage lays each (source, subset)'s documents end to end, each ending with </s> as in
training, after one </s> that opens the stream, and cuts the stream into windows of seq_len + 1
tokens that overlap by one: every token of every document is predicted exactly once, with the
stream's earlier tokens in the window as its context. Each document's closing </s> stays in the
stream as context (the model was trained that way) but is not scored: its target is ignored, as
Paloma and nanochat leave special tokens out, since it encodes no byte of the text. The last window
is filled with <pad>, whose targets are ignored too (were <pad> and </s> one id, both would be
ignored all the same). A unit's `tokens` counts the targets scored: its documents' tokens, no </s>.

Bits per byte: the summed negative log-likelihood of those tokens, in bits, over the UTF-8 bytes of
the texts they encode. Unlike a loss per token it does not depend on the tokenizer. `eval.loss` is
nats per token scored (per non-</s> token). A source's row sums its subsets'; the whole set's row
sums every source's; so do the rows' sizes (`eval.size.documents`, `.bytes`, `.tokens`).

The fingerprint is a hash over the set's documents' (source, id, text), as a sum of one SHA-256 per
document (order-free, so each normalize task adds up its own), plus one of the decontamination
settings (`EvalConfig.identity`): runs tagged with different fingerprints were evaluated on different
sets, or trained on corpora decontaminated against it differently, and pipelines/compare.py refuses to
compare them. A dedup.* setting is not in it.
"""

from __future__ import annotations

import hashlib
import math
import numpy as np

REASON = "eval"  # normalize's set-aside folder and count
NEAR = "near_eval"  # dedup's first phase's: training documents that overlap an evaluation document (dedup/decontaminate.py)
IGNORE = -100  # a target that is not scored (torch's cross_entropy default; train/parallel/tensor.py too)


def drawn(sources: list[str], ids: list[str], fraction: float, seed: int) -> np.ndarray:
    """Which documents are in the evaluation set: a seeded hash of (source, id) in [0, 1) below `fraction`."""
    if not len(ids):
        return np.zeros(0, bool)
    salt = seed.to_bytes(8, "little", signed=True)
    digests = b"".join(hashlib.blake2b(f"{s}\0{i}".encode(), digest_size=8, key=salt, person=b"opt-eval").digest()
                       for s, i in zip(sources, ids))
    draws = (np.frombuffer(digests, dtype="<u8") >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return draws < fraction


def document_hash(source: str, doc_id: str, text: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{source}\0{doc_id}\0{text}".encode()).digest(), "big")


def fingerprint(total: int, documents: int) -> str:
    """The set's fingerprint from the sum of its documents' hashes (and their number)."""
    return hashlib.sha256(f"{total % (1 << 256):064x}/{documents}".encode()).hexdigest()[:16]


def rows_of(source: str, subset: str) -> list[str]:
    """The table rows a document counts in: its source's, and its subset's where the source has subsets."""
    return [source] if subset in ("", source) else [source, f"{source}.{subset}"]


def windows(documents: list[list[int]], eos: int, pad: int, block: int) -> np.ndarray:
    """Documents' token ids (each ending with </s>) -> (n, block) windows of one stream that opens with </s>,
    consecutive windows sharing one token, the last one padded with `pad`."""
    stream = np.fromiter((t for doc in [[eos], *documents] for t in doc), np.int64)
    step = block - 1
    n = max(1, -(-(len(stream) - 1) // step))
    out = np.full((n, block), pad, np.int64)
    for i in range(n):
        piece = stream[i * step: i * step + block]
        out[i, :len(piece)] = piece
    return out


def targets(rows: np.ndarray, pad: int, eos: int) -> np.ndarray:
    """Windows -> their targets (the next tokens), with the padding's and every </s>'s set to IGNORE: only the
    documents' own tokens are scored. (A document's text never encodes to <pad> or </s>: corpus/tokenizer.py
    encodes special tokens' text as text; so the two are told apart, and if they were one id both go unscored.)"""
    out = rows[:, 1:].astype(np.int64)
    out[(out == pad) | (out == eos)] = IGNORE
    return out


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / math.log(2) / n_bytes if n_bytes else float("nan")


def rows_for(units: list[dict]) -> list[str]:
    """The table's rows, in order: each source, then its subsets'; the whole set's is "" (metric `eval.bpb`)."""
    out = [""]
    for unit in units:
        out += [r for r in rows_of(unit["source"], unit["subset"]) if r not in out]
    return out


def metrics(units: list[dict], nll: list[float]) -> dict[str, float]:
    """Each unit's summed negative log-likelihood (nats) -> `eval.bpb.<row>` and `eval.loss.<row>` (nats per token
    scored: per non-</s> token) for every row, and `eval.bpb` and `eval.loss` for the whole set."""
    sums: dict[str, list[float]] = {}
    for unit, value in zip(units, nll, strict=True):
        for row in ["", *rows_of(unit["source"], unit["subset"])]:
            s = sums.setdefault(row, [0.0, 0, 0])
            s[0], s[1], s[2] = s[0] + value, s[1] + unit["bytes"], s[2] + unit["tokens"]
    out = {}
    for row in rows_for(units):
        if row not in sums:
            continue
        value, n_bytes, tokens = sums[row]
        suffix = f".{row}" if row else ""
        out[f"eval.bpb{suffix}"] = bits_per_byte(value, n_bytes)
        out[f"eval.loss{suffix}"] = value / tokens if tokens else float("nan")
    return out


def sizes(units: list[dict]) -> dict[str, int]:
    """Each row's size, summed over its units: `eval.size.documents.<row>`, `eval.size.bytes.<row>` and
    `eval.size.tokens.<row>` (tokens scored), and `eval.size.documents` etc. for the whole set."""
    sums: dict[str, dict[str, int]] = {}
    for unit in units:
        for row in ["", *rows_of(unit["source"], unit["subset"])]:
            s = sums.setdefault(row, dict.fromkeys(("documents", "bytes", "tokens"), 0))
            for key in s:
                s[key] += int(unit[key])
    return {f"eval.size.{key}{f'.{row}' if row else ''}": value
            for row in rows_for(units) if row in sums for key, value in sums[row].items()}

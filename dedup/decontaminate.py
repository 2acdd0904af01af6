"""Phase 0, decontamination: every training document that overlaps an evaluation document leaves as `near_eval`,
before dedup's own phases and with settings of its own (`eval.decontaminate`; corpus/config.py says why 13-word
n-grams and half of the smaller document). What leaves depends on the evaluation set, the training documents and
those settings, never on a dedup.* setting nor on which duplicates dedup removes: every dedup ablation removes the
same documents as base. The phases after this one never see them, and the evaluation set takes no part in them.

The rule: with G(x) the distinct word n-grams of x (dedup/minhash.py's shingles, lowercased, hashed with SEED,
not dedup.seed), a training document T leaves when, for some evaluation document E,
|G(T) & G(E)| / min(|G(T)|, |G(E)|) >= threshold. It is written to `near_eval/` with E (the one of highest
overlap, then the first) as `kept_id`, the overlap and the n-grams shared. An n-gram that several evaluation
documents have counts for the first of them in the set's order (its parts', then their rows'): the index holds
one document per n-gram, so a lookup is one binary search and never fans out over boilerplate that many
evaluation documents share. A text that is in the evaluation set twice is credited to its first copy, whole.

On Ray, without the corpus's text or n-grams on the driver:
1. one task per evaluation part hashes its documents' n-grams: each distinct one with its first document, and
   each document's count of distinct n-grams, id and source (`index_part`);
2. one task merges them into the index (`merge_index`): the n-grams sorted (uint64) and each one's document
   (int32), and per document its n-gram count, id and source. It stays in Ray's object store, where the tasks
   of a node all read its one copy there, without copying it;
3. one task per training part (`training_part`) hashes its documents' n-grams a row group at a time, looks each
   up in the index, counts what each document shares with each evaluation document, and writes the documents
   that leave to `near_eval/` and their rows to work/decontaminated/ (a file per part, empty where none leave),
   which the later phases skip and the output drops.

Its size: 12 bytes per distinct n-gram of the evaluation set (about one per word) plus its documents' ids. At
configs/opt-175b.yaml's scale (0.25% of ~800 GB: ~2 GB of text, ~350M words) ~4 GB, one copy per node; the
merge task holds about three times that while it sorts. A training task holds one row group's n-grams besides.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from corpus.config import DecontaminateConfig
from corpus.parts import Parts
from dedup.heavy import firsts_mask, lookup
from dedup.minhash import MinHasher

SEED = 13  # of the n-grams' hash: fixed here, so that no dedup setting changes what is removed
NEAR_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("kept_id", pa.string()),
                         ("kept_source", pa.string()), ("overlap", pa.float64()), ("shared", pa.int64())])


def ngrams(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """The documents' n-grams, repeats included: (document, n-gram hash) pairs, by document."""
    grams, offsets = MinHasher(num_perm=1, ngram=ngram, seed=SEED, lowercase=True).shingles(texts)
    return np.repeat(np.arange(len(texts), dtype=np.int64), np.diff(offsets)), grams


def distinct(docs: np.ndarray, grams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(document, n-gram) pairs -> each once, sorted by document, then n-gram."""
    order = np.lexsort((grams, docs))
    docs, grams = docs[order], grams[order]
    fresh = firsts_mask(docs, grams)
    return docs[fresh], grams[fresh]


@dataclass
class EvalIndex:
    """The evaluation set's n-grams, each once and sorted, with the first document that has it (`docs`); and per
    document (by its place in the set) its count of distinct n-grams, id and source."""
    grams: np.ndarray  # uint64
    docs: np.ndarray  # int32
    sizes: np.ndarray  # int32
    ids: pa.Array
    sources: pa.Array

    @property
    def nbytes(self) -> int:
        return self.grams.nbytes + self.docs.nbytes + self.sizes.nbytes + self.ids.nbytes + self.sources.nbytes


@dataclass(frozen=True)
class EvalPart:
    path: str
    ngram: int


def index_part(task: EvalPart) -> EvalIndex:
    """One part of the evaluation set -> its index, its documents numbered by row."""
    table = pq.read_table(task.path, columns=["id", "source", "text"])
    docs, grams = distinct(*ngrams(table["text"].to_pylist(), task.ngram))
    sizes = np.bincount(docs, minlength=table.num_rows).astype(np.int32)
    order = np.argsort(grams, kind="stable")  # by n-gram; of one n-gram's documents, the first first
    grams, docs = grams[order], docs[order]
    first = firsts_mask(grams)
    return EvalIndex(grams[first], docs[first].astype(np.int32), sizes, table["id"].combine_chunks(),
                     table["source"].combine_chunks())


def merge_index(*parts: EvalIndex) -> EvalIndex:
    """The parts' indexes, in the set's order -> the set's: documents numbered across the parts, each n-gram with
    the first document that has it."""
    starts = np.cumsum([0] + [len(p.sizes) for p in parts])
    grams = np.concatenate([p.grams for p in parts])
    docs = np.concatenate([(p.docs + start).astype(np.int32) for p, start in zip(parts, starts)])
    order = np.argsort(grams, kind="stable")  # a part's n-grams are each once: stable keeps the first part's
    grams, docs = grams[order], docs[order]
    first = firsts_mask(grams)
    return EvalIndex(grams[first], docs[first], np.concatenate([p.sizes for p in parts]),
                     pa.concat_arrays([p.ids for p in parts]), pa.concat_arrays([p.sources for p in parts]))


def overlaps(texts: list[str], index: EvalIndex, ngram: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training documents -> (document, evaluation document, overlap, n-grams shared) for each document that
    shares an n-gram with the set, against its evaluation document of highest overlap (then the first). Only those
    documents' n-grams are sorted (to count each once): the others cost one lookup per n-gram."""
    docs, grams = ngrams(texts, ngram)
    touched = np.unique(docs[lookup(index.grams, grams)[1]])
    docs, grams = distinct(*(x[np.isin(docs, touched)] for x in (docs, grams)))
    sizes = np.bincount(docs, minlength=len(texts))
    at, hit = lookup(index.grams, grams)
    n = np.int64(len(index.sizes))
    pairs, shared = np.unique(docs[hit] * n + index.docs[at[hit]], return_counts=True)
    doc, other = pairs // n, pairs % n
    overlap = shared / np.minimum(sizes[doc], index.sizes[other])
    order = np.lexsort((other, -overlap, doc))
    best = order[firsts_mask(doc[order])]
    return doc[best], other[best], overlap[best], shared[best]


@dataclass(frozen=True)
class TrainingPart:
    """One part of normalize's output: its documents that overlap the evaluation set go to `rejects`
    (near_eval/), their rows to `rows` (work/decontaminated/), for the part numbered `part`."""
    path: str
    part: int
    config: DecontaminateConfig
    rejects: str
    rows: str


def training_part(task: TrainingPart, index: EvalIndex) -> dict:
    """One training part, a row group at a time -> its documents that leave, written; counts per source."""
    parquet, start, gone = pq.ParquetFile(task.path), 0, []
    rejects, by_source = Parts(task.rejects, Path(task.path).stem, NEAR_SCHEMA), collections.Counter()
    for i in range(parquet.num_row_groups):
        table = parquet.read_row_group(i, columns=["id", "source", "text"])
        doc, other, overlap, shared = overlaps(table["text"].to_pylist(), index, task.config.ngram)
        leave = overlap >= task.config.threshold
        for d, e, o, s in zip(doc[leave].tolist(), other[leave].tolist(), overlap[leave].tolist(), shared[leave].tolist()):
            source = table["source"][d].as_py()
            rejects.add({"id": table["id"][d].as_py(), "source": source, "kept_id": index.ids[e].as_py(),
                         "kept_source": index.sources[e].as_py(), "overlap": o, "shared": s})
            by_source[source] += 1
        gone.append(start + doc[leave])
        start += table.num_rows
    rejects.close()
    np.save(Path(task.rows) / f"part-{task.part:05d}.npy", np.sort(np.concatenate([np.zeros(0, np.int64), *gone])))
    return {"rows": start, "sources": dict(by_source), "index_bytes": index.nbytes, "eval_ngrams": len(index.grams)}


def decontaminate(training: list[str], evaluation: list[str], config: DecontaminateConfig, rejects: str, rows: Path) -> dict:
    """Writes `near_eval/` (`rejects`) and each training part's rows that leave (`rows`). Returns the metrics:
    documents removed per source (`near_eval.<source>`), the index's n-grams and bytes, and the phase's seconds."""
    import ray

    start = time.perf_counter()
    rows.mkdir(parents=True, exist_ok=True)
    results = []
    if evaluation:  # an empty set removes nothing: no part is read
        each_part, merge, each_training = ray.remote(index_part), ray.remote(merge_index), ray.remote(training_part)
        index = merge.remote(*[each_part.remote(EvalPart(p, config.ngram)) for p in evaluation])  # a reference: not here
        results = ray.get([each_training.remote(TrainingPart(p, i, config, rejects, str(rows)), index)
                           for i, p in enumerate(training)])
    by_source: collections.Counter = collections.Counter()
    for result in results:
        by_source.update(result["sources"])
    return {**{f"near_eval.{s}": n for s, n in sorted(by_source.items())},
            "decontaminate.eval_ngrams": results[0]["eval_ngrams"] if results else 0,
            "decontaminate.index_bytes": results[0]["index_bytes"] if results else 0,
            "decontaminate.seconds": round(time.perf_counter() - start, 3)}

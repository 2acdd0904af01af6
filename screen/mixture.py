"""The proxy mixtures: a fixed baseline mix, and the baseline with one subset up-weighted.

Three steps, each a Ray Data task per input part or per mixture (corpus.parts.run_tasks):

1. census: documents and text bytes per (source, subset), so that sampling rates can be set.
2. sample: every document gets a seeded draw in [0, 1) from (source, id) (the draw is the same
   in every run with the same seed); a document joins the baseline sample when it is not in a
   screened subset and its draw is under the baseline's rate, and its subset's sample when it is
   screened and its draw is under that subset's rate. Rates are set for `OVERSAMPLE` times the
   bytes a mixture needs. The baseline holds none of the candidates, so that one spiky subset
   does not raise the line every other subset is judged against; when every subset is screened
   there is nothing else, and the baseline is the whole corpus.
3. mixture: the baseline's documents in draw order up to (1 - upweight) of the mixture's tokens,
   then the subset's documents in draw order up to the rest (either repeated when it is smaller
   than its share), encoded and cut into token shards in the tokenize stage's format,
   so the training loop reads them with the same loader as a real run. The baseline mix is the
   baseline's documents alone.

The loader permutes sequences, so the subset's sequences are spread over the run's batches.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus import tokenizer as tokenizers
from corpus.parts import Parts, iter_rows
from corpus.tokenize import FORMAT, INDEX, document_keys, token_dtype, write_rows
from screen.score import BASELINE

OVERSAMPLE = 1.5  # sample this many times the bytes a mixture needs (bytes per token are a guess until encoded)
BYTES_PER_TOKEN = 4.0  # the guess: GPT-2's BPE on English web text
ENCODE_CHUNK = 256  # documents per encode_batch call

SAMPLE_SCHEMA = pa.schema([("role", pa.string()), ("draw", pa.float64()), ("id", pa.string()), ("source", pa.string()),
                           ("subset", pa.string()), ("text", pa.string())])


@dataclass(frozen=True)
class CensusTask:
    """A run of row groups of one of dedup's parts, counted by `census_task`."""
    path: str
    row_groups: tuple[int, ...]


def census_task(task: CensusTask) -> dict:
    """{"source\\0subset": [documents, text bytes]} of one run of row groups."""
    table = pq.ParquetFile(task.path).read_row_groups(list(task.row_groups), columns=["source", "subset", "text"])
    sizes = pc.binary_length(pc.cast(table.column("text"), pa.binary())).to_numpy(zero_copy_only=False)
    out: dict = collections.defaultdict(lambda: [0, 0])
    for source, subset, size in zip(table.column("source").to_pylist(), table.column("subset").to_pylist(), sizes):
        entry = out[f"{source}\0{subset}"]
        entry[0] += 1
        entry[1] += int(size)
    return dict(out)


@dataclass(frozen=True)
class SampleTask:
    """A run of row groups of one of dedup's parts, sampled by `sample_task` into `output` (SAMPLE_SCHEMA)."""
    path: str
    row_groups: tuple[int, ...]
    stem: str  # of the part files it writes
    output: str
    seed: int
    baseline_rate: float
    subset_rates: dict[str, float]  # the screened subsets' rates (rates())
    baseline_is_everything: bool


def sample_task(task: SampleTask) -> dict:
    """The documents of one run of row groups that fall in the baseline's or their subset's sample."""
    screened = set(task.subset_rates)
    out = Parts(task.output, task.stem, SAMPLE_SCHEMA)
    rows = list(iter_rows(task.path, columns=["id", "source", "subset", "text"], row_groups=list(task.row_groups)))
    _, draws = document_keys([r["source"] for r in rows], [r["id"] for r in rows], task.seed)
    counts: collections.Counter = collections.Counter()
    for row, draw in zip(rows, draws):
        draw = float(draw)
        key = row["subset"]
        if draw < task.baseline_rate and (key not in screened or task.baseline_is_everything):
            out.add({"role": BASELINE, "draw": draw, **row}, len(row["text"]))
            counts[BASELINE] += 1
        if key in screened and draw < task.subset_rates[key]:
            out.add({"role": key, "draw": draw, **row}, len(row["text"]))
            counts[key] += 1
    out.close()
    return dict(counts)


def baseline_is_everything(census: dict[tuple[str, str], list[int]], screened: list[str]) -> bool:
    """True when every document is in a screened subset: then the baseline is the whole corpus."""
    return all(subset in screened for _, subset in census)


def rates(census: dict[tuple[str, str], list[int]], screened: list[str], mixture_bytes: float,
          upweight: float) -> tuple[float, dict[str, float]]:
    """(baseline rate, {subset: rate}) that sample OVERSAMPLE times what a mixture takes."""
    everything = baseline_is_everything(census, screened)
    by_subset: dict[str, int] = collections.Counter()
    for (_, subset), (_, size) in census.items():
        by_subset[subset] += size
    base_bytes = sum(size for s, size in by_subset.items() if everything or s not in screened)
    baseline = min(1.0, OVERSAMPLE * mixture_bytes / max(1, base_bytes))
    subsets = {s: min(1.0, OVERSAMPLE * upweight * mixture_bytes / max(1, by_subset[s])) for s in screened}
    return baseline, subsets


def _documents(sample: Path, role: str) -> list[str]:
    """The texts of one role in the sample, in draw order (ties by id: a total order)."""
    tables = [pq.read_table(p, columns=["draw", "id", "text"], filters=[("role", "=", role)])
              for p in sorted(sample.glob("*.parquet"))]
    table = pa.concat_tables(tables) if tables else SAMPLE_SCHEMA.empty_table().select(["draw", "id", "text"])
    order = pc.sort_indices(table, sort_keys=[("draw", "ascending"), ("id", "ascending")])
    return table.take(order).column("text").to_pylist()


def _take_tokens(tok, texts: list[str], budget: int) -> tuple[list[np.ndarray], int, int]:
    """Encoded documents in order until `budget` tokens, cycling through them if they are fewer
    (a small corpus, or a subset smaller than its share): (tokens per document, tokens, documents taken)."""
    out, total, docs = [], 0, 0
    if not texts:
        return out, 0, 0
    position = 0
    while total < budget:
        if position >= len(texts):
            position = 0
        chunk = texts[position : position + ENCODE_CHUNK]
        position += len(chunk)
        for ids in tokenizers.encode_documents(tok, chunk):
            out.append(np.asarray(ids, dtype=np.uint32))
            total += len(ids)
            docs += 1
            if total >= budget:
                break
    return out, total, docs


@dataclass(frozen=True)
class MixtureTask:
    """One mixture `mixture_task` builds from the sample: the baseline's, or the baseline with `subset` up-weighted."""
    subset: str  # BASELINE for the baseline mix
    sample: str
    tokens: int  # the mixture's size
    seq_len: int
    upweight: float
    output: str
    tokenizer: str  # the tokenizer file


def mixture_task(task: MixtureTask) -> dict:
    """One mixture's token shards (train/00000.arrow + index.json) in task.output."""
    tok = tokenizers.load(task.tokenizer)
    vocab_size = tokenizers.padded_vocab_size(tok)
    dtype = np.dtype(token_dtype(vocab_size))
    sample, budget, block = Path(task.sample), task.tokens, task.seq_len + 1
    subset = task.subset
    share = 0 if subset == BASELINE else int(round(task.upweight * budget))
    base, base_tokens, base_docs = _take_tokens(tok, _documents(sample, BASELINE), budget - share)
    extra, extra_tokens, extra_docs = [], 0, 0
    if share:
        texts = _documents(sample, subset)
        if not texts:
            raise ValueError(f"subset {subset!r}: no documents were sampled")
        extra, extra_tokens, extra_docs = _take_tokens(tok, texts, share)
    tokens = np.concatenate(base + extra) if base or extra else np.zeros(0, np.uint32)
    sequences = len(tokens) // block
    output = Path(task.output)
    rows = tokens[: sequences * block].astype(dtype).reshape(sequences, block)
    write_rows(output / "train" / "00000.arrow", rows)
    index = {
        "format": FORMAT, "seq_len": task.seq_len, "block": block, "dtype": dtype.name, "vocab_size": vocab_size,
        "tokenizer": {"file": task.tokenizer}, "eos_id": tokenizers.EOS, "pad_id": tokenizers.PAD,
        "sequences": sequences, "eval": {"units": []},  # proxies are scored on their grad norms, not evaluated
        "train": {"sequences": sequences, "tokens": int(len(tokens)), "shards": [{"file": "train/00000.arrow", "sequences": sequences}]},
        "mixture": {"subset": subset, "upweight": task.upweight if share else 0.0,
                    "baseline": {"documents": base_docs, "tokens": base_tokens},
                    "subset_part": {"documents": extra_docs, "tokens": extra_tokens}},
    }
    (output / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return {"sequences": sequences, **index["mixture"]}


def subset_shares(folder: str | Path, batches, global_batch: int, seed: int) -> np.ndarray:
    """The fraction of each global batch's tokens that came from the mixture's candidate subset, for the
    batches a proxy run trained on (its loader: the same permutation of the mixture's sequences, the same
    seed). A mixture is the baseline's tokens and then the subset's, cut into sequences, so a sequence's
    share is where it sits against that boundary."""
    from train.loader import Loader, read_index

    index = read_index(folder)
    boundary, block = index["mixture"]["baseline"]["tokens"], index["block"]
    loader = Loader(folder, global_batch, seed=seed)
    out = np.empty(len(batches), dtype=np.float64)
    for i, g in enumerate(batches):
        sequences = loader.sequences(int(g)).astype(np.int64)
        out[i] = float(np.clip(((sequences + 1) * block - boundary) / block, 0.0, 1.0).mean())
    return out

"""The tokenize stage: documents -> OPT's packed token sequences in Arrow IPC shards + index.json.

OPT's recipe (opt-facts.md): each document `encode(text.rstrip()) + [</s>]`, documents shuffled
with a seed, concatenated, cut into blocks of seq_len + 1 across document boundaries, the last
partial block dropped. At 180B tokens nothing here may need the whole corpus in one process:

1. The tokenizer: trained on a seeded sample of the normalize stage's row groups (`kind: train`) or
   read from GPT-2's files (`kind: gpt2`), in a Ray task; saved in the output beside the shards.
   Sampled before dedup and the screen, not from this stage's input: every ablation of them (and of
   this stage's settings other than the tokenizer's) gets the same tokenizer, byte for byte, so that
   a loss per token means the same thing in each.
2. Encode and shuffle: Ray Data `map_batches` runs `encode_batch` over runs of row groups (one
   thread per Ray CPU), writes each run's tokens to a flat file, and gives every document a
   64-bit key, a seeded hash of its source and id. The key's bucket (its top bits, scaled to B
   buckets) is a groupby key over one small row per document (key, source, id, where its tokens
   are): the tokens themselves never go through the shuffle. Each bucket, sorted by key, gathers
   its documents' tokens into one flat stream file. Bucket order then key order is key order whatever
   B is, so the document order is a pure function of (documents, seed), not of the cluster.
3. Pack: the train streams laid end to end are cut into blocks of seq_len + 1 tokens; shard
   tasks copy whole blocks into Arrow IPC files (one fixed-size-list column, uint16 when the
   vocabulary fits). The tail that does not fill a block is dropped, counted, and the
   documents it came from are named in index.json.
4. The evaluation set (normalize's, corpus/evalset.py), in a Ray task: each (source, subset)'s
   documents in id order, as windows that score every token once (but not the closing </s>s), in
   `eval/NNNNN.arrow`, with its documents, the UTF-8 bytes they encode and the tokens scored, and the
   set's fingerprint in index.json. Nothing is dropped from it.

index.json is the contract with training (design.md): seq_len, vocab_size, tokenizer, eos id,
sequences, token counts per source and subset, every shard with its row count, and the evaluation
set's units.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from corpus import evalset
from corpus import tokenizer as tokenizers
from corpus.parts import aside_parts, check_read, input_parts, parquet_bytes, row_group_ranges, run_tasks, task_bytes
from corpus.config import TokenizeConfig, TokenizerConfig
from core.dag import StageContext, StageResult
from core.ray_session import collect, groupby

INDEX = "index.json"
FORMAT = "opt-pipeline token shards v1"  # index.json's "format"; train.loader reads this one
TASK_BYTES = 64 << 20  # documents per encode task, at most
BUCKET_BYTES = 512 << 20  # documents' text per shuffle bucket, at most (~256 MB of uint16 tokens)
SHARD_BYTES = 256 << 20  # tokens per Arrow shard
ENCODE_CHUNK = 1024  # documents per encode_batch call and per output batch
TAIL_DOCS = 64  # a stream reports at most this many of its last documents (for naming the dropped tail)


# --------------------------------------------------------------------------- keys


def document_keys(sources: list[str], ids: list[str], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(shuffle key uint64, a second draw in [0, 1)) per document: seeded hashes of (source, id)."""
    salt = seed.to_bytes(8, "little", signed=True)
    digests = b"".join(hashlib.blake2b(f"{s}\0{i}".encode(), digest_size=16, key=salt).digest()
                       for s, i in zip(sources, ids))
    words = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
    return words[:, 0].copy(), (words[:, 1] >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def bucket_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """floor(key * B / 2^64), monotone in the key: buckets are contiguous ranges of the key space."""
    return (((keys >> np.uint64(32)) * np.uint64(buckets)) >> np.uint64(32)).astype(np.int64)


# --------------------------------------------------------------------------- phase 1: tokenizer


@dataclass(frozen=True)
class TokenizerTask:
    """The tokenizer `tokenizer_task` trains (on a sample of `parts`) or loads, saved in `output`."""
    tokenizer: TokenizerConfig
    seed: int
    parts: tuple[str, ...]
    output: str


def tokenizer_task(task: TokenizerTask) -> dict:
    """Train (on a seeded sample of row groups) or load the tokenizer, and save it in the output."""
    tok_config = task.tokenizer
    if tok_config.kind == "gpt2":
        tok = tokenizers.from_gpt2_files(tok_config.vocab, tok_config.merges, tok_config.fairseq_dict)
        sampled = 0
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "true"  # training may use every thread the node has
        groups = sample_row_groups(list(task.parts), tok_config.train_bytes, task.seed)
        sampled = sum(size for _, _, size in groups)

        def texts():
            for path, group, _ in groups:
                yield from pq.ParquetFile(path).read_row_group(group, columns=["text"]).column("text").to_pylist()

        tok = tokenizers.train(texts(), tok_config.vocab_size)
    tokenizers.save(tok, task.output)
    return {"vocab": tok.get_vocab_size(), "sampled_bytes": sampled}


def sample_row_groups(parts: list[str], budget: int, seed: int) -> list[tuple[str, int, int]]:
    """Row groups in a seeded order until `budget` bytes: every source in proportion to its size."""
    groups = []
    for path in parts:
        meta = pq.ParquetFile(path).metadata
        groups += [(path, i, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]
    _, draws = document_keys([Path(p).name for p, _, _ in groups], [str(i) for _, i, _ in groups], seed)
    chosen, total = [], 0
    for j in np.argsort(draws, kind="stable"):
        if total >= budget:
            break
        chosen.append(groups[j])
        total += groups[j][2]
    return sorted(chosen)


# --------------------------------------------------------------------------- phase 2: encode + shuffle


@dataclass(frozen=True)
class EncodeTask:
    """A run of row groups of one part, encoded by `encode_task` into scratch file number `index`."""
    path: str
    row_groups: tuple[int, ...]
    index: int


def encode_task(batch: dict, tokenizer_path: str, seed: int, buckets: int, dtype: str, scratch: str):
    """One run of row groups (a pickled EncodeTask) -> its tokens in one flat file, and a small row per document
    (its key, shuffle group and where its tokens are): only these rows go through the shuffle (a map_batches
    generator)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # Ray gave this task one CPU: one thread
    tok = tokenizers.load(tokenizer_path)
    for pickled in batch["task"]:
        task: EncodeTask = pickle.loads(pickled)
        table = pq.ParquetFile(task.path).read_row_groups(list(task.row_groups), columns=["id", "text", "source", "subset"])
        written = 0
        with open(os.path.join(scratch, f"{task.index:06d}.bin"), "wb") as out:  # a retry rewrites it whole
            for start in range(0, table.num_rows, ENCODE_CHUNK):
                chunk = table.slice(start, ENCODE_CHUNK)
                ids, source = chunk.column("id").to_pylist(), chunk.column("source").to_pylist()
                encoded = tokenizers.encode_documents(tok, chunk.column("text").to_pylist())
                lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
                out.write(np.fromiter(itertools.chain.from_iterable(encoded), dtype, int(lengths.sum())).tobytes())
                offsets = written + np.cumsum(lengths) - lengths
                written += int(lengths.sum())
                keys, _ = document_keys(source, ids, seed)
                group = bucket_of(keys, buckets)
                yield pa.table({
                    "id": chunk.column("id"), "source": chunk.column("source"), "subset": chunk.column("subset"),
                    "key": pa.array(keys, pa.uint64()), "group": pa.array(group, pa.int64()),
                    "file": pa.array(np.full(len(ids), task.index, np.int64)),
                    "offset": pa.array(offsets, pa.int64()), "n_tokens": pa.array(lengths, pa.int64()),
                })


def write_stream(group: pa.Table, scratch: str, streams: str, dtype: str, block_tokens: int) -> pa.Table:
    """One shuffle group: its documents in key order, their tokens gathered from the encode tasks'
    files into one flat stream file."""
    group = group.take(pc.sort_indices(group, [("key", "ascending"), ("source", "ascending"), ("id", "ascending")]))
    number = group.column("group")[0].as_py()
    files, offsets, n_tokens = (group.column(c).to_numpy() for c in ("file", "offset", "n_tokens"))
    maps = {f: np.memmap(os.path.join(scratch, f"{f:06d}.bin"), dtype=dtype, mode="r") for f in np.unique(files)}
    tokens = np.concatenate([maps[f][o:o + n] for f, o, n in zip(files, offsets, n_tokens)]) if len(files) else \
        np.zeros(0, dtype)
    tokens.tofile(os.path.join(streams, f"{number:07d}.bin"))
    counts = collections.defaultdict(lambda: [0, 0])
    for source, subset, n in zip(group.column("source").to_pylist(), group.column("subset").to_pylist(), n_tokens):
        counts[(source, subset or "")][0] += 1
        counts[(source, subset or "")][1] += int(n)
    tail, covered = [], 0  # the last documents, enough to name whatever a dropped tail takes from them
    for j in range(group.num_rows - 1, -1, -1):
        if covered >= block_tokens or len(tail) >= TAIL_DOCS:
            break
        tail.append([group.column("source")[j].as_py(), group.column("id")[j].as_py(), int(n_tokens[j])])
        covered += int(n_tokens[j])
    summary = {"group": number, "documents": group.num_rows, "tokens": int(tokens.size),
               "counts": [[s, sub, d, t] for (s, sub), (d, t) in sorted(counts.items())], "tail": tail}
    return pa.table({"summary": [json.dumps(summary)]})


# --------------------------------------------------------------------------- phase 3: pack


def pieces(streams: list[tuple[str, int]], start: int, count: int) -> list[tuple[str, int, int]]:
    """Where tokens [start, start + count) of the streams laid end to end are: (file, offset, n)."""
    out, position = [], 0
    for path, size in streams:
        lo, hi = max(start, position), min(start + count, position + size)
        if lo < hi:
            out.append((path, lo - position, hi - lo))
        position += size
    return out


def write_rows(path: Path, rows: np.ndarray) -> int:
    """(n, block) tokens -> an Arrow IPC file of one fixed-size-list column (what train.loader maps)."""
    table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])})
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path.stat().st_size


@dataclass(frozen=True)
class ShardTask:
    """One shard `shard_task` writes: `sequences` blocks copied from pieces of the streams."""
    file: str  # relative to output
    sequences: int
    block: int
    dtype: str
    output: str
    pieces: tuple[tuple[str, int, int], ...]  # (stream file, first token, tokens)


def shard_task(task: ShardTask) -> dict:
    """Copy whole blocks from the streams into one shard."""
    dtype = np.dtype(task.dtype)
    tokens = np.concatenate([np.fromfile(path, dtype, count=n, offset=offset * dtype.itemsize)
                             for path, offset, n in task.pieces])
    if tokens.size != task.sequences * task.block:
        raise RuntimeError(f"{task.file}: read {tokens.size} tokens from the streams, expected {task.sequences * task.block}")
    size = write_rows(Path(task.output) / task.file, tokens.reshape(-1, task.block))
    # the shard's tokens by content (data_fingerprint): about 1 GB/s, a fraction of the copy's own time
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest()
    return {"file": task.file, "sequences": task.sequences, "bytes": size, "blake2b": digest}


def dropped_tail(summaries: list[dict], dropped: int) -> list[dict]:
    """The documents whose last tokens fell in the dropped tail (the stream's final documents)."""
    out = []
    for summary in reversed(summaries):
        for source, doc_id, n in summary["tail"]:
            if dropped <= 0:
                return out
            out.append({"source": source, "id": doc_id, "tokens_dropped": min(n, dropped), "tokens": n})
            dropped -= n
    return out


def pack(summaries: list[dict], streams_dir: Path, output: Path, prefix: str, block: int, dtype: str,
         per_shard: int) -> dict:
    """The streams of `summaries`, in order, cut into blocks and written as output/prefix/NNNNN.arrow."""
    streams = [(str(streams_dir / f"{s['group']:07d}.bin"), s["tokens"]) for s in summaries]
    total = sum(size for _, size in streams)
    sequences = total // block
    tasks = []
    for first in range(0, sequences, per_shard):
        n = min(per_shard, sequences - first)
        name = f"{prefix}/{len(tasks):05d}.arrow"
        tasks.append(ShardTask(name, n, block, dtype, str(output), tuple(pieces(streams, first * block, n * block))))
    shards = run_tasks(shard_task, tasks)
    dropped = total - sequences * block
    return {"sequences": sequences, "tokens": total, "documents": sum(s["documents"] for s in summaries),
            "dropped_tail_tokens": dropped, "dropped_tail_documents": dropped_tail(summaries, dropped),
            "shards": shards}


def token_counts(summaries: list[dict]) -> tuple[dict, dict]:
    """{source: {documents, tokens}} and {source: {subset: {documents, tokens}}}, eos included."""
    by_source: dict = {}
    by_subset: dict = {}
    for summary in summaries:
        for source, subset, docs, tokens in summary["counts"]:
            s = by_source.setdefault(source, {"documents": 0, "tokens": 0})
            s["documents"] += docs
            s["tokens"] += tokens
            if subset:
                sub = by_subset.setdefault(source, {}).setdefault(subset, {"documents": 0, "tokens": 0})
                sub["documents"] += docs
                sub["tokens"] += tokens
    return by_source, by_subset


# --------------------------------------------------------------------------- 4: the evaluation set


@dataclass(frozen=True)
class EvalTask:
    """The evaluation set's parts, tokenized by `eval_task` into windows of `block` tokens in output/eval/."""
    tokenizer: str  # the tokenizer file
    block: int
    dtype: str
    output: str
    parts: tuple[str, ...]


def eval_task(task: EvalTask) -> dict:
    """The evaluation set's documents -> one file of windows per (source, subset), and what index.json says of
    each: its documents, the UTF-8 bytes their tokens encode, the tokens scored (not the </s>s), the windows."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    tok = tokenizers.load(task.tokenizer)
    columns = ["id", "text", "source", "subset"]
    table = pa.concat_tables([pq.read_table(p, columns=columns) for p in task.parts]) if task.parts else \
        pa.table({c: pa.array([], pa.string()) for c in columns})
    table = table.take(pc.sort_indices(table, [("source", "ascending"), ("subset", "ascending"), ("id", "ascending")]))
    units: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for i, (source, subset) in enumerate(zip(table["source"].to_pylist(), table["subset"].to_pylist())):
        units[source, subset or ""].append(i)
    out = []
    for number, ((source, subset), rows) in enumerate(sorted(units.items())):
        texts = table["text"].take(pa.array(rows)).to_pylist()
        encoded = tokenizers.encode_documents(tok, texts)
        windows = evalset.windows(encoded, tokenizers.EOS, tokenizers.PAD, task.block)
        scored = int((evalset.targets(windows, tokenizers.PAD, tokenizers.EOS) != evalset.IGNORE).sum())
        name = f"eval/{number:05d}.arrow"
        size = write_rows(Path(task.output) / name, windows.astype(task.dtype))
        out.append({"source": source, "subset": subset, "documents": len(rows),
                    "bytes": sum(len(t.rstrip().encode()) for t in texts), "tokens": scored,
                    "sequences": len(windows), "shards": [{"file": name, "sequences": len(windows), "bytes": size}]})
    return {"units": out}


# --------------------------------------------------------------------------- the stage


def run(ctx: StageContext) -> StageResult:
    config: TokenizeConfig = ctx.section
    upstream = "screen"  # the kept documents
    parts = input_parts(ctx.inputs, upstream)
    sources = [s.name for s in ctx.config.sources]
    block = config.seq_len + 1
    output = ctx.output

    t0 = time.perf_counter()
    tok_result = run_tasks(tokenizer_task, [TokenizerTask(config.tokenizer, config.seed,
                                                          tuple(input_parts(ctx.inputs, "normalize")), str(output))])[0]
    tok_path = str(output / tokenizers.FILE)
    tok = tokenizers.load(tok_path)
    vocab_size = tokenizers.padded_vocab_size(tok)
    dtype = token_dtype(vocab_size)
    ctx.log.info("tokenizer: %s, %d ids (padded to %d), %s", config.tokenizer.kind, tok.get_vocab_size(), vocab_size, dtype)

    t1 = time.perf_counter()
    summaries, buckets = encode_streams(ctx, parts, tok_path, config.seed, dtype, block)
    t2 = time.perf_counter()
    per_shard = max(1, SHARD_BYTES // (block * np.dtype(dtype).itemsize))
    train_split = pack(summaries, ctx.folder / "streams", output, "train", block, dtype, per_shard)
    train_split["by_source"], train_split["by_subset"] = token_counts(summaries)
    shutil.rmtree(ctx.folder / "streams")
    shutil.rmtree(ctx.folder / "encoded")
    evaluation = {**ctx.inputs["normalize"].get("eval", {}), **run_tasks(eval_task, [EvalTask(
        tok_path, block, dtype, str(output), tuple(aside_parts(ctx.inputs, "normalize", evalset.REASON)))])[0]}

    t3 = time.perf_counter()
    documents = sum(s["documents"] for s in summaries)
    check_read(documents, ctx.inputs, upstream)
    index = {
        "format": FORMAT, "seq_len": config.seq_len, "block": block, "dtype": dtype,
        "vocab_size": vocab_size, "tokenizer_vocab_size": tok.get_vocab_size(),
        "tokenizer": {"file": tokenizers.FILE, "kind": config.tokenizer.kind, "name": tokenizer_name(config, tok),
                      "sampled_bytes": tok_result["sampled_bytes"], "sampled_from": "normalize"},
        "bos_id": tokenizers.BOS, "pad_id": tokenizers.PAD, "eos_id": tokenizers.EOS, "unk_id": tokenizers.UNK,
        "seed": config.seed, "sequences": train_split["sequences"], "train": train_split, "eval": evaluation,
    }
    index["data_fingerprint"] = data_fingerprint(train_split["shards"], output / tokenizers.FILE, dtype, block)
    (output / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    missing = sorted(set(sources) - {u["source"] for u in evaluation["units"]})
    if missing:
        ctx.log.warning("the evaluation set has no documents of %s (eval.fraction %s)", ", ".join(missing),
                        evaluation.get("fraction"))
    seconds = {"tokenizer": t1 - t0, "encode_shuffle": t2 - t1, "pack": t3 - t2}
    return StageResult(documents, documents, {}, stage_metrics(train_split, evaluation, vocab_size, buckets, seconds))


def data_fingerprint(shards: list[dict], tokenizer: Path, dtype: str, block: int) -> str:
    """The training data by content: its shards' tokens in order, and the tokenizer that gives them meaning. Two
    runs with the same one trained on the same sequences, whatever code or config made them: what lets
    pipelines/ablations.py pool an ablation's seeds over several runs (a fingerprint of the stage's config and
    code would part runs of the same data after any edit to the code)."""
    digest = hashlib.blake2b(f"{dtype}/{block}/".encode() + tokenizer.read_bytes(), digest_size=16)
    for shard in shards:
        digest.update(shard["blake2b"].encode())
    return digest.hexdigest()[:16]


def encode_streams(ctx: StageContext, parts: list[str], tok_path: str, seed: int, dtype: str,
                   block: int) -> tuple[list[dict], int]:
    """(each bucket's summary, the number of buckets): the documents encoded by Ray Data tasks of a few row groups
    each into ctx.folder/encoded/, then grouped by bucket into one token stream each in ctx.folder/streams/."""
    import ray.data

    text_bytes = parquet_bytes(parts)
    buckets = max(1, -(-text_bytes // task_bytes(text_bytes, BUCKET_BYTES)))
    target = task_bytes(text_bytes, TASK_BYTES) // 2  # four tasks per CPU: documents encode at uneven speeds
    tasks = [pickle.dumps(EncodeTask(p, tuple(g), i)) for i, (p, g) in enumerate(row_group_ranges(parts, max(1, target)))]
    scratch, streams = ctx.folder / "encoded", ctx.folder / "streams"  # deleted once the shards are written
    scratch.mkdir()
    streams.mkdir()
    if not tasks:
        return [], buckets
    keys = ray.data.from_items([{"task": t} for t in tasks], override_num_blocks=len(tasks)).map_batches(
        encode_task, batch_size=1, fn_kwargs={
            "tokenizer_path": tok_path, "seed": seed, "buckets": buckets, "scratch": str(scratch),
            "dtype": dtype}).materialize()
    # Materialized first (small rows): streamed into the groupby, encoding ran on fewer cores.
    grouped = groupby(keys, "group", keys.size_bytes(), ctx.config.ray, num_partitions=buckets).map_groups(
        write_stream, batch_format="pyarrow",
        fn_kwargs={"scratch": str(scratch), "streams": str(streams), "dtype": dtype, "block_tokens": block})
    return sorted((json.loads(r["summary"]) for r in collect(grouped).to_pylist()), key=lambda s: s["group"]), buckets


def stage_metrics(train_split: dict, evaluation: dict, vocab_size: int, buckets: int, seconds: dict) -> dict:
    """The stage's MLflow metrics: the training split's and the evaluation set's sizes, tokens per source, time."""
    units = evaluation["units"]
    metrics = {
        "documents.train": train_split["documents"], "tokens.train": train_split["tokens"],
        "sequences.train": train_split["sequences"], "dropped_tail_tokens.train": train_split["dropped_tail_tokens"],
        "documents.eval": sum(u["documents"] for u in units), "tokens.eval": sum(u["tokens"] for u in units),
        "bytes.eval": sum(u["bytes"] for u in units), "sequences.eval": sum(u["sequences"] for u in units),
        "vocab_size": vocab_size, "buckets": buckets, **{f"seconds.{k}": v for k, v in seconds.items()},
    }
    for source, counts in train_split["by_source"].items():
        metrics[f"tokens.train.{source}"] = counts["tokens"]
    for unit in units:
        key = f"tokens.eval.{unit['source']}"
        metrics[key] = metrics.get(key, 0) + unit["tokens"]
    return metrics


def token_dtype(vocab_size: int) -> str:
    """The shards' integer type: uint16 while every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_name(config: TokenizeConfig, tok) -> str:
    kind = "gpt2-bpe" if config.tokenizer.kind == "gpt2" else "bytelevel-bpe-trained"
    return f"{kind}-{tok.get_vocab_size()}-{tokenizers.fingerprint(tok)}"

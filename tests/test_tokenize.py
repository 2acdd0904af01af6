"""The tokenize stage on the sample corpus: every document's tokens accounted for, the order a pure
function of the seed (not of how the work was split), the evaluation set as windows, shards the loader reads."""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from conftest import SPIKY, manifest, rows

from corpus import tokenize, tokenizer
from corpus.config import OPT_PILE_SUBSETS, TokenizerConfig
from pipelines.config import load_config
from core.dag import StageContext
from test_tokenizer import write_gpt2_files
from train.loader import TokenShards

EOS = tokenizer.EOS


def documents(stream: np.ndarray) -> tuple[list[tuple[int, ...]], list[int]]:
    """A packed stream split at </s>: the whole documents, and the unfinished one at the end."""
    ends = np.flatnonzero(stream == EOS)
    docs, start = [], 0
    for end in ends:
        docs.append(tuple(stream[start:end + 1].tolist()))
        start = end + 1
    return docs, stream[start:].tolist()


def packed(folder: Path, split: str) -> np.ndarray:
    shards = TokenShards(folder, split)
    return shards.rows(np.arange(len(shards))).reshape(-1) if len(shards) else np.zeros(0, shards.dtype)


@pytest.fixture(scope="module")
def tokenized(sample_run):
    _, _, wd = sample_run
    out = Path(manifest(wd, "tokenize")["output"])
    index = json.loads((out / "index.json").read_text())
    tok = tokenizer.load(str(out / "tokenizer.json"))
    # Each kept document encoded here, independently of the stage: encode(text.rstrip()) + [</s>].
    docs = rows(Path(manifest(wd, "screen")["output"]))
    encoded = {(d["source"], d["id"]): tuple(tok.encode(d["text"].rstrip(), add_special_tokens=False).ids) + (EOS,)
               for d in docs}
    return wd, out, index, encoded, {(d["source"], d["id"]): d for d in docs}


def test_every_document_is_packed_once_or_named_in_a_dropped_tail(tokenized):
    wd, out, index, encoded, _ = tokenized
    by_tokens = collections.defaultdict(list)
    for key, tokens in encoded.items():
        by_tokens[tokens].append(key)
    seen = []
    splits = [("train", index["train"])]
    for name, split in splits:
        whole, unfinished = documents(packed(out, name))
        for tokens in whole:
            assert by_tokens[tokens], f"{name}: a packed document that is no document's encoding"
            seen.append(by_tokens[tokens].pop())
        tail = split["dropped_tail_documents"]
        assert sum(d["tokens_dropped"] for d in tail) == split["dropped_tail_tokens"] < index["block"]
        if tail:  # the last document's start is packed, its end is in the dropped tail; any before it wholly dropped
            last = encoded[(tail[0]["source"], tail[0]["id"])]
            assert list(last[: len(last) - tail[0]["tokens_dropped"]]) == unfinished
            assert all(d["tokens_dropped"] == d["tokens"] for d in tail[1:])
        else:
            assert unfinished == []
        seen += [(d["source"], d["id"]) for d in tail]
        assert split["sequences"] * index["block"] + split["dropped_tail_tokens"] == split["tokens"]
    assert sorted(seen) == sorted(encoded)  # each kept document exactly once
    assert sum(len(t) for t in encoded.values()) == sum(s["tokens"] for _, s in splits)
    counts = manifest(wd, "tokenize")["counts"]
    assert counts["rows_in"] == counts["rows_out"] == len(encoded) == manifest(wd, "screen")["counts"]["rows_out"]


def test_token_counts_per_source_and_subset(tokenized):
    _, out, index, encoded, docs = tokenized
    expected = collections.Counter()
    expected_subset = collections.Counter()
    for key, tokens in encoded.items():
        expected[key[0]] += len(tokens)
        if docs[key]["subset"]:
            expected_subset[(key[0], docs[key]["subset"])] += len(tokens)
    got = collections.Counter()
    got_subset = collections.Counter()
    for source, c in index["train"]["by_source"].items():
        got[source] += c["tokens"]
    for source, subsets in index["train"]["by_subset"].items():
        for subset, c in subsets.items():
            got_subset[(source, subset)] += c["tokens"]
    assert got == expected and got_subset == expected_subset
    assert set(index["train"]["by_subset"]["pile"]) == set(OPT_PILE_SUBSETS) - {SPIKY}  # each counted; the screen dropped one


def test_the_evaluation_set_is_normalizes_held_out_documents_every_token_scored_once(tokenized):
    """Each (source, subset) of normalize's evaluation set, in id order, as windows whose scored targets are its
    documents' tokens (each closing </s> in the stream, not scored); the subset the screen dropped is there too;
    the bytes and the fingerprint travel."""
    from corpus import evalset

    wd, out, index, encoded, _ = tokenized
    normalize = manifest(wd, "normalize")
    held_out = rows(Path(normalize["output"]).parent / "eval")
    assert len(held_out) == normalize["counts"]["eval"] == manifest(wd, "tokenize")["metrics"]["documents.eval"]
    assert not {(d["source"], d["id"]) for d in held_out} & set(encoded)  # none of them is trained on
    assert index["eval"]["fingerprint"] == normalize["eval"]["fingerprint"]
    tok = tokenizer.load(str(out / "tokenizer.json"))
    units = index["eval"]["units"]
    assert [(u["source"], u["subset"]) for u in units] == sorted({(d["source"], d["subset"]) for d in held_out})
    assert ("pile", SPIKY) in {(u["source"], u["subset"]) for u in units}
    for k, unit in enumerate(units):
        docs = sorted((d for d in held_out if (d["source"], d["subset"]) == (unit["source"], unit["subset"])), key=lambda d: d["id"])
        expected = [t for d in docs for t in tok.encode(d["text"].rstrip(), add_special_tokens=False).ids]
        windows = packed(out, f"eval/{k}").reshape(-1, index["block"]).astype(np.int64)
        targets = evalset.targets(windows, index["pad_id"], index["eos_id"])
        assert targets[targets != evalset.IGNORE].tolist() == expected and unit["tokens"] == len(expected)
        assert (windows[:, 1:] == EOS).sum() == len(docs)  # each document's </s>, as context
        assert unit["bytes"] == sum(len(d["text"].rstrip().encode()) for d in docs) and unit["documents"] == len(docs)


def test_shards_are_fixed_size_rows_the_loader_maps(tokenized):
    _, out, index, _, _ = tokenized
    assert index["seq_len"] == 64 and index["block"] == 65 and index["eos_id"] == 2
    assert index["dtype"] == "uint16" and index["vocab_size"] % 8 == 0
    tok = tokenizer.load(str(out / "tokenizer.json"))
    assert index["tokenizer_vocab_size"] == tok.get_vocab_size() <= 1024
    shards = TokenShards(out)
    assert len(shards) == index["sequences"] == sum(s["sequences"] for s in index["train"]["shards"]) > 100
    assert shards.rows(np.arange(len(shards))).max() < tok.get_vocab_size()


def run_stage(sample_run, tmp_path, **changes) -> tuple[Path, dict]:
    """The tokenize stage alone, into tmp_path, on the sample's screened documents, with config changes."""
    _, _, wd = sample_run
    tmp_path.mkdir(parents=True)
    config = load_config(wd.parent / "sample.yaml")
    for key, value in changes.items():
        setattr(config.tokenize, key, value)
    inputs = {stage: manifest(wd, stage) for stage in ("screen", "normalize")}
    ctx = StageContext("tokenize", config, config.tokenize, inputs, tmp_path, logging.getLogger("test"), "")
    result = tokenize.run(ctx)
    assert result.rows_in == result.rows_out == manifest(wd, "screen")["counts"]["rows_out"]
    assert not (tmp_path / "streams").exists() and not (tmp_path / "encoded").exists()  # scratch removed
    return ctx.output, json.loads((ctx.output / "index.json").read_text())


def test_order_depends_on_the_seed_not_on_the_bucket_count(sample_run, tmp_path, monkeypatch):
    _, _, wd = sample_run
    reference = Path(manifest(wd, "tokenize")["output"])
    monkeypatch.setattr(tokenize, "BUCKET_BYTES", 64 << 10)  # ~12 shuffle buckets instead of 1
    monkeypatch.setattr(tokenize, "SHARD_BYTES", 64 * 65 * 2)  # shards of 64 sequences
    out, index = run_stage(sample_run, tmp_path / "a")
    assert json.loads((reference / "index.json").read_text())["train"]["shards"][0]["sequences"] > 64
    assert len(index["train"]["shards"]) > 5
    assert np.array_equal(packed(out, "train"), packed(reference, "train"))
    for k in range(len(index["eval"]["units"])):
        assert np.array_equal(packed(out, f"eval/{k}"), packed(reference, f"eval/{k}"))
    reseeded, _ = run_stage(sample_run, tmp_path / "b", seed=1)
    a, b = documents(packed(reference, "train"))[0], documents(packed(reseeded, "train"))[0]
    assert a != b and len(set(a) & set(b)) > 0.8 * len(a)  # another order (and another dropped tail)


def test_gpt2_kind_through_the_stage(sample_run, tmp_path):
    _, vocab, merges = write_gpt2_files(tmp_path)
    out, index = run_stage(sample_run, tmp_path / "stage",
                           tokenizer=TokenizerConfig(kind="gpt2", vocab=vocab, merges=merges))
    assert index["tokenizer"]["kind"] == "gpt2" and index["tokenizer_vocab_size"] == 265
    stream = packed(out, "train")
    tok = tokenizer.load(str(out / "tokenizer.json"))
    assert stream.max() < 265 and tok.id_to_token(int(stream[stream > 3][0])) is not None
    whole, _ = documents(stream)
    assert tok.decode(list(whole[0][:-1])) and tok.token_to_id("Ġthe") in stream

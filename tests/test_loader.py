"""The training loader: batch g is a pure function of (shards, seed, g); resume, skip and rank split exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corpus.tokenize import FORMAT, INDEX, write_rows
from train.loader import Loader, Permutation, ShardError, TokenShards, eval_batches, share

BLOCK = 9


def make_shards(folder, n: int, per_shard: int, valid: int = 0) -> None:
    """Token shards whose sequence i is the row [i, i, ..., i]: a batch says which sequences it holds."""
    def split(prefix: str, count: int) -> dict:
        shards = []
        for k, first in enumerate(range(0, count, per_shard)):
            rows = np.repeat(np.arange(first, min(count, first + per_shard), dtype=np.uint16)[:, None], BLOCK, axis=1)
            write_rows(folder / prefix / f"{k:05d}.arrow", rows)
            shards.append({"file": f"{prefix}/{k:05d}.arrow", "sequences": len(rows)})
        return {"sequences": count, "shards": shards}

    index = {"format": FORMAT, "seq_len": BLOCK - 1, "block": BLOCK, "dtype": "uint16", "vocab_size": 65536,
             "eos_id": 2, "train": split("train", n), "eval": {"units": [split("eval/00000", valid)] if valid else []}}
    (folder / INDEX).write_text(json.dumps(index))


def ids(batch: np.ndarray) -> list[int]:
    return batch[:, 0].tolist()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    make_shards(folder, n=103, per_shard=10, valid=7)  # 11 shards, the last one short
    return folder


def run(loader: Loader, steps: int) -> list[tuple[int, list[int]]]:
    it = iter(loader)
    return [(g, ids(b)) for g, b in (next(it) for _ in range(steps))]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(-2**40, 2**40), epoch=st.integers(0, 1000))
def test_permutation_is_a_bijection(n, seed, epoch):
    assert np.array_equal(np.sort(Permutation(n, seed, epoch)(np.arange(n))), np.arange(n))


def test_epoch_order_is_a_pure_function_of_seed_and_epoch(shards):
    a, b = Loader(shards, 8, seed=5), Loader(shards, 8, seed=5)
    assert run(a, 30) == run(b, 30)
    assert run(Loader(shards, 8, seed=5), 12)[:12] != run(Loader(shards, 8, seed=6), 12)
    # 103 sequences, batches of 8: 12 batches an epoch, each sequence at most once, 7 left out per epoch.
    first_epoch = [s for _, batch in run(Loader(shards, 8, seed=5), 12) for s in batch]
    assert len(set(first_epoch)) == 96 and set(first_epoch) <= set(range(103))
    second_epoch = [s for _, batch in run(Loader(shards, 8, seed=5), 24)[12:] for s in batch]
    assert len(set(second_epoch)) == 96 and second_epoch[:8] != first_epoch[:8]


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 40), skips=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), max_size=3))
def test_resume_at_any_step_with_skip_ranges_gives_the_same_batches(shards, k, skips):
    skip_ranges = [(a, a + n) for a, n in skips]
    uninterrupted = Loader(shards, 8, seed=3, skip_ranges=skip_ranges)
    full = run(uninterrupted, 50)
    first = Loader(shards, 8, seed=3, skip_ranges=skip_ranges)
    run(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = Loader(shards, 8, seed=3, skip_ranges=skip_ranges, state=state)
    assert run(resumed, 50 - k) == full[k:]
    # Skipped batches are exactly the ranges; the rest are the same batches as with no skips.
    plain = dict(run(Loader(shards, 8, seed=3), 200))
    skipped = {g for a, b in skip_ranges for g in range(a, b)}
    assert [g for g, _ in full] == [g for g in range(200) if g not in skipped][:50]
    assert all(batch == plain[g] for g, batch in full)


def test_ranks_split_each_global_batch_without_overlap(shards):
    one = run(Loader(shards, 8, seed=1), 30)
    two = [run(Loader(shards, 8, seed=1, rank=r, world_size=2), 30) for r in range(2)]
    four = [run(Loader(shards, 8, seed=1, rank=r, world_size=4), 30) for r in range(4)]
    for step, (g, batch) in enumerate(one):
        for split in (two, four):
            parts = [ranks[step] for ranks in split]
            assert all(pg == g for pg, _ in parts)
            union = [s for _, part in parts for s in part]
            assert sorted(union) == sorted(batch) and len(set(union)) == len(union)


def test_a_run_that_shrinks_and_grows_sees_every_sample_of_every_step_once(shards):
    """An elastic run (train.elastic) of 4 replicas: 4 ranks to step 4, 3 from its checkpoint to step 9 (its 4
    micro-batches of 2 split 2, 1, 1), 4 again to step 16, across an epoch's end. Each step's samples over the ranks
    are the unchanged run's, none twice, none skipped."""
    unchanged = run(Loader(shards, 8, seed=1), 16)  # 12 batches an epoch
    assert [share(4, r, 3) for r in range(3)] == [(0, 2), (2, 1), (3, 1)]
    seen, state = [], None
    for world, steps in ((4, 4), (3, 5), (4, 7)):
        loaders = [Loader(shards, 8, seed=1, micro_batch=2, rank=r, world_size=world, state=state) for r in range(world)]
        shares = [run(loader, steps) for loader in loaders]
        for step in range(steps):
            assert len({g for g, _ in (share[step] for share in shares)}) == 1  # every rank on the same global batch
            seen.append((shares[0][step][0], sorted(s for share in shares for s in share[step][1])))
        state = json.loads(json.dumps(loaders[0].state_dict()))  # the checkpoint's, from rank 0
    assert seen == [(g, sorted(batch)) for g, batch in unchanged]


def test_batches_hold_the_shard_rows(shards):
    loader = Loader(shards, 4, seed=0)
    batch = loader.batch(7)
    assert batch.shape == (4, BLOCK) and batch.dtype == np.uint16
    assert (batch == batch[:, :1]).all()  # whole rows, across shard boundaries
    assert ids(batch) == loader.sequences(7).tolist()


def test_state_from_another_layout_is_refused(shards):
    state = Loader(shards, 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="global_batch=8"):
        Loader(shards, 4, seed=1, state=state)
    with pytest.raises(ValueError, match="seed=1"):
        Loader(shards, 8, seed=2, state=state)
    with pytest.raises(ValueError, match="does not split into micro-batches of 3, at least one for each of 1 ranks"):
        Loader(shards, 8, micro_batch=3)
    with pytest.raises(ValueError, match="at least one for each of 5 ranks"):
        Loader(shards, 8, micro_batch=2, world_size=5)
    with pytest.raises(ValueError, match="end exclusive"):
        Loader(shards, 8, skip_ranges=[(5, 5)])


def test_eval_batches_cover_every_window_in_order(shards):
    assert [ids(b) for b in eval_batches(shards, 0, 3, pad=1)] == [[0, 1, 2], [3, 4, 5], [6]]
    # Over ranks: every rank the same number of windows, disjoint, none left out: the one short gets padding.
    split = [[s for b in eval_batches(shards, 0, 2, pad=1, rank=r, world_size=2) for s in ids(b)] for r in range(2)]
    assert split == [[0, 2, 4, 6], [1, 3, 5, 1]]
    with pytest.raises(ShardError, match="no split 'books'"):
        TokenShards(shards, "books")
    with pytest.raises(ShardError, match="no split 'eval/1'"):
        TokenShards(shards, "eval/1")


def test_truncated_or_mismatched_shards_are_clear_errors(tmp_path):
    make_shards(tmp_path, n=30, per_shard=10)
    shard = tmp_path / "train" / "00001.arrow"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=r"00001.arrow: cannot read this shard .*--only tokenize --force"):
        Loader(tmp_path, 4)
    make_shards(tmp_path, n=30, per_shard=10)
    index = json.loads((tmp_path / INDEX).read_text())
    index["train"]["shards"][2]["sequences"] = 11
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ShardError, match="10 sequences, index.json says 11"):
        Loader(tmp_path, 4)
    (tmp_path / INDEX).unlink()
    with pytest.raises(ShardError, match="no index.json"):
        Loader(tmp_path, 4)
    make_shards(tmp_path, n=3, per_shard=10)
    with pytest.raises(ShardError, match="fewer than one global batch"):
        Loader(tmp_path, 4)

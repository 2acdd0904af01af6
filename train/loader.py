"""Token shards -> training batches: exact, resumable, skippable, split across data-parallel ranks.

Global batch g (counted from the start of training, across epochs) is a pure function of
(index.json, seed, g): epoch e = g // batches_per_epoch orders the sequences by a seeded
permutation of its own, and batch g is the next `global_batch` positions of that order. Rank r
of w takes rows [r * G/w, (r+1) * G/w) of it, in whole micro-batches; when w does not divide them (an
elastic run short of replicas), the first ranks take one micro-batch more (`share`). Hence:

- resuming at any step is building the loader with the saved state; there is no iterator state
  to lose (Ray Data iterators cannot resume mid-epoch, so they are not used here);
- `skip_ranges=[(41000, 41300)]` leaves out exactly global batches 41000 <= g < 41300, on every
  rank, on every restart (the autopilot's "skip the batches around the spike");
- with 1 rank or 8, a global batch is the same set of sequences, split differently.

The permutation is a Feistel network with cycle walking, evaluated per position: nothing the
size of the corpus is ever built in memory. Shards are memory-mapped Arrow IPC files, so every
rank of a Ray Train job reads them straight from the shared filesystem the stage wrote to.
The last partial global batch of an epoch is not used in that epoch (a different one each epoch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from corpus.tokenize import FORMAT, INDEX
from dedup.minhash import splitmix64

ROUNDS = 6


class ShardError(ValueError):
    """Token shards that are missing, truncated, or not what index.json says."""


def read_index(folder: str | Path) -> dict:
    path = Path(folder) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path}: no index.json (is this the tokenize stage's output folder?)") from None
    except json.JSONDecodeError as exc:
        raise ShardError(f"{path}: not valid JSON ({exc})") from None
    if index.get("format") != FORMAT:
        raise ShardError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index


class TokenShards:
    """The sequences of one split, memory-mapped: `train`, or `eval/<n>` for the evaluation set's n-th unit."""

    def __init__(self, folder: str | Path, split: str = "train"):
        self.folder = Path(folder)
        self.index = read_index(folder)
        if split == "train":
            meta = self.index["train"]
        elif split.startswith("eval/") and split[5:].isdigit() and int(split[5:]) < len(self.index["eval"]["units"]):
            meta = self.index["eval"]["units"][int(split[5:])]
        else:
            raise ShardError(f"{self.folder}: no split {split!r}; there are train and eval/0 ... "
                             f"eval/{len(self.index['eval']['units']) - 1}")
        self.block = self.index["block"]
        self.dtype = np.dtype(self.index["dtype"])
        self.arrays = [self._open(shard) for shard in meta["shards"]]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        if self.starts[-1] != meta["sequences"]:
            raise ShardError(f"{self.folder}: split {split!r} has {self.starts[-1]} sequences in its shards, "
                             f"index.json says {meta['sequences']}")

    def _open(self, shard: dict) -> np.ndarray:
        path = self.folder / shard["file"]
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (OSError, pa.ArrowInvalid) as exc:
            raise ShardError(f"{path}: cannot read this shard ({exc}); rebuild it with "
                             "`python pipelines/full.py --only tokenize --force`") from None
        column = [b.column(0) for b in batches]
        if any(c.type != pa.list_(pa.from_numpy_dtype(self.dtype), self.block) for c in column):
            raise ShardError(f"{path}: rows are {column[0].type if column else 'missing'}, index.json says "
                             f"{self.block} x {self.dtype}")
        rows = sum(len(c) for c in column)
        if rows != shard["sequences"]:
            raise ShardError(f"{path}: {rows} sequences, index.json says {shard['sequences']}")
        views = [c.flatten().to_numpy(zero_copy_only=True).reshape(-1, self.block) for c in column]
        return views[0] if len(views) == 1 else np.concatenate(views)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows(self, sequences: np.ndarray) -> np.ndarray:
        """The token rows of these sequence numbers, as a fresh (len, block) array."""
        out = np.empty((len(sequences), self.block), self.dtype)
        shard = np.searchsorted(self.starts, sequences, side="right") - 1
        for s in np.unique(shard):
            where = np.nonzero(shard == s)[0]
            out[where] = self.arrays[s][sequences[where] - self.starts[s]]
        return out


class Permutation:
    """A seeded bijection of [0, n), evaluated per position (Feistel network + cycle walking)."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError("nothing to permute")
        self.n = n
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)  # 2^(2*half) >= n, and < 4n
        base = splitmix64(np.array([seed & (2**64 - 1)], np.uint64))[0] ^ np.uint64(epoch)
        self.keys = splitmix64(base + np.arange(1, ROUNDS + 1, dtype=np.uint64))

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        mask = np.uint64((1 << self.half) - 1)
        shift = np.uint64(self.half)
        left, right = x >> shift, x & mask
        for key in self.keys:
            left, right = right, left ^ (splitmix64(right ^ key) & mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._round_trip(np.asarray(positions, np.uint64))
        outside = out >= self.n
        while outside.any():  # walk the cycle until it lands back inside [0, n)
            out[outside] = self._round_trip(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


def share(micro_batches: int, rank: int, world_size: int) -> tuple[int, int]:
    """Where `rank`'s micro-batches of a global batch start and how many it has: in order, split as evenly as they
    go, the first ranks one more when `world_size` does not divide them (an elastic run short of replicas)."""
    each, extra = divmod(micro_batches, world_size)
    return rank * each + min(rank, extra), each + (rank < extra)


class Loader:
    """This rank's share of every global batch, in order, from `state` on, skipping `skip_ranges`: whole
    micro-batches of `micro_batch` sequences, as even a split over the ranks as they go (`share`)."""

    def __init__(self, folder: str | Path, global_batch: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 micro_batch: int = 1, skip_ranges: Sequence[tuple[int, int]] = (), state: dict | None = None):
        if global_batch % micro_batch or global_batch < micro_batch * world_size:
            raise ValueError(f"global batch of {global_batch} sequences does not split into micro-batches of "
                             f"{micro_batch}, at least one for each of {world_size} ranks")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.shards = TokenShards(folder)
        self.global_batch, self.rank, self.world_size, self.seed = global_batch, rank, world_size, seed
        first, count = share(global_batch // micro_batch, rank, world_size)  # in micro-batches
        self.first, self.local_batch = first * micro_batch, count * micro_batch  # in sequences
        self.batches_per_epoch = len(self.shards) // global_batch
        if self.batches_per_epoch == 0:
            raise ShardError(f"{folder}: {len(self.shards)} sequences, fewer than one global batch of {global_batch}")
        self.set_skip_ranges(skip_ranges)
        self._permutations: dict[int, Permutation] = {}
        self.position = 0  # the next global batch to consider
        if state is not None:
            self.load_state_dict(state)

    def set_skip_ranges(self, skip_ranges: Sequence[tuple[int, int]]) -> None:
        """The global batches to leave out, [start, end) each; the autopilot adds to them mid-run."""
        for start, end in skip_ranges:
            if not 0 <= start < end:
                raise ValueError(f"skip range ({start}, {end}): expected 0 <= start < end (end exclusive)")
        self.skip_ranges = sorted((int(a), int(b)) for a, b in skip_ranges)

    def _permutation(self, epoch: int) -> Permutation:
        if epoch not in self._permutations:
            self._permutations = {epoch: Permutation(len(self.shards), self.seed, epoch)}  # only the current one
        return self._permutations[epoch]

    def sequences(self, g: int) -> np.ndarray:
        """The sequence numbers of this rank's share of global batch g."""
        epoch, step = divmod(g, self.batches_per_epoch)
        first = step * self.global_batch + self.first
        return self._permutation(epoch)(np.arange(first, first + self.local_batch, dtype=np.uint64))

    def batch(self, g: int) -> np.ndarray:
        """(local_batch, seq_len + 1) tokens: inputs are [:, :-1], targets [:, 1:]."""
        return self.shards.rows(self.sequences(g))

    def skipped(self, g: int) -> bool:
        return any(a <= g < b for a, b in self.skip_ranges)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """(global batch index, this rank's tokens), forever (epoch after epoch)."""
        for g in self.positions():
            yield g, self.batch(g)

    def positions(self) -> Iterator[int]:
        """The global batch indices alone, forever, advancing the loader as `iter` does: a pipeline's middle
        stages take no data, and follow the same batches without reading them."""
        while True:
            g = self.position
            while self.skipped(g):
                g = next(b for a, b in self.skip_ranges if a <= g < b)
            self.position = g + 1
            yield g

    def state_dict(self) -> dict:
        epoch, step = divmod(self.position, self.batches_per_epoch)
        return {"epoch": epoch, "step": step, "seed": self.seed, "global_batch": self.global_batch,
                "sequences": len(self.shards)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "global_batch", "sequences"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"loader state is for {key}={state[key]}, this loader has {key}={mine[key]}: "
                                 "resuming would not continue the same batches")
        self.position = self.position_of(state)

    def position_of(self, state: dict) -> int:
        """The global batch a saved state continues at."""
        return state["epoch"] * self.batches_per_epoch + state["step"]


def eval_batches(folder: str | Path, unit: int, batch_size: int, pad: int, *, rank: int = 0,
                 world_size: int = 1) -> Iterator[np.ndarray]:
    """Every window of the evaluation set's `unit`, in batches (the last one may be smaller). Over several ranks
    each takes every world_size-th one; a rank short of one gets a window of `pad` (nothing scored), so that
    every rank runs the same forwards, as collectives such as ZeRO-3's need, and no window is left out."""
    shards = TokenShards(folder, f"eval/{unit}")
    per_rank = -(-len(shards) // world_size)
    mine = np.arange(rank, per_rank * world_size, world_size)
    for first in range(0, len(mine), batch_size):
        chosen = mine[first:first + batch_size]
        rows = np.full((len(chosen), shards.block), pad, shards.dtype)
        real = chosen < len(shards)
        rows[real] = shards.rows(chosen[real])
        yield rows

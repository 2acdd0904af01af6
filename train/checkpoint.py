"""Checkpoints that are complete or invisible, verified on load, with a fallback to the previous one.

OPT-175B lost days to partially written checkpoints and to storage hangs while loading one.
Here a checkpoint is DeepSpeed's own sharded files (every rank writes its shard) plus:

- `rng-rank<R>.pt`: every rank's torch/numpy/python RNG states, and its GPU's (dropout continues
  exactly);
- `meta.json`: the step, the loader state, the schedule, the loss scale, health (the autopilot
  fills it in), the metrics at that step, and the SHA-256, size and writing rank of every file.

Write: all ranks write into `.tmp-step-<N>/`; each rank hashes the files it wrote itself (at 175B,
2.4 TB over 992 ranks: each reads back its own 2.5 GB, not a slice of everyone's); rank 0 writes
meta.json last and renames the folder to `step-<N>/` (the publish). A crash before the rename
leaves a `.tmp-*` folder that nothing reads and the next save of that step replaces. Load: the
newest `step-*` whose files all match meta.json, each rank checking the files of its own number
(the ones DeepSpeed then reads on it); a corrupt or partial one is skipped with a logged reason
and the previous one is tried. Keep: the newest K plus every checkpoint whose meta says healthy.

Collective calls (barrier, all_reduce) go through `train.parallel.collectives`, on the process group's
device, so the same code runs in one process (tests) and on every rank of a Ray Train job.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from train.parallel.collectives import all_ok, barrier, rank_world

log = logging.getLogger(__name__)

META = "meta.json"
TAG = "ds"  # DeepSpeed's tag: its files live in step-<N>/ds/


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _files(folder: Path) -> list[str]:
    """The checkpoint's data files (not meta.json, nor the per-rank checksum lists being written)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != META and not p.name.startswith(".sha256-"))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def rng_state() -> dict:
    """This process's random states; on a GPU, its device's too (dropout draws from it there)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: the worker's own GPU
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def recording_writes(engine) -> Iterator[list[Path]]:
    """The files this rank's `engine.save_checkpoint` writes, as it writes them: DeepSpeed writes every
    data file through its checkpoint engine's `save` (each rank its own shards); only the small
    `latest` and `zero_to_fp32.py` are written past it, by rank 0."""
    written: list[Path] = []
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.save

    def save(state_dict, path, *args, **kwargs):
        result = original(state_dict, path, *args, **kwargs)
        written.append(Path(path))
        return result

    ckpt_engine.save = save
    try:
        yield written
    finally:
        ckpt_engine.save = original


def save(engine, root: Path, step: int, meta: dict) -> Path:
    """Every rank calls this at the same step; returns the published folder."""
    rank, world = rank_world()
    tmp, final = root / f".tmp-{step_name(step)}", root / step_name(step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died before its publish
        tmp.mkdir(parents=True)
    barrier()
    with recording_writes(engine) as written:
        engine.save_checkpoint(str(tmp), tag=TAG)  # collective: each rank writes its shard
    rng = tmp / f"rng-rank{rank:05d}.pt"
    torch.save(rng_state(), rng)
    # Each rank hashes what it wrote (still in its page cache), not a slice of everyone's files.
    mine = {str(p.relative_to(tmp)): [_sha256(p), p.stat().st_size, rank] for p in [*written, rng]}
    (tmp / f".sha256-rank{rank:05d}.json").write_text(json.dumps(mine))
    barrier()
    if rank == 0:
        sums: dict = {}
        for r in range(world):
            part = tmp / f".sha256-rank{r:05d}.json"
            sums.update(json.loads(part.read_text()))
            part.unlink()
        for name in set(_files(tmp)) - set(sums):  # what DeepSpeed wrote past its checkpoint engine
            sums[name] = [_sha256(tmp / name), (tmp / name).stat().st_size, 0]
        full = {**meta, "step": step, "world_size": world, "saved_at": time.time(), "files": sums}
        with open(tmp / META, "w") as f:
            json.dump(full, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again after a rollback: replace it
            shutil.rmtree(final)
        tmp.rename(final)
    barrier()
    return final


def published(root: Path) -> list[Path]:
    """Published checkpoints, newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


def read_meta(path: Path) -> dict | None:
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Why this checkpoint cannot be used (checking this rank's share of its files), or None. A rank's
    share is what the rank of the same number wrote (with fewer ranks now, rank r also checks those of
    r + world, ...): the files it is about to read, on the node that wrote them."""
    meta = read_meta(path)
    if meta is None:
        return f"{path.name}: no readable {META}"
    names = sorted(meta.get("files", {}))
    if not names:
        return f"{path.name}: {META} lists no files"
    for name in [n for n in names if meta["files"][n][2] % world == rank]:
        digest, size, _ = meta["files"][name]
        file = path / name
        if not file.is_file():
            return f"{path.name}: {name} is missing"
        if file.stat().st_size != size:
            return f"{path.name}: {name} has {file.stat().st_size} bytes, {META} says {size}"
        if _sha256(file) != digest:
            return f"{path.name}: {name} does not match its SHA-256 in {META}"
    return None


def load_latest(engine, root: Path, on_skip=None, accept=None) -> dict | None:
    """Load the newest checkpoint that verifies on every rank (and that `accept(meta)` takes, when
    given); its meta, or None to start fresh. `on_skip(reason)` is called (on rank 0) for every
    checkpoint passed over for being corrupt or partial."""
    rank, world = rank_world()
    for path in published(root):
        if accept is not None and not accept(read_meta(path) or {}):
            continue
        reason = verify(path, rank, world)
        if not all_ok(reason is None):
            if rank == 0:
                why = reason or f"{path.name}: another rank found a file that does not verify"
                log.warning("skipping checkpoint %s", why)
                if on_skip is not None:
                    on_skip(why)
            continue
        return load(engine, path)
    return None


def load(engine, path: Path) -> dict:
    """Load one (verified) checkpoint into the engine and this rank's RNGs; returns its meta."""
    rank, world = rank_world()
    meta = read_meta(path)
    engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
    rng = path / f"rng-rank{rank:05d}.pt"
    if meta["world_size"] == world and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    elif rank == 0:
        log.warning("checkpoint %s was written by %d ranks, now %d: RNG states not restored", path.name,
                    meta["world_size"], world)
    return {**meta, "path": str(path)}


def abandon_after(root: Path, step: int, before: float) -> list[str]:
    """Rename checkpoints newer than `step` and saved before time `before` (a rollback past them) out of
    sight: `abandoned-step-N`, never loaded, kept for a post-mortem. Idempotent; rank 0 only."""
    out = []
    for path in published(root):
        meta = read_meta(path) or {}
        if int(path.name[5:]) > step and meta.get("saved_at", 0) < before:
            path.rename(path.with_name(f"abandoned-{path.name}-{int(meta.get('saved_at', 0))}"))
            out.append(path.name)
    return out


def prune(root: Path, keep: int, keep_healthy: int) -> list[str]:
    """Delete all but the newest `keep` checkpoints and the newest `keep_healthy` healthy ones (rank 0
    only); returns what went. Healthy ones are the autopilot's rollback targets."""
    removed, healthy = [], 0
    for i, path in enumerate(published(root)):
        is_healthy = bool((read_meta(path) or {}).get("health", {}).get("healthy"))
        if i < keep or (is_healthy and healthy < keep_healthy):
            healthy += is_healthy and i >= keep
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed

"""Checkpoints that are complete or invisible, verified on load, with a fallback to the previous one.

OPT-175B lost days to partially written checkpoints and to storage hangs while loading one.
Here a checkpoint is DeepSpeed's own sharded files (every rank writes its shard) plus:

- `rng-rank<R>.pt`: every rank's torch/numpy/python RNG states, and its GPU's (dropout continues
  exactly);
- `meta.json`: the step, the loader state, the schedule, the loss scale, health (the autopilot
  fills it in), the metrics at that step, the layout that wrote it (`layout_of`), and the SHA-256, size and
  writing rank of every file.

A checkpoint loads into another data-parallel degree (`load`): under ZeRO 1-3 each rank's files hold its
partition of the optimizer state, which DeepSpeed refuses to read at another degree ("Automatic adjustment of
ZeRO's optimizer state partitioning with a new world size is not currently supported", engine.py
`_load_zero_checkpoint`). So rank 0 first converts it with DeepSpeed's own `ds_to_universal` (one file per
parameter: its fp32 weights and Adam moments), and every rank loads its new partition from that (`universal`).
The model states file carries `universal_checkpoint_info`, which the converter requires.

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
import copy
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import threading
import time
from functools import partial
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from train.parallel.collectives import all_gather_objects, all_ok, barrier, rank_world, read_once
from train.parallel.pipeline import TIED, opt_name, pipeline_name, whole_names

log = logging.getLogger(__name__)

META = "meta.json"
TAG = "ds"  # DeepSpeed's tag: its files live in step-<N>/ds/
UNIVERSAL_VERSION = {"universal_checkpoint_version": 0.4}  # deepspeed/checkpoint/constants.py's, 0.19
ROW_PATTERNS = "parameter_with_row_parallelism_patterns"  # constants.py PARAMETER_WITH_ROW_PARALLELISM_PATTERNS
REPLICATED_PATTERNS = "tp_replicated_parameter_patterns"  # constants.py TP_REPLICATED_PARAMETER_PATTERNS
PIPELINE_REPLICATED_PATTERNS = "pipeline_replicated_parameter_patterns"  # PIPELINE_REPLICATED_PARAMETER_PATTERNS


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
    """This process's random states; on a GPU, its device's too (dropout draws from it there). Tensors, numbers
    and strings only, so that `torch.load(weights_only=True)` reads it back: no pickled object, so a planted file
    cannot run code when it is loaded."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: the worker's own GPU
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def taking_writes(engine, copy: bool) -> Iterator[list[tuple[object, Path]]]:
    """What this rank's `engine.save_checkpoint` would write, taken instead of written: (state, path) pairs,
    written later by `Write`. DeepSpeed writes every data file through its checkpoint engine's `save` (each
    rank its own shards); only the small `latest` and `zero_to_fp32.py` are written past it, by rank 0, at
    once. With `copy`, each state is copied to host memory first (`host_copy`): training may change the
    tensors as soon as this returns. That copy is the only one: DeepSpeed 0.19 clones a pipeline stage's layer
    states (and a mixture of experts' states) to the CPU before it hands them to a checkpoint engine that
    `preserves_storage_sharing` (pipe/module.py `save_state_dict`; engine.py `_save_moe_checkpoint`), so that
    torch.save writes a view's elements and not its whole storage; `host_copy` makes each tensor its own storage
    already, and a second copy would double what a save blocks on, on the ranks that write a stage's layers, the
    slowest at the engine's barrier. (The engine's own model and ZeRO files are handed over uncloned.)"""
    taken: list[tuple[object, Path]] = []

    def save(state_dict, path, *args, **kwargs):
        taken.append((host_copy(state_dict, {}) if copy else state_dict, Path(path)))

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(engine.checkpoint_engine, "save", save))
        if copy:
            stack.enter_context(_replaced(engine.checkpoint_engine, "preserves_storage_sharing", lambda: False))
        yield taken


@contextlib.contextmanager
def _replaced(owner, name: str, value) -> Iterator[None]:
    """`owner`'s attribute `name` (a method of DeepSpeed's checkpoint engine, a flag of its config, torch's load)
    set to `value` for the duration, then put back."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def host_copy(obj, memo: dict):
    """A copy of a state dict whose tensors are copies in host memory (one copy per tensor, however often it is
    referenced); other values deep-copied, since some (a loss scaler) change as training goes on."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, memo)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(host_copy(v, memo) for v in obj)
    return copy.deepcopy(obj, memo)


def layout_of(engine) -> dict:
    """How this engine's state is split into files: what a load into another layout must reshape."""
    if pipelined(engine):  # its engine's grid is its process groups
        tensor, stages = engine.grid.get_slice_parallel_world_size(), engine.num_stages
    else:
        tensor, stages = engine.mpu.get_tensor_model_parallel_world_size() if engine.mpu is not None else 1, 1
    return {"data_parallel": engine.dp_world_size, "zero_stage": int(engine.zero_optimization_stage()),
            "tensor": tensor, "pipeline": stages}


def pipelined(engine) -> bool:
    """Whether `engine` runs a pipeline stage (as DeepSpeed's own load tells: engine.py `load_checkpoint`)."""
    from deepspeed.runtime.pipe.module import PipelineModule

    return isinstance(engine.module, PipelineModule)


def universal_info(engine) -> dict:
    """What DeepSpeed's ds_to_universal asks of a checkpoint (checkpoint/ds_to_universal.py
    `_check_for_required_state`, read from the first model-states file only), written into the model states from
    the module's attribute (engine.py `_save_checkpoint`): how the converter merges each parameter's tensor shards
    (`merge_tp_slices`) and so how the universal load cuts it for another tensor degree
    (checkpoint/universal_checkpoint.py `load_hp_checkpoint_state`). The ones split by input concatenate along dim
    1, the ones every tensor rank holds whole are kept once, and the rest concatenate along dim 0, the converter's
    default (train/parallel/groups.py `split_dim`, the rule `parallelize` follows). Written at every tensor degree,
    1 included: without it, a whole checkpoint's fc2 would be cut along the wrong dimension at tensor degree 2, and
    nothing would say so. One exact pattern a name, as the converter's strict mode wants every pattern to match.
    A pipeline stage describes the whole model under the pipeline's names, since only the first stage's file is
    read, and its tied embedding as kept by the first stage alone (`extract_zero_shards` skips the last's copy)."""
    from train.parallel.groups import split_dim

    if pipelined(engine):
        config = engine.module.opt_config
        names = {pipeline_name(n, config.n_layer): n for n in whole_names(config)}
        tied = {PIPELINE_REPLICATED_PATTERNS: [re.escape(TIED)]}
    else:
        names, tied = {n: n for n, _ in engine.module.named_parameters()}, {}
    return {**UNIVERSAL_VERSION, **tied,
            ROW_PATTERNS: [re.escape(own) + "$" for own, n in names.items() if split_dim(n) == 1],
            REPLICATED_PATTERNS: [re.escape(own) + "$" for own, n in names.items() if split_dim(n) is None]}


def save(engine, root: Path, step: int, meta: dict, background: bool = False) -> "Write":
    """Every rank calls this at the same step. DeepSpeed's state is taken in this call; with `background`, it
    is taken as a copy in host memory and written, hashed and published by a thread while training goes on.
    `Write.wait()` returns the published folder (or raises what the write raised); until it is published,
    the checkpoint does not exist for `load_latest`, so a crash mid-write leaves the previous one current."""
    rank, world = rank_world()
    tmp = root / f".tmp-{step_name(step)}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died before its publish
        tmp.mkdir(parents=True)
    barrier()
    engine.module.universal_checkpoint_info = universal_info(engine)  # into the model states: ds_to_universal reads it
    with taking_writes(engine, copy=background) as taken:
        engine.save_checkpoint(str(tmp), tag=TAG)  # collective: each rank hands over its shard
    taken.append((rng_state(), tmp / f"rng-rank{rank:05d}.pt"))
    write = Write(root, step, {**meta, "layout": layout_of(engine)}, taken, rank, world)
    if not background:
        write.run()
        barrier()  # rank 0 has published
    else:
        write.start()
    return write


class Write:
    """One rank's part of a checkpoint: its files written and hashed, `.sha256-rank<R>.json` last (the mark
    that this rank is done); rank 0 then waits for every rank's mark, writes meta.json and renames the folder
    to publish it. The marks go through the file system, not a collective, so a background write never
    issues a collective beside the training's own."""

    def __init__(self, root: Path, step: int, meta: dict, taken: list, rank: int, world: int):
        self.root, self.step, self.meta, self.taken, self.rank, self.world = root, step, meta, taken, rank, world
        self.tmp, self.final = root / f".tmp-{step_name(step)}", root / step_name(step)
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long the write took, from the hand-over to the publish
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._guarded, daemon=True, name=f"checkpoint-{self.step}")
        self.thread.start()

    def _guarded(self) -> None:
        try:
            self.run()
        except BaseException as error:  # raised on the training thread by wait()
            self.error = error

    def run(self) -> None:
        started = time.monotonic()
        written = []
        for state, path in self.taken:
            torch.save(state, path)
            written.append(path)
        self.taken = []  # the host copy goes as soon as it is on disk
        # Each rank hashes what it wrote (still in its page cache), not a slice of everyone's files.
        mine = {str(p.relative_to(self.tmp)): [_sha256(p), p.stat().st_size, self.rank] for p in written}
        for path in written:  # on disk before the mark says so: a node lost after the publish loses no file
            _fsync(path)
        mark = self.tmp / f".sha256-rank{self.rank:05d}.json"
        mark.with_suffix(".tmp").write_text(json.dumps(mine))
        _fsync(mark.with_suffix(".tmp"))
        os.replace(mark.with_suffix(".tmp"), mark)
        if self.rank == 0:
            self._publish()
        self.seconds = time.monotonic() - started

    def _publish(self, timeout: float = 3600.0) -> None:
        marks = [self.tmp / f".sha256-rank{r:05d}.json" for r in range(self.world)]
        deadline = time.monotonic() + timeout
        while not all(m.exists() for m in marks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.tmp.name}: not every rank finished writing within {timeout:.0f} s")
            time.sleep(0.05)
        sums: dict = {}
        for mark in marks:
            sums.update(json.loads(mark.read_text()))
            mark.unlink()
        for name in set(_files(self.tmp)) - set(sums):  # what DeepSpeed wrote past its checkpoint engine
            sums[name] = [_sha256(self.tmp / name), (self.tmp / name).stat().st_size, 0]
            _fsync(self.tmp / name)
        full = {**self.meta, "step": self.step, "world_size": self.world, "saved_at": time.time(), "files": sums}
        with open(self.tmp / META, "w") as f:
            json.dump(full, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if self.final.exists():  # the same step saved again after a rollback: replace it
            shutil.rmtree(self.final)
        self.tmp.rename(self.final)
        _fsync(self.final.parent)  # the rename itself

    def wait(self) -> Path:
        """This rank's part done (on rank 0: published); the folder. Call it on every rank, then barrier()
        before reading the folder on another rank."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"checkpoint {step_name(self.step)} was not written: {self.error!r}") from self.error
        return self.final


def _fsync(path: Path) -> None:
    """`path` (a file, or a folder: its entries) on disk, not only in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def published(root: Path) -> list[Path]:
    """Published checkpoints, newest first. A `step-*` that is a symbolic link is none: a link planted in a shared
    folder would make any folder the newest checkpoint (its sha256 list travels with it, so it verifies)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith("step-") and p.is_symlink():
            log.warning("checkpoint %s is a symbolic link (to %s): refused", p.name, os.readlink(p))
        elif p.name.startswith("step-") and p.is_dir():
            found.append(p)
    return sorted(found, reverse=True)


def newest_step(root: Path) -> int:
    """The step of the newest published checkpoint (0: none), from its name alone: what a restart will resume
    from unless it fails to verify, known before anything is built or read."""
    steps = (p.name.removeprefix("step-") for p in published(root))
    return next((int(s) for s in steps if s.isdigit()), 0)


def read_meta(path: Path) -> dict | None:
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _link_inside(folder: Path) -> Path | None:
    """The first symbolic link found inside `folder` (none is followed on the way), or None."""
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(top, name)):
                return Path(top) / name
    return None


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Why this checkpoint cannot be used (checking this rank's share of its files), or None. A rank's
    share is what the rank of the same number wrote (with fewer ranks now, rank r also checks those of
    r + world, ...): the files it is about to read, on the node that wrote them. A symbolic link anywhere inside
    is refused: `ds/` linked to a folder elsewhere, with a meta.json of its own to match, would verify."""
    if link := _link_inside(path):
        return f"{path.name}: {link.relative_to(path)} is a symbolic link (to {os.readlink(link)}): refused"
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


def safe_load(path, map_location=None, mmap: bool = False):
    """What DeepSpeed's checkpoint engine reads, read without pickle's code: `weights_only=True`, with the few
    DeepSpeed types its files hold allowed by name (`deepspeed_types`). DeepSpeed's own engine loads with
    `weights_only=False` (runtime/checkpoint_engine/torch_checkpoint_engine.py), so a file planted in a shared
    folder would run code on every rank that resumes; here it stops the load, naming the file. `mmap`: the
    tensors' bytes are read only when used."""
    return _weights_only(torch.load, path, map_location, mmap=mmap)


def _weights_only(load, path, map_location=None, **kwargs):
    """`load` (torch's) of `path` with `weights_only=True` and DeepSpeed's known types allowed; a file that needs
    more is refused, naming it."""
    with torch.serialization.safe_globals(deepspeed_types()):
        try:
            return load(path, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            first = str(exc).split("WeightsUnpickler error: ")[-1].splitlines()[0][:160]
            raise RuntimeError(f"checkpoint file {path} holds more than tensors and DeepSpeed's known types ({first}):"
                               " refused, since loading it could run code") from None


def deepspeed_types() -> list:
    """What DeepSpeed 0.19's checkpoint files hold besides tensors and plain data, found by loading every file it
    writes under ZeRO 0-3 in fp32, bf16 and fp16 with `weights_only=True`: its loss scalers (their attributes,
    no code), the ZeRO stage enum, and the fragment addresses (a named tuple) of its optimizer's partitions."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def reading_once(engine, data_group):
    """While DeepSpeed loads a checkpoint, each file that every rank of the data-parallel group reads (a
    pipeline stage's layer files, the model states of a replicated model) is read by the group's first rank
    only and broadcast to the others (collectives.read_once); each rank's own files (its ZeRO partition)
    are read where they are. At 175B that is one read of the model per restart where each of the 31
    replicas read it: 0.35 TB from storage instead of 10.9 TB (docs/scale.md, "Restarts")."""
    from deepspeed.runtime.state_dict_factory import SDLoaderBase

    def load(path, map_location=None, *args, **kwargs):
        return read_once(lambda: safe_load(path, map_location), str(path), data_group)

    with _replaced(engine.checkpoint_engine, "load", load), _replaced(SDLoaderBase, "check_ckpt_list", _check_ckpt_list):
        yield


def _check_ckpt_list(self) -> None:
    """DeepSpeed's `SDLoaderBase.check_ckpt_list` (runtime/state_dict_factory.py), with tensor rank 0's file mapped
    rather than read. DeepSpeed's loads that whole file on every tensor rank, for each layer of a pipeline, only to
    compare its `mp_world_size` key with the number of files: through `reading_once`, each tensor rank's data group
    would then read and broadcast tensor rank 0's weights beside its own (at 175B, 11 GB more per rank per
    restart). Mapped, the load reads the pickle's few pages and no tensor's bytes, on the rank itself."""
    assert len(self.ckpt_list) > 0
    sd = safe_load(self.ckpt_list[0], "cpu", mmap=True)
    if "mp_world_size" in sd:
        assert len(self.ckpt_list) == sd["mp_world_size"], \
            f"checkpoint count {len(self.ckpt_list)} is different from saved mp_world_size {sd['mp_world_size']}"


def load_latest(engine, root: Path, on_skip=None, accept=None, data_group=None) -> dict | None:
    """Load the newest checkpoint that verifies on every rank (and that `accept(meta)` takes, when
    given); its meta, or None to start fresh. `on_skip(reason)` is called (on rank 0) for every
    checkpoint passed over for being corrupt or partial. `data_group`: the data-parallel process group
    (None: every rank is a replica), whose ranks share what they all read (`reading_once`)."""
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
        return load(engine, path, data_group)
    return None


def load(engine, path: Path, data_group=None) -> dict:
    """Load one (verified) checkpoint into the engine and this rank's RNGs; returns its meta. Written at another
    data-parallel or tensor degree under ZeRO 1-3, it is loaded through DeepSpeed's universal format (`universal`).
    The RNG states only into the layout that wrote them: elsewhere a rank's stream belongs to another shard."""
    rank, world = rank_world()
    meta = read_meta(path)
    now, change = layout_of(engine), None
    if reshaped(path, meta, now, world):
        change = {"from": meta["layout"], "to": now, "seconds": universal(engine, path, meta["layout"], now)}
    else:
        with reading_once(engine, data_group):
            engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
    rng = path / f"rng-rank{rank:05d}.pt"
    if meta["world_size"] == world and change is None and rng.is_file():  # the same ranks in the same places
        try:
            set_rng_state(torch.load(rng, weights_only=True))  # no pickle: rng_state holds tensors and numbers
        except pickle.UnpicklingError as exc:  # a file that needs pickle: planted, or from before this format
            log.warning("checkpoint %s: %s holds more than tensors and numbers, not loaded (%s): RNG states not "
                        "restored", path.name, rng.name, str(exc).splitlines()[0][:120])
    elif rank == 0:
        log.warning("checkpoint %s was written by %d ranks in another layout, now %d: RNG states not restored",
                    path.name, meta["world_size"], world)
    return {**meta, "path": str(path), **({"reshaped": change} if change else {})}


def reshaped(path: Path, meta: dict, now: dict, world: int) -> bool:
    """Whether checkpoint `path` must be converted to load into the layout `now` (DeepSpeed reads it as it is when
    the layout is the same, or under ZeRO-0 at another data-parallel degree); raises, saying why, where it cannot
    load. A checkpoint from before layouts were recorded loads as it is (DeepSpeed says so if it cannot)."""
    saved = meta.get("layout")
    if saved is None:
        return False
    if "tensor" not in saved:  # recorded before its tensor and pipeline degrees were: only their product is known
        split = meta["world_size"] // saved["data_parallel"]
        saved = {**saved, "tensor": 1 if split == 1 else None, "pipeline": 1 if split == 1 else None}
    if saved == now:
        return False
    was, to = f"ZeRO-{saved['zero_stage']}", f"ZeRO-{now['zero_stage']}"
    if (saved["zero_stage"] == 0) != (now["zero_stage"] == 0):
        raise RuntimeError(f"checkpoint {path.name} was written under {was} and this run is under {to}: ZeRO-0 keeps "
                           "its optimizer state whole and ZeRO 1-3 in partitions, so neither loads into the other; "
                           "keep train.zero_stage as it was")
    if saved["zero_stage"] != now["zero_stage"] and 3 in (saved["zero_stage"], now["zero_stage"]):
        raise RuntimeError(f"checkpoint {path.name} was written under {was} and this run is under {to}: DeepSpeed "
                           "0.19's ZeRO-3 universal load reads a step count the other stages do not convert; keep "
                           "train.zero_stage as it was")
    if saved["tensor"] is None:
        raise RuntimeError(f"checkpoint {path.name} was written by {saved['data_parallel']} replicas of a model split "
                           f"over {meta['world_size'] // saved['data_parallel']} workers, before its tensor and "
                           f"pipeline degrees were recorded: it loads only into its own layout")
    if saved["pipeline"] > 1 and not _describes_every_stage(path):
        raise RuntimeError(f"checkpoint {path.name} was written by a pipeline of {saved['pipeline']} stages before "
                           "its first stage described every stage's parameters to DeepSpeed's converter (issue 58): "
                           "it loads only into its own layout")
    if saved["tensor"] != now["tensor"] and now["zero_stage"] == 0:
        raise RuntimeError(f"checkpoint {path.name} was written at tensor degree {saved['tensor']} and this run's is "
                           f"{now['tensor']}: under ZeRO-0 no optimizer partitions are written, which DeepSpeed's "
                           "converter merges; a tensor degree change takes zero_stage 1 or 2")
    return now["zero_stage"] > 0


def _describes_every_stage(path: Path) -> bool:
    """Whether a pipeline's checkpoint describes the whole model to the converter (`universal_info`). One written
    before does not: its tied embedding would be taken from both stages, and a tensor-split one's shards merged
    along the default dimension. Its first model-states file holds no weights (a pipeline's are in layer files)."""
    states = safe_load(path / TAG / "mp_rank_00_model_states.pt", "cpu", mmap=True)
    return PIPELINE_REPLICATED_PATTERNS in states.get("universal_checkpoint_info", {})


def universal(engine, path: Path, saved: dict, now: dict) -> float:
    """Checkpoint `path`, written in layout `saved`, loaded in `now` (another data-parallel, tensor or pipeline
    degree): the ranks convert it together with DeepSpeed's ds_to_universal into `.universal-<step>/` beside it
    (fresh each time, never published, removed once every rank has loaded), and each rank reads its new partition
    from there with DeepSpeed's universal loading, under ZeRO 1-3 (1 and 2 into each other, 3 into 3); a ZeRO-0
    checkpoint holds its whole optimizer state in the model states and loads at any data-parallel degree without
    this.
    DeepSpeed's universal load takes the weights from the fp32 masters (engine.py `load_checkpoint`:
    `update_lp_params`) and reads no model-states file's weights, so a pipeline stage needs no layer files."""
    rank, _ = rank_world()
    out = path.parent / f".universal-{path.name}"
    started = time.monotonic()
    if rank == 0:
        for stale in path.parent.glob(".universal-*"):  # this one, or another left by an attempt that died loading
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    _convert(path / TAG, out / TAG)
    if rank == 0:
        if (saved.get("pipeline", 1) > 1) != (now["pipeline"] > 1):  # into a pipeline's names, or out of them
            _rename(out / TAG / "zero", partial(pipeline_name if now["pipeline"] > 1 else opt_name,
                                                n_layer=_model_config(engine).n_layer))
        split = "".join(f", {what} degree {saved.get(what, 1)} then {now[what]}" for what in ("tensor", "pipeline")
                        if saved.get(what, 1) != now[what])
        log.warning("checkpoint %s: written by %d data-parallel ranks, loaded by %d%s: converted to DeepSpeed's "
                    "universal format in %.1f s", path.name, saved["data_parallel"], now["data_parallel"], split,
                    time.monotonic() - started)
    barrier()
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer under ZeRO's
    built = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    with _replaced(engine._config, "load_universal_checkpoint", True), _weights_only_loads():
        engine.load_checkpoint(str(out), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
    _mend(optimizer, built, zero3=now["zero_stage"] == 3)
    barrier()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    return time.monotonic() - started


def _rename(zero: Path, rename) -> None:
    """The universal folder's parameters (a folder each, under `zero/`) renamed for the layout that loads them,
    which DeepSpeed's universal load looks up by its own parameters' names (base_optimizer.py
    `load_hp_checkpoint_state_from_checkpoint_dir`): a pipeline's (`train/parallel/pipeline.py` `pipeline_name`) or
    the whole OPT's (`opt_name`)."""
    for entry in zero.iterdir():
        if entry.is_dir():
            entry.rename(zero / rename(entry.name))


def _model_config(engine):
    """The OPT's config, whether the engine runs a pipeline stage or the model."""
    return engine.module.opt_config if pipelined(engine) else engine.module.config


def _convert(source: Path, target: Path) -> None:
    """DeepSpeed's ds_to_universal on one checkpoint's files, called by every rank at once: its two phases that read
    and write the bulk of it (each optimizer file's fragments extracted, then each parameter's merged) shared out
    over the ranks (`_spread`), where DeepSpeed spreads them over one machine's processes; rank 0 alone writes the
    rest (the optimizer's common state, the model-states files). Every file it reads goes through
    `_weights_only_loads`, memory-mapped: each rank reads every model-states file for its metadata, and reads no
    weights in it that it does not use."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    said = io.StringIO()  # its progress bars and prints: shown only if it fails
    try:
        with _weights_only_loads(mmap=True), contextlib.redirect_stdout(said), contextlib.redirect_stderr(said), \
                _replaced(ds_to_universal, "_do_parallel_work", _spread):
            ds_to_universal.main(args)
    except _Handed:
        pass
    except Exception as exc:
        raise RuntimeError(f"DeepSpeed's ds_to_universal could not convert {source}: {exc!r}\n{said.getvalue()[-2000:]}") from exc


class _Handed(Exception):
    """A rank other than 0 has done its share of a conversion; rank 0 writes the rest."""


def _spread(do_work, work, num_workers) -> list:
    """ds_to_universal's `_do_parallel_work` (checkpoint/ds_to_universal.py), over the ranks: each does every
    world-th item of the work, sorted so that every rank has the same list (DeepSpeed builds the merge's from a
    set), and every rank gets every result (the merge's unused split patterns, which its strict mode checks). A
    rank's error is every rank's, not a hang. After the last phase, the merge, the ranks but 0 leave (`_Handed`).
    At 175B each of the 992 ranks extracts one optimizer file and merges about two parameters."""
    rank, world = rank_world()
    items = sorted(work, key=lambda w: w[0] if isinstance(w, tuple) and isinstance(w[0], str) else w)
    try:
        mine, error = [do_work(item) for item in items[rank::world]], None
    except Exception as exc:
        mine, error = [], f"rank {rank}: {exc!r}"
    shares = all_gather_objects((mine, error))
    if errors := [e for _, e in shares if e is not None]:
        raise RuntimeError(errors[0])
    if rank != 0 and getattr(do_work, "func", do_work).__name__.startswith("merge_"):
        raise _Handed
    return [result for share, _ in shares for result in share]


def _mend(optimizer, built: list[dict], zero3: bool) -> None:
    """After DeepSpeed 0.19's universal load: each state's step count its own tensor, on its parameter's device. The
    converter reads them to the CPU (checkpoint/zero_checkpoint.py), where fused AdamW on a GPU keeps them on the
    GPU; and ZeRO-3's load (runtime/zero/stage3.py `_load_universal_checkpoint`) puts one tensor in every
    sub-group's state, which AdamW then advances once per sub-group. ZeRO-3's load also gives every parameter group
    the first group's hyperparameters (here the biases' and norms' weight decay 0.0 would become 0.1): each group's
    are put back as built."""
    if zero3:
        for group, own in zip(optimizer.param_groups, built):
            group.update(own)
    for param, state in optimizer.state.items():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].detach().clone().to(param.device)


@contextlib.contextmanager
def _weights_only_loads(mmap: bool = False) -> Iterator[None]:
    """Every `torch.load` in the meantime as `safe_load` reads (a file that needs pickle's code refused, named):
    DeepSpeed's universal conversion and loading read their files with `torch.load(weights_only=False)` directly,
    past its checkpoint engine. `mmap`: the tensors' bytes are read only when used."""
    original = torch.load

    def load(f, map_location=None, **kwargs):
        kwargs.pop("weights_only", None)
        if mmap:
            kwargs.setdefault("mmap", True)
        return _weights_only(original, f, map_location, **kwargs)

    with _replaced(torch, "load", load):
        yield


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

"""The few collectives the loop and the checkpoints need, on the device the process group takes.

Ray Train starts an NCCL-only process group on GPU workers and a gloo one on CPU workers. NCCL
refuses CPU tensors ("No backend type associated with device type cpu"), so every tensor a
collective touches is made here, on `device()`: the current CUDA device under NCCL, the CPU
otherwise. No module calls `dist.all_reduce` on a tensor of its own making.

Without an initialized process group (one process, tests) each call is the identity, so the same
code runs in one process and on every rank of a Ray Train job.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    if initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def backend() -> str | None:
    """The process group's backend ("nccl", "gloo"), None without one."""
    return dist.get_backend() if initialized() else None


def device() -> torch.device:
    """Where the process group's collectives take their tensors."""
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if initialized():
        dist.barrier()


def all_mean(values: list, same: list = ()) -> list[float]:
    """The mean over ranks of each of `values`, then each of `same` as it is (what every rank holds alike already:
    the global grad norm), all floats or 0-dim tensors on any device: one all_reduce and one copy to the host (a
    training step's only read of the device: tests/test_loop_parts.py counts them)."""
    tensors = [v for v in [*values, *same] if torch.is_tensor(v)]
    where = device() if initialized() else tensors[0].device if tensors else torch.device("cpu")
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=where).reshape(()) for v in [*values, *same]])
    if initialized() and values:
        mean = t[:len(values)]
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return t.tolist()


def all_gather_float(value: float) -> list[float]:
    """Every rank's value, in rank order."""
    if not initialized():
        return [float(value)]
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device())
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


def all_gather_objects(value) -> list:
    """Every rank's `value` (any picklable object), in rank order. Torch moves the pickles through the backend's
    device (the current CUDA device under NCCL)."""
    if not initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def all_ok(ok: bool) -> bool:
    """True on every rank when every rank says ok."""
    if not initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


ALIGN = 64  # bytes: read_once's offsets, so that a view of any dtype starts where its dtype may


def read_once(read, key: str, group=None):
    """`read()`'s result (a state dict, say), read only by the first rank of `group` (None: every rank) when
    every rank of it asks for the same `key` (the path of a file each data-parallel replica would read), and
    sent to the others: its tensors as one byte buffer in one broadcast, the rest pickled. Where the ranks
    ask for different keys, each reads its own. Every rank of the group calls this the same number of times,
    as it calls the reader it replaces. The receivers' tensors are on the host where the reader's were, else
    on this rank's device; tensors that shared memory on the reader arrive as copies."""
    size = dist.get_world_size(group) if initialized() else 1
    if size == 1:
        return read()
    keys: list = [None] * size
    dist.all_gather_object(keys, key, group=group)
    if len(set(keys)) > 1:
        return read()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    reader, tensors = dist.get_rank() == src, []
    obj = read() if reader else None
    box = [(_hollow(obj, tensors, {}), [(t.shape, t.dtype, t.device.type) for t in tensors]) if reader else None]
    dist.broadcast_object_list(box, src=src, group=group, device=device())
    skeleton, specs = box[0]
    # One buffer, allocated once, each tensor's bytes at an offset aligned for any dtype: the reader copies into
    # it, and a receiver's device tensors are views of it (its host tensors, copies to the host).
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype, _ in specs]
    offsets = [0, *itertools.accumulate(-(-n // ALIGN) * ALIGN for n in sizes)][:len(sizes)]
    flat = torch.empty(offsets[-1] + sizes[-1] if sizes else 0, dtype=torch.uint8, device=device())
    if reader:
        for t, at, n in zip(tensors, offsets, sizes):
            flat[at:at + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    dist.broadcast(flat, src=src, group=group)
    if reader:
        return obj
    received = []
    for (shape, dtype, where), at, n in zip(specs, offsets, sizes):
        piece = flat[at:at + n]
        received.append((piece.to("cpu") if where == "cpu" else piece).view(dtype).reshape(shape))
    return _fill(skeleton, received)


class _Slot(int):
    """Where `read_once`'s skeleton had a tensor: its index in the broadcast."""


def _hollow(obj, tensors: list, seen: dict):
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen[id(obj)] = _Slot(len(tensors))
            tensors.append(obj)
        return seen[id(obj)]
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _hollow(v, tensors, seen)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_hollow(v, tensors, seen) for v in obj)
    return obj  # anything else goes pickled, a tensor inside it too


def _fill(obj, tensors: list):
    if isinstance(obj, _Slot):
        return tensors[obj]
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def set_default_timeout(seconds: float) -> None:
    """Every process group this process creates from now on, ours or DeepSpeed's, waits `seconds` in a
    collective before failing. Ray Train's `TorchConfig(timeout_s)` reaches the world group only; torch gives
    a group created without a timeout `_get_default_timeout(backend)`, 10 minutes for NCCL (both in
    torch/distributed/distributed_c10d.py), and DeepSpeed creates its pipeline and tied groups so
    (deepspeed/comm/torch.py: `new_group(ranks)`). Left there, a peer's NCCL timeout would end a step
    before a hung rank's watchdog (train.hang_seconds) says why, and a long write on one rank (the export's)
    would abort the run. Set before any group is made."""
    from torch.distributed import distributed_c10d

    value = timedelta(seconds=seconds)
    distributed_c10d.default_pg_timeout = value
    if isinstance(distributed_c10d.default_pg_nccl_timeout, timedelta):  # None where torch has no NCCL
        distributed_c10d.default_pg_nccl_timeout = value


def bus_bandwidth(rank: int, world: int, init_method: str, cuda: bool, megabytes: int, rounds: int = 5) -> float:
    """All-reduce bus bandwidth in GB/s over a process group of its own (NCCL with `cuda`, else gloo), as
    nccl-tests reports it: 2 (n - 1) / n x bytes / time. For the node health probe (train/health.py), in
    processes it spawns, apart from any training group."""
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        t = torch.ones(megabytes * 2**18, device=device)  # 4 bytes each
        dist.all_reduce(t)  # warm up: the connections are made
        began = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - began) / rounds
    finally:
        dist.destroy_process_group()
    return 2 * (world - 1) / world * t.numel() * 4 / seconds / 1e9

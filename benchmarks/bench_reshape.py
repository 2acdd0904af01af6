"""What a change of data-parallel degree costs a restart: loading a checkpoint written by 2 ranks into 1, through
DeepSpeed's ds_to_universal and universal loading (train/checkpoint_files.py `universal`), against loading one that
1 rank wrote (the baseline: the same model, stage and loading rank, no conversion). One process loads both, in turns.
Then the other way, the 1-rank checkpoint into 2 ranks: its conversion shared by both ranks (`_spread`), against
rank 0 converting alone while the other waits (the baseline: how it ran before issue 58's third step), in turns.

    python benchmarks/bench_reshape.py [--model 125m] [--zero 2] [--rounds 2]

Each rank trains one step of the model (fp32, so that Adam's moments exist) and saves with
`checkpoint_files.save`; the 2-rank checkpoint is written by 2 spawned gloo ranks. Prints the checkpoint's bytes,
each load's seconds (the conversion's apart) and the ratio, for docs/benchmarks.md; docs/scale.md prices 175B from
the conversion's bytes per second.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

SEQ, MICRO = 128, 2  # tokens per sequence, sequences per micro-batch


def engine(model: str, zero: int, world: int, rank: int):
    import deepspeed

    from model.configs import get
    from train.build import build
    from train.optim import adamw, deepspeed_config

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds = deepspeed_config(micro_batch=MICRO, accumulation=2 // world, world_size=world, zero_stage=zero,
                          precision="fp32", grad_clip=1.0)
    module = build(get(model).replace(dropout=0.0), ds, seed=0, rank=rank)
    built, *_ = deepspeed.initialize(model=module, optimizer=adamw(module, 1e-4, 0.1), config=ds)
    return built


def one_step(built, rank: int, world: int) -> None:
    ids = torch.randint(0, built.module.config.vocab_size, (2 * MICRO, SEQ + 1),
                        generator=torch.Generator().manual_seed(0)).chunk(world)[rank]
    for micro in ids.split(MICRO):
        built.backward(built(micro[:, :-1], micro[:, 1:]))
        built.step()


def write(rank: int, world: int, root: str, model: str, zero: int, port: int) -> None:
    """Rank `rank` of `world`: one step, then its share of the checkpoint root/step-00000001."""
    import deepspeed

    from train import checkpoint_files

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no g++ build of a shared-memory op
    deepspeed.init_distributed(dist_backend="gloo")
    built = engine(model, zero, world, rank)
    one_step(built, rank, world)
    checkpoint_files.save(built, Path(root), 1, {"health": {"healthy": True}})


def load_in_two(rank: int, world: int, root: str, model: str, zero: int, port: int, rounds: int) -> None:
    """Rank `rank` of 2: load the 1-rank checkpoint root/one/step-00000001 `rounds` times in each of two ways, in
    turns: the conversion shared (`_spread`) or by rank 0 alone; rank 0 writes each conversion's seconds to
    root/two-ranks.json."""
    import deepspeed

    from train import checkpoint_files

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    built = engine(model, zero, world, rank)
    shared, spread, times = checkpoint_files._convert, checkpoint_files._spread, {"alone": [], "shared": []}

    def alone(source, target):  # the baseline: rank 0 converts, one item after another; the other waits
        if rank == 0:
            with patched(checkpoint_files, "_spread", lambda do_work, work, _: [do_work(w) for w in work]):
                shared(source, target)

    for _ in range(rounds):
        for way, convert in (("alone", alone), ("shared", shared)):
            def timed(source, target, convert=convert, way=way):
                began = time.perf_counter()
                convert(source, target)
                torch.distributed.barrier()
                times[way].append(time.perf_counter() - began)

            with patched(checkpoint_files, "_convert", timed):
                checkpoint_files.load(built, Path(root) / "one" / "step-00000001")
    assert checkpoint_files._spread is spread
    if rank == 0:
        (Path(root) / "two-ranks.json").write_text(json.dumps(times))


class patched:
    """`obj.name` replaced by `value` for a while."""

    def __init__(self, obj, name: str, value):
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self):
        self.saved = getattr(self.obj, self.name)
        setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.saved)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="125m", help="the OPT model by name (model/configs.py)")
    p.add_argument("--zero", type=int, default=2, choices=(1, 2, 3), help="the ZeRO stage of both checkpoints")
    p.add_argument("--rounds", type=int, default=2, help="loads of each checkpoint, in turns")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    import torch.multiprocessing as mp

    from train import checkpoint_files

    with tempfile.TemporaryDirectory() as tmp:
        two, one = Path(tmp) / "two", Path(tmp) / "one"
        began = time.perf_counter()
        mp.spawn(write, args=(2, str(two), args.model, args.zero, free_port()), nprocs=2, join=True)
        print(f"written by 2 ranks in {time.perf_counter() - began:.1f} s", flush=True)
        write(0, 1, str(one), args.model, args.zero, free_port())  # this process becomes rank 0 of 1 here
        size = sum(p.stat().st_size for p in (two / "step-00000001").rglob("*") if p.is_file())
        built = engine(args.model, args.zero, 1, 0)
        times: dict[str, list[float]] = {"same degree": [], "another degree": [], "conversion": []}
        for _ in range(args.rounds):
            began = time.perf_counter()
            checkpoint_files.load(built, one / "step-00000001")
            times["same degree"].append(time.perf_counter() - began)
            began = time.perf_counter()
            meta = checkpoint_files.load(built, two / "step-00000001")
            times["another degree"].append(time.perf_counter() - began)
            times["conversion"].append(meta["reshaped"]["seconds"])
        mp.spawn(load_in_two, args=(2, tmp, args.model, args.zero, free_port(), args.rounds), nprocs=2, join=True)
        two_ranks = json.loads((Path(tmp) / "two-ranks.json").read_text())
    same, other = statistics.median(times["same degree"]), statistics.median(times["another degree"])
    print(f"\n{args.model}, ZeRO-{args.zero}, fp32; the checkpoint of 2 ranks: {size / 1e9:.2f} GB; medians of "
          f"{args.rounds} loads each, in turns, by one rank\n")
    print("| load | seconds | / same degree |\n|---|---:|---:|")
    print(f"| written by 1 rank (the baseline) | {same:.1f} | 1.00x |")
    print(f"| written by 2 ranks: converted and loaded | {other:.1f} | {other / same:.2f}x |")
    print(f"\nconversion and universal load: {statistics.median(times['conversion']):.1f} s (each: "
          f"{', '.join(f'{t:.1f}' for t in times['another degree'])}); "
          f"{size / 1e6 / statistics.median(times['another degree']):.0f} MB of checkpoint a second")
    alone, shared = statistics.median(two_ranks["alone"]), statistics.median(two_ranks["shared"])
    print(f"\nthe 1-rank checkpoint loaded by 2 ranks: its conversion, medians of {args.rounds} each, in turns\n")
    print("| conversion | seconds | / rank 0 alone |\n|---|---:|---:|")
    print(f"| by rank 0 alone (the baseline) | {alone:.1f} | 1.00x |")
    print(f"| shared by both ranks | {shared:.1f} | {shared / alone:.2f}x |")
    print(f"\neach: alone {', '.join(f'{t:.1f}' for t in two_ranks['alone'])}; "
          f"shared {', '.join(f'{t:.1f}' for t in two_ranks['shared'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

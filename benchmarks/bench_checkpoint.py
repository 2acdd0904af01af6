"""How long a checkpoint save stops training: written in the background against written in place.

    python benchmarks/bench_checkpoint.py [--model 125m] [--saves 3] [--zero 1] [--out /tmp/bench_checkpoint]

In this process, as rank 0 of 1 of a gloo group (a CPU Ray Train worker's setup): the model under
DeepSpeed (fp32, the given ZeRO stage, AdamW), one step trained, then `--saves` saves each way through
`train.loop.checkpointer.Checkpointer`, the loop's own saver:
- baseline, `background=False`: every rank waits for the write, the hashes and the publish (what the
  run did before, and what OPT-175B's did);
- ours, `background=True`: the state is copied to host memory, a thread writes, hashes and publishes;
  a training step runs while it does, and the wait for the write at the next save counts as blocked.
Prints blocked and write seconds per save (medians), and blocked over write (the goal: under 0.25).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

from model.configs import get  # noqa: E402
from model.opt import OPT  # noqa: E402
from train.loop.checkpointer import Checkpointer  # noqa: E402
from train.loop.context import Context  # noqa: E402
from train.optim import adamw, deepspeed_config  # noqa: E402

from gap_attrib import one_rank  # noqa: E402


def step(engine, seq: int, seed: int) -> float:
    began = time.perf_counter()
    ids = torch.randint(0, 512, (1, seq + 1), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()
    return time.perf_counter() - began


def measure(engine, folder: Path, background: bool, saves: int, seq: int) -> list[dict]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ctx = Context(rank=0, world=1, run_dir=folder, device=torch.device("cpu"))
    out: list[dict] = []
    saver = Checkpointer(engine, ctx, every=1, keep=2, keep_healthy=0, last_step=10**9, background=background,
                         on_written=lambda s, blocked, write: out.append({"step": s, "blocked": blocked, "write": write}))
    for i in range(1, saves + 1):
        saver.save(i, {"loader": {"step": i}})
        step(engine, seq, i)  # training goes on while a background write runs
    saver.flush()
    return out


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="125m")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", default="/tmp/bench_checkpoint")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    import deepspeed

    one_rank("gloo")
    torch.manual_seed(0)
    model = OPT(get(args.model).replace(dropout=0.0))
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model, 1e-4, 0.1), config=deepspeed_config(
        micro_batch=1, accumulation=1, world_size=1, zero_stage=args.zero, precision="fp32", grad_clip=1.0))
    step(engine, args.seq, 0)
    results = {}
    for name, background in (("in place (baseline)", False), ("background (ours)", True)):
        rows = measure(engine, Path(args.out) / name.split()[0], background, args.saves, args.seq)
        results[name] = {"blocked": statistics.median(r["blocked"] for r in rows),
                         "write": statistics.median(r["write"] for r in rows)}
    size = sum(p.stat().st_size for p in (Path(args.out) / "background").rglob("*") if p.is_file()) / args.saves / 1e9
    print(f"model {args.model}, ZeRO-{args.zero} fp32, {args.saves} saves of about {size:.2f} GB\n")
    print("| save | blocked s (median) | write s (median) | blocked / write |\n|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['blocked']:.2f} | {r['write']:.2f} | {r['blocked'] / r['write']:.3f} |")
    ours, base = results["background (ours)"], results["in place (baseline)"]
    print(f"\nblocked time, ours / baseline: {ours['blocked'] / base['blocked']:.3f}")
    print(json.dumps({"ours": ours, "baseline": base}))
    engine.destroy()


if __name__ == "__main__":
    main()

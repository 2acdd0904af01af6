"""Where our training step's time goes against a bare PyTorch loop, switch by switch: one device, no Ray, no
MLflow (a few minutes on one H100).

    python benchmarks/gap_attrib.py [--models 125m,1.3b] [--steps 12] [--out /tmp/gap_attrib]   # on a GPU
    python benchmarks/gap_attrib.py --dry-run                                                    # any CPU, tiny

For each model, on the same micro-batches (random token ids, seq_len 2048; the dry run: tiny, 64), in bf16:
- `bare pure`: the model cast whole to bf16, torch's fused AdamW: no fp32 master weights, the ceiling;
- `bare fair`: fp32 weights under bf16 autocast, fused AdamW: what a training run needs, the baseline;
- `ours before`: our step (`train.loop.step.TrainStep`) on DeepSpeed ZeRO-2 bf16 with fp32 gradient sums, its
  throughput timer on and torch's single-tensor AdamW: the engine as issue 57 found it;
- then one switch after another, each on top of the last: `timers off`, `fused AdamW`, and `ZeRO-0 autocast`
  (DeepSpeed an fp32 engine, the forward under autocast, the update skipped on the device if not finite, no
  gradient averaging over the one replica):
  ours now (train/optim.py), on one device; and `compiled blocks`, that with `train.compile: true` (each
  transformer block through torch.compile; its compile is in the two untimed steps).
Per variant: the median step over `--steps` (after two untimed), tokens/s, MFU, peak device memory, and
from torch.profiler over three more steps, per step: host reads (`aten::_local_scalar_dense`), device
synchronizations and device-to-host copies (CUDA), kernel launches, and device time by kind of kernel.
Prints a Markdown table and writes gap_attrib.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from model.configs import flops_per_token, get  # noqa: E402
from model.opt import OPT  # noqa: E402
from train.loop.context import Context  # noqa: E402
from train.loop.engine import compile_blocks, skip_lone_averaging  # noqa: E402
from train.loop.metrics import peak_tflops  # noqa: E402
from train.loop.step import TrainStep  # noqa: E402
from train.optim import BETAS, EPS, deepspeed_config, param_groups  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)
from bench_train import bare_loop  # noqa: E402

# Per model: sequence length, sequences per step, per micro-batch (bench_train.py's GPU setups; tiny: the dry
# run's, small: this CPU has no bf16 kernels, and a step of bench_train's tiny batch takes 1.5 s in bf16 here).
SETUPS = {"tiny": (64, 8, 4), "125m": (2048, 32, 8), "1.3b": (2048, 16, 4)}
# Ours, switch by switch: (label, ZeRO stage, DeepSpeed's throughput timer, fused AdamW, compiled blocks); each adds
# one switch. The last is `train.compile: true` (train/loop/engine.py compile_blocks).
OURS = [("ours before", 2, True, False, False), ("timers off", 2, False, False, False),
        ("fused AdamW", 2, False, True, False), ("ZeRO-0 autocast", 0, False, True, False),
        ("compiled blocks", 0, False, True, True)]
KINDS = {"gemm": ("gemm", "cutlass", "xmma", "wgmma", "nvjet", "matmul", "addmm", "mm"), "attention": ("flash", "fmha", "attention"),
         "optimizer": ("adam",), "norm": ("layer_norm", "layernorm"), "loss": ("softmax", "log_softmax", "nll", "gather")}


@dataclass
class Row:
    model: str
    variant: str
    step_seconds: float
    tokens_per_second: float
    mfu: float | None
    peak_memory_gb: float | None
    host_reads: float  # per step, from the profiler
    synchronizations: float
    device_to_host: float
    kernel_launches: float
    device_ms_by_kind: dict = field(default_factory=dict)  # per step
    top_other_ms: dict = field(default_factory=dict)  # per step: the kernels of kind "other" that took longest


class Batches:
    """The same micro-batches every step (TrainStep's feed: `next()` gives the batch number and the micro-batches)."""

    def __init__(self, tokens: torch.Tensor, micro: int):
        self.micro_batches = [(m[:, :-1], m[:, 1:]) for m in tokens.split(micro)]
        self.weights = [1.0] * len(self.micro_batches)  # one rank: each micro-batch's gradient as it is
        self.count = 0

    def next(self):
        self.count += 1
        return self.count - 1, self.micro_batches


def variants(name: str, device: torch.device, tokens: torch.Tensor, micro: int, out: Path, only: set[str] | None = None):
    """(label, a callable that runs one step, what to free after) for each variant (of `only`, if given), built
    one at a time."""
    import deepspeed

    config = get(name).replace(max_seq_len=max(tokens.size(1) - 1, get(name).max_seq_len))
    for label, pure in (("bare pure", True), ("bare fair", False)):
        if only and label not in only:
            continue
        yield label, functools.partial(bare_loop(config, device.type, "bf16", pure), tokens, micro), None
    accumulation = tokens.size(0) // micro
    for label, zero, timers, fused, compiled in OURS:
        if only and label not in only:
            continue
        ds_config = deepspeed_config(micro_batch=micro, accumulation=accumulation, world_size=1, zero_stage=zero,
                                     precision="bf16", grad_clip=1.0)
        ds_config["timers"] = {"throughput": {"enabled": timers}}
        model = OPT(config, seed=0)
        if compiled:
            compile_blocks(model, device)
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=BETAS, eps=EPS, fused=fused)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        skip_lone_averaging(engine, zero, 1, pipelined=False)  # ours now at ZeRO-0: no averaging over one replica
        ctx = Context(rank=0, world=1, run_dir=out, device=device)
        step = TrainStep(engine, model, Batches(tokens, micro), ctx, own_grad_norm=zero == 0)
        yield label, functools.partial(step, 1e-4), engine
        del model, opt, step, engine


def kind_of(kernel: str) -> str:
    low = kernel.lower()
    return next((kind for kind, marks in KINDS.items() if any(m in low for m in marks)), "other")


def inside(event, prefix: str) -> bool:
    """Whether a profiler event runs inside an op whose name starts with `prefix`."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def profile(step, steps: int, cuda: bool) -> dict:
    """Per-step counts from torch.profiler over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    counts = {"host_reads": 0, "synchronizations": 0, "device_to_host": 0, "kernel_launches": 0}
    by_kind: dict[str, float] = {}
    other: dict[str, float] = {}
    for e in prof.events():
        name = e.name
        if name == "aten::_local_scalar_dense" and not inside(e, "aten::_fused_adam"):  # the CPU kernel reads
            counts["host_reads"] += 1  # its step counts in host memory: no device there to wait for
        elif name in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"):
            counts["synchronizations"] += 1
        elif "DtoH" in name or "Device -> Pageable" in name:
            counts["device_to_host"] += 1
        elif name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            counts["kernel_launches"] += 1
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + e.device_time_total / 1e3
            if kind_of(name) == "other":  # for KINDS: which names it misses
                other[name] = other.get(name, 0.0) + e.device_time_total / 1e3
    per_step = {k: v / steps for k, v in counts.items()}
    per_step["device_ms_by_kind"] = {k: round(v / steps, 2) for k, v in sorted(by_kind.items())}
    per_step["top_other_ms"] = {k: round(v / steps, 2) for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:8]}
    return per_step


def each_variant(name: str, device: torch.device, out: Path, only: set[str] | None, use, say) -> dict:
    """`use(step)` on each variant's step in turn, over the model's fixed batch, each variant freed before the
    next is built: {label: what `use` gave}. Prints `say(what it gave)` as each is done, so that a run cut short
    shows how far it got."""
    seq_len, batch, micro = SETUPS[name]
    tokens = torch.randint(4, get(name).vocab_size, (batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for label, step, engine in variants(name, device, tokens, micro, out, only):
        results[label] = use(step)
        print(f"{name} {label}: {say(results[label])}", flush=True)
        if engine is not None:
            engine.destroy()
        del step, engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def timed(step, steps: int, device: torch.device) -> tuple[float, float | None]:
    """The median step in seconds over `steps` (after two untimed), and the peak device memory in GB."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]), torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None


def measure(models: list[str], device: torch.device, steps: int, profiled: int, out: Path,
            only: set[str] | None = None) -> list[Row]:
    """Every variant timed first, then every one profiled, each built afresh: a variant timed after torch.profiler
    had run in the process was slower (an H200, 2026-12-04: the same 125M fair bare loop 344 ms a step after a
    profiled variant, 256 ms before any), so no timing follows a profile."""
    times = {name: each_variant(name, device, out, only, lambda step: timed(step, steps, device),
                                lambda t: f"{t[0] * 1e3:.1f} ms a step") for name in models}
    counts = {name: each_variant(name, device, out, only, lambda step: profile(step, profiled, device.type == "cuda"),
                                 lambda c: f"{c['host_reads']:g} host reads a step") for name in models}
    peak = peak_tflops(device, "bf16")
    rows = []
    for name in models:
        seq_len, batch, _ = SETUPS[name]
        per_token = flops_per_token(get(name), seq_len)
        for label, (seconds, memory) in times[name].items():
            rate = batch * seq_len / seconds
            rows.append(Row(name, label, seconds, rate, rate * per_token / 1e12 / peak if peak else None, memory,
                            **counts[name][label]))
    return rows


def table(rows: list[Row]) -> list[str]:
    lines = ["| model | variant | ms a step | tokens/s | x fair bare | MFU | peak GB | host reads | syncs | DtoH | "
             "launches | device ms by kind |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    fair = {r.model: r.step_seconds for r in rows if r.variant == "bare fair"}
    for r in rows:
        kinds = ", ".join(f"{k} {v:g}" for k, v in r.device_ms_by_kind.items()) or "-"
        lines.append(f"| {r.model} | {r.variant} | {r.step_seconds * 1e3:.1f} | {r.tokens_per_second:,.0f} | "
                     f"{f'{r.step_seconds / fair[r.model]:.2f}x' if r.model in fair else '-'} | {f'{r.mfu:.1%}' if r.mfu is not None else '-'} | "
                     f"{f'{r.peak_memory_gb:.1f}' if r.peak_memory_gb is not None else '-'} | {r.host_reads:g} | "
                     f"{r.synchronizations:g} | {r.device_to_host:g} | {r.kernel_launches:g} | {kinds} |")
    return lines


def one_rank(backend: str) -> None:
    """A process group of one (DeepSpeed's engines want one), unless this process is in one already."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no g++ build of a shared-memory op
    deepspeed.init_distributed(dist_backend=backend)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="125m,1.3b")
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant, after two untimed")
    p.add_argument("--dry-run", action="store_true", help="on CPU: the tiny model, one timed step, one profiled")
    p.add_argument("--out", default="/tmp/gap_attrib")
    p.add_argument("--variants", type=lambda v: set(v.split(",")), default=None,
                   help="only these, by label, e.g. 'bare fair,ZeRO-0 autocast' (default: all, in order)")
    return p


def main(argv: list[str] | None = None) -> list[Row]:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    unknown = (args.variants or set()) - {"bare pure", "bare fair"} - {v[0] for v in OURS}
    if unknown:
        raise SystemExit(f"--variants: no variant {sorted(unknown)}")
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    models, steps, profiled = (["tiny"], 1, 1) if args.dry_run else (args.models.split(","), args.steps, 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    one_rank("nccl" if cuda else "gloo")
    rows = measure(models, device, steps, profiled, out, args.variants)
    (out / "gap_attrib.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(torch.cuda.get_device_name(device) if cuda else "cpu", "bf16")
    print("\n".join(table(rows)))
    return rows


if __name__ == "__main__":
    main()

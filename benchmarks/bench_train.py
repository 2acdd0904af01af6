"""Training throughput: the train stage's step against a bare PyTorch loop, on this machine.

    python benchmarks/bench_train.py [--models tiny,125m] [--out /tmp/bench_train]

For each model: token shards of random ids (seq_len 128 for tiny, 2048 for 125M), then, on the same micro-batches,
runs of 22 steps (125M on CPU: 3 rounds of 7), the first two of each run not timed:
- ours: the train stage itself (`train.stage.run`: Ray Train, one worker with every core, DeepSpeed with
  configs/local.yaml's train settings, our loader, metrics.jsonl every step, sent to MLflow by the driver), tokens/s
  from its metrics.jsonl (median over the timed steps);
- the fair bare loop (`bare_loop`), in a Ray worker before and after each of ours: the same model, fp32 master weights
  (autocast for bf16 and fp16), torch's fused AdamW with our settings, `loss.backward(); clip_grad_norm_;
  step()`, no DeepSpeed, the same number of threads; tokens/s as the median step;
- in bf16 or fp16, the pure bare loop beside it (the model cast whole: no fp32 master weights), the ceiling.
Prints a Markdown table with the ratio (time per token, ours / fair bare; goal <= 1.10x).

On a GPU machine `--device cuda --precision bf16` measures the same on one GPU and adds MFU
(see docs/benchmarks.md for what was run there)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_tokenize import make_shards  # noqa: E402
from model.configs import flops_per_token, get  # noqa: E402
from model.opt import OPT  # noqa: E402
from train import records  # noqa: E402
from train.loop.metrics import peak_tflops  # noqa: E402
from train.optim import adamw  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

# Batch and steps per device: on 2 CPU cores a 125M step of two sequences already takes 55-90 s; on
# one GPU the micro-batch must be large enough to fill it (MFU is the question there).
# Steps a run: the first two (allocator, autotuning) are not timed. `rounds`: runs of ours, each between two of the
# bare loop's, so that the host's drift (10-30% within minutes on 2 cores) weighs on both sides alike; one round of a
# 125M step a minute would leave ours 25 minutes away from the bare loop's middle.
SETUPS = {"cpu": {"tiny": {"seq_len": 128, "batch": 32, "micro": 8, "steps": 22},
                  "125m": {"seq_len": 2048, "batch": 2, "micro": 1, "steps": 7, "rounds": 3}},
          "cuda": {"tiny": {"seq_len": 128, "batch": 256, "micro": 64, "steps": 22},
                   "125m": {"seq_len": 2048, "batch": 32, "micro": 8, "steps": 22},
                   "1.3b": {"seq_len": 2048, "batch": 16, "micro": 4, "steps": 22}}}


def train_stage(out: Path, label: str, shards: Path, overrides: list[str]) -> Path:
    """The train stage itself (`train.stage.run`, Ray Train + DeepSpeed, MLflow) over `shards`, with
    configs/local.yaml's train section and `overrides` (--set syntax); its output folder."""
    from pipelines.config import load_config
    from core.dag import StageContext
    from core.tracking import MlflowTracker
    from pipelines.config import CHECKS
    from train import stage

    config = load_config(ROOT / "configs" / "local.yaml", [f"workdir={out}/work", *overrides], checks=CHECKS)
    tracker = MlflowTracker(config.mlflow.tracking_uri, "bench_train")
    folder = out / label / "stage"
    folder.mkdir(parents=True)
    with tracker.stage(f"train-{label}", {}, {}) as run_id:
        ctx = StageContext("train", config, config.train, {"tokenize": {"output": str(shards)}}, folder,
                           logging.getLogger("bench"), run_id, fingerprint=label.replace(".", "_").ljust(16, "0"))
        stage.run(ctx)
    return folder / "output"


def ours(name: str, shards: Path, out: Path, steps: int, cpus: int, device: str, precision: str,
         overrides: list[str], label: str) -> tuple[list[float], list[dict]]:
    setup = SETUPS[device][name]
    output = train_stage(out, label, shards, [
        f"train.model={name}", "train.num_workers=1", f"train.cpus_per_worker={cpus}",
        f"train.gpus_per_worker={1 if device == 'cuda' else 0}", f"train.precision={precision}",
        f"train.micro_batch_size={setup['micro']}", f"train.global_batch_tokens={setup['batch'] * setup['seq_len']}",
        f"train.max_steps={steps}", f"train.checkpoint_every={steps}", "train.eval_every=0", "train.warmup_tokens=0", "train.seeds=1",
        *overrides])
    rows = records.read(output, records.STEP)
    return [r["tokens_per_second"] for r in rows][2:], rows


def bare_loop(config, device: str, precision: str, pure: bool = False):
    """The bare loop's step, `step(tokens, micro)` over a batch of token rows in micro-batches of `micro`: no
    DeepSpeed, no Ray, torch's fused AdamW with our settings, `loss.backward(); clip_grad_norm_; step()`.
    The fair loop keeps fp32 master weights, as training needs and nanoGPT and torchtitan do: the model in fp32,
    its forward under autocast to bf16 or fp16 (fp16 with torch's GradScaler). `pure`: the model cast whole to
    bf16 or fp16, no fp32 master weights, Adam's moments in that dtype: the cheapest loop there is, a ceiling.
    benchmarks/gap_attrib.py runs the same step."""
    torch.manual_seed(0)
    model = OPT(config).to(device)
    low = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if pure and low is not None:
        model = model.to(low)
    opt = adamw(model, 1e-4, 0.1)
    scaler = torch.amp.GradScaler(device, enabled=low is torch.float16 and not pure)
    autocast = torch.autocast(device, dtype=low or torch.float32, enabled=low is not None and not pure)

    def step(tokens: torch.Tensor, micro: int) -> None:
        accumulation = tokens.size(0) // micro
        for m in tokens.split(micro):
            with autocast:
                loss = model(m[:, :-1], m[:, 1:]) / accumulation
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def bare(name: str, shards: Path, vocab: int, steps: int, threads: int, device: str, precision: str,
         pure: bool = False) -> list[float]:
    """The bare loop's (`bare_loop`) tokens/s per step (the first two left out), on the micro-batches ours trained
    on (our loader over the same shards, seed and batch), with the same number of threads, one synchronization a
    step."""
    from train.loader import Loader

    setup = SETUPS[device][name]
    torch.set_num_threads(threads)
    step = bare_loop(get(name).replace(vocab_size=vocab, max_seq_len=max(setup["seq_len"], get(name).max_seq_len)),
                     device, precision, pure)
    loader = Loader(shards, setup["batch"], seed=0)  # train.seed's default, as ours ran
    rates = []
    for g, _ in zip(loader.positions(), range(steps)):
        t0 = time.perf_counter()
        step(torch.from_numpy(loader.batch(g).astype(np.int64)).to(device), setup["micro"])
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(setup["batch"] * setup["seq_len"] / (time.perf_counter() - t0))
    return rates[2:]


def measure(models: list[str], device: str, precision: str, out: Path, steps: int | None = None,
            overrides: list[str] = (), cores: int | None = None) -> list[str]:
    """Ours against the bare loop for each model, on the Ray this process has started; the table's lines."""
    import ray
    from ray import cloudpickle

    cores = cores or os.cpu_count() or 1
    # The bare loops in a Ray worker, as ours: the same process set-up (torch in this driver process ran the tiny
    # model's step 1.3x as long as in a worker), with the environment of our training workers (one malloc arena:
    # train/stage.py WORKER_ENV; without it the bare loop's tiny step took 1.3x ours).
    from train.stage import WORKER_ENV

    if bare.__module__ != "__main__":  # imported (gpu_check.py, the tests): the workers cannot import benchmarks/
        cloudpickle.register_pickle_by_value(sys.modules[bare.__module__])
    worker = ray.remote(num_cpus=cores, num_gpus=1 if device == "cuda" else 0,
                        runtime_env={"env_vars": WORKER_ENV})(bare)
    results = {}
    for name in models:
        setup = {**SETUPS[device][name], **({"steps": steps} if steps else {})}
        vocab = 512 if name == "tiny" else 50272
        shards = out / name / "shards"
        make_shards(shards, setup["batch"] * (setup["steps"] + 1), seq_len=setup["seq_len"], vocab=vocab)
        # The fair bare loop before and after each run of ours, its steps pooled, and ours' pooled: a 2-core
        # machine's speed drifts by 10-30% from one minute to the next, and a drift then weighs on both sides.
        args = (name, shards, vocab, setup["steps"], cores, device, precision)
        base, rates, rows = ray.get(worker.remote(*args)), [], []
        for r in range(setup.get("rounds", 1)):
            more, run = ours(name, shards, out, setup["steps"], cores, device, precision, list(overrides),
                             label=name if r == 0 else f"{name}r{r}")
            rates, rows = rates + more, rows + run
            base += ray.get(worker.remote(*args))
        pure = ray.get(worker.remote(*args, pure=True)) if precision != "fp32" else base
        results[name] = (statistics.median(rates), statistics.median(base), statistics.median(pure), vocab, rows)

    peak = peak_tflops(torch.device(device, 0), precision) if device == "cuda" else None
    lines = ["| model | seq_len x batch (micro) | bare PyTorch tokens/s | ours tokens/s | time per token, ours / bare "
             f"| ours TFLOP/s | ours MFU | bare MFU | pure-{precision} bare tokens/s | its MFU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (mine, base, pure, vocab, rows) in results.items():
        s = SETUPS[device][name]
        model = get(name).replace(vocab_size=vocab, max_seq_len=max(s["seq_len"], get(name).max_seq_len))
        per_token = flops_per_token(model, s["seq_len"])
        mfu = (lambda rate: f"{rate * per_token / 1e12 / peak:.1%}" if peak else "-")
        lines.append(f"| {name} | {s['seq_len']} x {s['batch']} ({s['micro']}) | {base:,.0f} | {mine:,.0f} | "
                     f"{base / mine:.2f}x | {mine * per_token / 1e12:.3f} | {mfu(mine)} | {mfu(base)} | {pure:,.0f} | "
                     f"{mfu(pure)} |")
        skipped = max((r["skipped_steps"] for r in rows), default=0)
        if skipped:
            scales = " ".join(f"{r['loss_scale']:g}" for r in rows)
            lines.append(f"  {name}: {skipped} overflow-skipped steps; loss scale per step: {scales}")
    return lines


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,125m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for our run (pipelines/full.py's --set), e.g. train.zero_stage=1")
    p.add_argument("--steps", type=int, help="steps per model (default: each model's own, SETUPS)")
    p.add_argument("--out", default="/tmp/bench_train")
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cores = os.cpu_count() or 1

    import ray

    from core.ray_session import init_ray

    init_ray(cores)
    try:
        lines = measure(args.models.split(","), args.device, args.precision, out, args.steps, args.set, cores)
    finally:
        ray.shutdown()
    print(f"{args.device} {args.precision}, {cores} cores")
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()

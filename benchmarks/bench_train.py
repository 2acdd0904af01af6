"""Training throughput: the train stage's step against a bare PyTorch loop, on this machine.

    python benchmarks/bench_train.py [--models tiny,125m] [--out /tmp/bench_train]

For each model: token shards of random ids (seq_len 128 for tiny, 2048 for 125M), then
- ours: the train stage itself (`train.stage.run`: Ray Train, one worker with every core,
  DeepSpeed ZeRO-2 fp32, our loader, metrics to MLflow and metrics.jsonl every step), tokens/s
  from its metrics.jsonl (median over the steps after the first two; 30 steps for tiny, 6 for 125M);
- baseline, in this process: the same model and batch, torch.optim.AdamW with the same
  settings, `loss.backward(); clip_grad_norm_; step()`, no DeepSpeed, no Ray, no loader, the
  same number of threads; tokens/s as the median step.
Prints a Markdown table with the ratio (time per token, ours / bare; goal <= 1.15x).

On a GPU machine `--device cuda --precision bf16` measures the same on one GPU and adds MFU
(see docs/benchmarks.md for what was run there).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
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
from train.optim import adamw  # noqa: E402

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

SETUPS = {"tiny": {"seq_len": 128, "batch": 32, "micro": 8, "steps": 30},
          "125m": {"seq_len": 2048, "batch": 2, "micro": 1, "steps": 6}}


def ours(name: str, shards: Path, out: Path, steps: int, cpus: int, device: str, precision: str) -> list[float]:
    from pipelines.config import load_config
    from pipelines.dag import StageContext
    from pipelines.tracking import MlflowTracker
    from train import stage

    setup = SETUPS[name]
    config = load_config(ROOT / "configs" / "local.yaml", [
        f"workdir={out}/work", f"train.model={name}", "train.num_workers=1", f"train.cpus_per_worker={cpus}",
        f"train.gpus_per_worker={1 if device == 'cuda' else 0}", f"train.precision={precision}",
        f"train.micro_batch_size={setup['micro']}", f"train.global_batch_tokens={setup['batch'] * setup['seq_len']}",
        f"train.max_steps={steps}", f"train.checkpoint_every={steps}", "train.eval_every=0", "train.warmup_tokens=0"])
    tracker = MlflowTracker(config.mlflow.tracking_uri, "bench_train")
    folder = out / name / "stage"
    folder.mkdir(parents=True)
    with tracker.stage(f"train-{name}", {}, {}) as run_id:
        ctx = StageContext("train", config, config.train, {"tokenize": {"output": str(shards)}}, folder,
                           logging.getLogger("bench"), run_id, fingerprint=f"bench{name}".ljust(16, "0"))
        stage.run(ctx)
    rows = [json.loads(line) for line in (folder / "output" / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_second"] for r in rows if "tokens_per_second" in r][2:]


def bare(name: str, vocab: int, steps: int, threads: int, device: str, precision: str) -> list[float]:
    setup = SETUPS[name]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = OPT(get(name).replace(vocab_size=vocab, max_seq_len=max(setup["seq_len"], get(name).max_seq_len))).to(device)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = adamw(model, 1e-4, 0.1)
    tokens = torch.from_numpy(np.random.default_rng(1).integers(4, vocab, (setup["batch"], setup["seq_len"] + 1))).to(device)
    rates = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for micro in tokens.split(setup["micro"]):
            (model(micro[:, :-1], micro[:, 1:]) / (setup["batch"] // setup["micro"])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(setup["batch"] * setup["seq_len"] / (time.perf_counter() - t0))
    return rates[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,125m")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", default="/tmp/bench_train")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cores = os.cpu_count() or 1

    import ray

    ray.init(num_cpus=cores, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"worker_process_setup_hook": "pipelines.engines.quiet_worker_logs"})
    results = {}
    for name in args.models.split(","):
        vocab = 512 if name == "tiny" else 50272
        shards = out / name / "shards"
        steps = SETUPS[name]["steps"]
        make_shards(shards, SETUPS[name]["batch"] * (steps + 1), seq_len=SETUPS[name]["seq_len"], vocab=vocab)
        results[name] = (statistics.median(ours(name, shards, out, steps, cores, args.device, args.precision)),
                         statistics.median(bare(name, vocab, steps, cores, args.device, args.precision)), vocab)
    ray.shutdown()

    commit = provenance.commit()
    print(f"commit {commit}; {provenance.machine()}, {cores} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, {args.device} {args.precision}")
    print()
    print("| model | seq_len x batch | bare PyTorch tokens/s | ours tokens/s | time per token, ours / bare | ours TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for name, (mine, base, vocab) in results.items():
        s = SETUPS[name]
        model = get(name).replace(vocab_size=vocab, max_seq_len=max(s["seq_len"], get(name).max_seq_len))
        tflops = mine * flops_per_token(model, s["seq_len"]) / 1e12
        print(f"| {name} | {s['seq_len']} x {s['batch']} | {base:,.0f} | {mine:,.0f} | {base / mine:.2f}x | {tflops:.3f} |")


if __name__ == "__main__":
    main()

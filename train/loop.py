"""The training loop every Ray Train worker runs: DeepSpeed over our model, our loader, our checkpoints.

One function, `train_loop(config)`, top to bottom: build the model and the DeepSpeed engine,
resume from the newest checkpoint that verifies (or start fresh), then for each step: this
rank's share of the global batch from the loader, micro-batches through the engine, the LR from
the schedule, metrics (rank 0 writes them to MLflow and to metrics.jsonl in the run folder),
validation loss per source every `eval_every` steps, a checkpoint every `checkpoint_every`
steps (reported to Ray Train), and at the end the Hugging Face export. A watchdog thread ends
the worker process when a step hangs, so that Ray Train restarts the workers from the latest
checkpoint; injected faults (`train.inject`) fire once each, even across restarts.

`config` is plain data (the stage builds it), so the same function runs under Ray Train on a
cluster and in tests.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from train import checkpoint
from train.loader import Loader, TokenShards
from train.optim import Schedule, adamw, deepspeed_config

log = logging.getLogger("train")

# Dense peak TFLOP/s per device for MFU, by a substring of torch.cuda.get_device_name().
FLUSH_SECONDS = 2.0  # rank 0 sends metrics to MLflow this often

PEAK_TFLOPS = {"H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}}


@dataclass
class Context:
    """Who this worker is and where the run lives."""

    rank: int
    world: int
    run_dir: Path
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0


# --------------------------------------------------------------------------- small pieces


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_mean(values: list[float]) -> list[float]:
    """The mean over ranks of each value (one all_reduce)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def peak_tflops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None  # on CPU: tokens/s only, no MFU
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[precision]
    return None


class Watchdog:
    """Ends this worker process when no step finishes for `seconds`: a hang becomes a restart."""

    def __init__(self, seconds: float, on_hang):
        self.seconds, self.on_hang = seconds, on_hang
        self.beat_at, self.step = time.monotonic(), 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def beat(self, step: int) -> None:
        self.beat_at, self.step = time.monotonic(), step

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.seconds / 4)):
            stalled = time.monotonic() - self.beat_at
            if stalled > self.seconds:
                self.on_hang(self.step, stalled)
                os._exit(3)


class Faults:
    """`train.inject`: each fault fires once; fired ones are recorded in the run folder first."""

    def __init__(self, faults: list[dict], ctx: Context):
        self.ctx, self.path = ctx, ctx.run_dir / "injected.json"
        self.faults = [dict(f, index=i) for i, f in enumerate(faults)]

    def _fired(self) -> set[int]:
        try:
            return set(json.loads(self.path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return set()

    def before_step(self, step: int, hang_seconds: float) -> None:
        for fault in self.faults:
            rank = self.ctx.world - 1 if fault["rank"] is None else fault["rank"]
            if fault["step"] != step or rank != self.ctx.rank or fault["index"] in self._fired():
                continue
            fired = sorted(self._fired() | {fault["index"]})
            tmp = self.path.with_suffix(f".{self.ctx.rank}.tmp")
            tmp.write_text(json.dumps(fired))
            os.replace(tmp, self.path)
            incident(self.ctx, step, f"injected {fault['kind']} on rank {rank}")
            if fault["kind"] == "kill":
                os._exit(1)  # the worker process dies, as on a lost GPU or an ECC error
            if fault["kind"] == "hang":
                time.sleep(10 * hang_seconds)  # stalls until the watchdog ends the process


def incident(ctx: Context, step: int, what: str) -> None:
    """One line in the run's incidents.jsonl (and the worker's log): what happened to the run, and when."""
    log.warning("step %d: %s", step, what)
    with open(ctx.run_dir / "incidents.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "step": step, "rank": ctx.rank, "what": what}) + "\n")


class MetricSink:
    """Rank 0's metrics: appended to metrics.jsonl at once, sent to MLflow from a background thread."""

    def __init__(self, ctx: Context, tracking_uri: str | None, run_id: str | None):
        self.file = open(ctx.run_dir / "metrics.jsonl", "a")
        self.queue: queue.Queue = queue.Queue()
        self.thread = None
        if tracking_uri and run_id:
            self.thread = threading.Thread(target=self._send, args=(tracking_uri, run_id), daemon=True)
            self.thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.thread is not None:
            self.queue.put((step, metrics))

    def _send(self, tracking_uri: str, run_id: str) -> None:
        """Every FLUSH_SECONDS, one log_batch of what came in: a call per step would slow small steps
        (measured: the tiny model at 2.4x a bare loop's time per token with a call per step)."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        from pipelines.tracking import metric_name

        client = MlflowClient(tracking_uri)
        done = False
        while not done:
            items = [self.queue.get()]
            deadline = time.monotonic() + FLUSH_SECONDS
            while items[-1] is not None and time.monotonic() < deadline:
                try:
                    items.append(self.queue.get(timeout=deadline - time.monotonic()))
                except queue.Empty:
                    break
            done = items[-1] is None  # close() puts None last
            now = int(time.time() * 1000)
            batch = [Metric(metric_name(k), float(v), now, step) for step, metrics in filter(None, items)
                     for k, v in metrics.items() if v is not None and math.isfinite(float(v))]
            for i in range(0, len(batch), 1000):
                client.log_batch(run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.file.close()
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(timeout=60)


# --------------------------------------------------------------------------- evaluation


def validation_losses(engine, shards_dir: str, sources: list[str], micro: int, max_batches: int, ctx: Context) -> dict:
    """Mean loss per source over its first validation sequences, split evenly over the ranks
    (every rank runs the same number of forwards, as ZeRO-3 needs)."""
    engine.eval()
    out = {}
    with torch.no_grad():
        for source in sources:
            shards = TokenShards(shards_dir, source)
            n = min(len(shards), max_batches * micro * ctx.world) // ctx.world * ctx.world
            if n == 0:
                continue
            mine = np.arange(ctx.rank, n, ctx.world)
            total = 0.0
            for first in range(0, len(mine), micro):
                tokens = torch.from_numpy(shards.rows(mine[first:first + micro]).astype(np.int64)).to(ctx.device)
                total += engine(tokens[:, :-1], tokens[:, 1:]).item() * len(tokens)
            out[source] = all_mean([total / len(mine)])[0]
    engine.train()
    return out


# --------------------------------------------------------------------------- the loop


def quiet() -> None:
    """Ray Train's line per report and per checkpoint, DeepSpeed's accelerator notice and torch's
    deprecation warnings from inside DeepSpeed: out of the console (our progress line says it)."""
    try:  # private modules: if they move, the lines come back, nothing else changes
        from ray.train.v2._internal.execution import context, storage

        for module in (context, storage):
            module.logger.setLevel(logging.WARNING)
    except (ImportError, AttributeError):
        pass
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def train_loop(config: dict) -> None:
    quiet()
    import deepspeed
    import ray.train

    from model.configs import OPTConfig, flops_per_token
    from model.opt import OPT

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train_ctx = ray.train.get_context()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ctx = Context(train_ctx.get_world_rank(), train_ctx.get_world_size(), Path(config["run_dir"]), device)
    ckpt_dir = ctx.run_dir / "checkpoints"
    faults = Faults(config["inject"], ctx)

    if device.type == "cpu":  # DeepSpeed's shared-memory allreduce would be compiled with g++ on first use
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    seed_everything(config["seed"])
    model_config = OPTConfig(**config["model"])
    model = OPT(model_config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=adamw(model, config["lr"], config["weight_decay"]),
        config=deepspeed_config(micro_batch=config["micro_batch"], accumulation=config["accumulation"],
                                world_size=ctx.world, zero_stage=config["zero_stage"], precision=config["precision"],
                                grad_clip=config["grad_clip"]))
    schedule = Schedule(config["lr"], config["warmup_steps"], config["total_steps"], config["final_lr_ratio"])

    def skipped(reason: str) -> None:
        incident(ctx, 0, f"checkpoint skipped on load: {reason}")

    resumed = checkpoint.load_latest(engine, ckpt_dir, on_skip=skipped)
    step = 0
    loader_state = None
    if resumed is not None:
        step, loader_state = resumed["step"], resumed["loader"]
        schedule.factor = resumed.get("schedule", {}).get("factor", 1.0)
        if ctx.leader:
            incident(ctx, step, f"resumed from {Path(resumed['path']).name}")
    loader = Loader(config["shards"], config["global_batch"], rank=ctx.rank, world_size=ctx.world, seed=config["seed"],
                    state=loader_state)
    batches = iter(loader)

    sink = MetricSink(ctx, config["tracking_uri"], config["mlflow_run_id"]) if ctx.leader else None

    def on_hang(done: int, stalled: float) -> None:
        incident(ctx, done + 1, f"step {done + 1} has run {stalled:.0f} s "
                                f"(train.hang_seconds={config['hang_seconds']}): ending this worker")

    watchdog = Watchdog(config["hang_seconds"], on_hang)
    seq_len = config["seq_len"]
    tokens_per_step = config["global_batch"] * seq_len
    flops = flops_per_token(model_config, seq_len) * tokens_per_step
    peak = peak_tflops(device, config["precision"])
    skipped_before = engine.skipped_steps
    loss = float("nan")
    progress_at = 0.0

    while step < config["max_steps"]:
        faults.before_step(step + 1, config["hang_seconds"])
        t0 = time.perf_counter()
        g, tokens = next(batches)
        tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        lr = schedule.lr(step + 1)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for micro in tokens.split(config["micro_batch"]):
            micro_loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(micro_loss)
            engine.step()  # the optimizer steps at the last micro-batch (gradient_accumulation_steps)
            losses.append(micro_loss.item())
        step += 1
        grad_norm = engine.get_global_grad_norm()
        loss, act_norm = all_mean([float(np.mean(losses)), float(model.last_activation_norm)])
        seconds = time.perf_counter() - t0
        watchdog.beat(step)
        if ctx.leader:
            metrics = {"loss": loss, "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
                       "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0),
                       "skipped_steps": engine.skipped_steps - skipped_before, "activation_norm": act_norm,
                       "tokens_per_second": tokens_per_step / seconds, "batch": g,
                       "tflops_per_device": flops / seconds / ctx.world / 1e12}
            if peak:
                metrics["mfu"] = metrics["tflops_per_device"] / peak
            sink.log(step, metrics)
            if time.monotonic() - progress_at > 5 or step == config["max_steps"]:
                progress_at = time.monotonic()
                log.info("step %d/%d loss %.4f lr %.2e tokens/s %s", step, config["max_steps"], loss, lr,
                         f"{tokens_per_step / seconds:,.0f}")
        evaluate = config["eval_every"] and step % config["eval_every"] == 0
        if evaluate or step == config["max_steps"]:
            val = validation_losses(engine, config["shards"], config["validation_sources"], config["micro_batch"],
                                    config["eval_batches"], ctx)
            if ctx.leader and val:
                sink.log(step, {f"val_loss.{s}": v for s, v in val.items()} | {"val_loss": float(np.mean(list(val.values())))})
            watchdog.beat(step)
        if step % config["checkpoint_every"] == 0 or step == config["max_steps"]:
            meta = {"loader": loader.state_dict(), "schedule": {"factor": schedule.factor, "lr": lr},
                    "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0),
                    "metrics": {"loss": loss}, "health": {}}
            path = checkpoint.save(engine, ckpt_dir, step, meta)
            if ctx.leader:
                checkpoint.prune(ckpt_dir, config["keep_checkpoints"])
            watchdog.beat(step)
            report_checkpoint(step, loss, path, ctx)

    watchdog.stop()
    export(engine, model, config, ctx)
    if ctx.leader:
        (ctx.run_dir / "summary.json").write_text(json.dumps({"steps": step, "final_loss": loss}))
        sink.close()


def report_checkpoint(step: int, loss: float, path: Path, ctx: Context) -> None:
    """Tell Ray Train about the checkpoint: a small pointer (the data stays where DeepSpeed wrote it),
    so Ray's own records and dashboard list it without copying terabytes."""
    import tempfile

    import ray.train

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_arg = None
        if ctx.leader:
            (Path(tmp) / "pointer.json").write_text(json.dumps({"step": step, "path": str(path)}))
            checkpoint_arg = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint_arg)


def export(engine, model, config: dict, ctx: Context) -> None:
    """The final weights (gathered from every rank under ZeRO-3) as a Hugging Face folder, with the tokenizer."""
    import deepspeed

    from corpus import tokenizer
    from model.hf import save_pretrained

    tok_path = Path(config["shards"]) / tokenizer.FILE
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        if ctx.leader:
            if not tok_path.is_file():
                log.warning("%s is missing: the model is exported without a tokenizer", tok_path)
            save_pretrained(model, config["export_dir"], tokenizer=tokenizer.load(str(tok_path)) if tok_path.is_file() else None)

"""Rank 0's record of the run: a line per step in metrics.jsonl and MLflow (loss, LR, norms, loss scale,
throughput, MFU on a GPU), a progress line in the worker's log, and the run's summary.json."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time

import torch

from train import records
from train.loop.config import LoopConfig
from train.loop.context import Context
from train.loop.step import StepResult
from train.plan.hardware import peak_for

log = logging.getLogger("train")

FLUSH_SECONDS = 2.0  # rank 0 sends metrics to MLflow this often
PROGRESS_SECONDS = 5.0  # a progress line in the log at most this often


def peak_tflops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None  # on CPU: tokens/s only, no MFU
    return peak_for(torch.cuda.get_device_name(device), precision)


class MetricSink:
    """Rank 0's metrics: appended to metrics.jsonl at once, sent to MLflow from a background thread."""

    def __init__(self, ctx: Context, tracking_uri: str | None, run_id: str | None):
        self.run_dir = ctx.run_dir
        self.queue: queue.Queue = queue.Queue()
        self.thread = None
        if tracking_uri and run_id:
            self.thread = threading.Thread(target=self._send, args=(tracking_uri, run_id), daemon=True)
            self.thread.start()

    def log(self, kind: records.Kind, step: int, metrics: dict[str, float]) -> None:
        records.append(self.run_dir, kind, {"step": step, **metrics, "time": round(time.time(), 3)})
        if self.thread is not None:
            self.queue.put((step, metrics))

    def _send(self, tracking_uri: str, run_id: str) -> None:
        """Every FLUSH_SECONDS, one log_batch of what came in: a call per step would slow small steps
        (measured: the tiny model at 2.4x a bare loop's time per token with a call per step)."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        from core.tracking import metric_name

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
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(timeout=60)


class Metrics:
    """What a step measured, as rank 0 records it; on the other ranks every call does nothing."""

    def __init__(self, cfg: LoopConfig, ctx: Context, flops_per_step: float):
        self.cfg, self.ctx, self.flops_per_step = cfg, ctx, flops_per_step
        self.peak = peak_tflops(ctx.device, cfg.train.precision)
        self.sink = MetricSink(ctx, cfg.tracking_uri, cfg.mlflow_run_id) if ctx.leader else None
        self.progress_at = 0.0

    def step(self, step: int, result: StepResult, loss_scale: float, skipped_steps: int) -> None:
        if self.sink is None:
            return
        tokens_per_second = self.cfg.tokens_per_step / result.seconds
        metrics = {"loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm, "loss_scale": loss_scale,
                   "overflow": int(result.overflow), "skipped_steps": skipped_steps,
                   "activation_norm": result.activation_norm, "tokens_per_second": tokens_per_second,
                   "batch": result.batch, "seconds": result.seconds,
                   "tflops_per_device": self.flops_per_step / result.seconds / self.ctx.world / 1e12}
        if self.peak:
            metrics["mfu"] = metrics["tflops_per_device"] / self.peak
        self.sink.log(records.STEP, step, metrics)
        if time.monotonic() - self.progress_at > PROGRESS_SECONDS or step == self.cfg.last_step:
            self.progress_at = time.monotonic()
            log.info("step %d/%d loss %.4f lr %.2e tokens/s %s", step, self.cfg.last_step, result.loss, result.lr,
                     f"{tokens_per_second:,.0f}")

    def evaluation(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        if self.sink is not None and metrics:
            self.sink.log(records.EVALUATION, step, {**metrics, "eval_seconds": seconds})

    def checkpoint(self, step: int, blocked_seconds: float, write_seconds: float) -> None:
        """A save of step `step` published: how long training waited for it, and how long its write took."""
        if self.sink is not None:
            self.sink.log(records.CHECKPOINT, step, {"checkpoint.blocked_seconds": blocked_seconds, "checkpoint.write_seconds": write_seconds})

    def close(self, steps: int, final_loss: float, stopped: str | None) -> None:
        """summary.json, which the stage reads when the workers are done."""
        if self.sink is None:
            return
        records.write_summary(self.ctx.run_dir, steps, final_loss, stopped)
        self.sink.close()

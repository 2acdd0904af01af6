"""Rank 0's record of the run: a line per step in metrics.jsonl (loss, LR, norms, loss scale, throughput, MFU on a
GPU), a progress line in the worker's log, and the run's summary.json. The driver sends metrics.jsonl's lines to
MLflow as they come (train/follow.py): a worker opens no MLflow store."""

from __future__ import annotations

import logging
import time

import torch

from train import records
from train.loop.config import LoopConfig
from train.loop.context import Context
from train.loop.step import StepResult
from train.plan.hardware import peak_for

log = logging.getLogger("train")

PROGRESS_SECONDS = 5.0  # a progress line in the log at most this often


def peak_tflops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None  # on CPU: tokens/s only, no MFU
    return peak_for(torch.cuda.get_device_name(device), precision)


class Metrics:
    """What a step measured, as rank 0 records it; on the other ranks every call does nothing."""

    def __init__(self, cfg: LoopConfig, ctx: Context, flops_per_step: float):
        self.cfg, self.ctx, self.flops_per_step = cfg, ctx, flops_per_step
        self.peak = peak_tflops(ctx.device, cfg.train.precision)
        self.leader = ctx.leader
        self.progress_at = 0.0

    def _log(self, kind: records.Kind, step: int, metrics: dict[str, float]) -> None:
        records.append(self.ctx.run_dir, kind, {"step": step, **metrics, "time": round(time.time(), 3)})

    def step(self, step: int, result: StepResult, loss_scale: float, skipped_steps: int) -> None:
        if not self.leader:
            return
        tokens_per_second = self.cfg.tokens_per_step / result.seconds
        metrics = {"loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm, "loss_scale": loss_scale,
                   "overflow": int(result.overflow), "skipped_steps": skipped_steps,
                   "activation_norm": result.activation_norm, "tokens_per_second": tokens_per_second,
                   "batch": result.batch, "seconds": result.seconds,
                   "tflops_per_device": self.flops_per_step / result.seconds / self.ctx.world / 1e12}
        if self.peak:
            metrics["mfu"] = metrics["tflops_per_device"] / self.peak
        self._log(records.STEP, step, metrics)
        if time.monotonic() - self.progress_at > PROGRESS_SECONDS or step == self.cfg.last_step:
            self.progress_at = time.monotonic()
            log.info("step %d/%d loss %.4f lr %.2e tokens/s %s", step, self.cfg.last_step, result.loss, result.lr,
                     f"{tokens_per_second:,.0f}")

    def evaluation(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        if self.leader and metrics:
            self._log(records.EVALUATION, step, {**metrics, "eval_seconds": seconds})

    def checkpoint(self, step: int, blocked_seconds: float, write_seconds: float) -> None:
        """A save of step `step` published: how long training waited for it, and how long its write took."""
        if self.leader:
            self._log(records.CHECKPOINT, step, {"checkpoint.blocked_seconds": blocked_seconds, "checkpoint.write_seconds": write_seconds})

    def close(self, steps: int, final_loss: float, stopped: str | None) -> None:
        """summary.json, which the stage reads when the workers are done."""
        if self.leader:
            records.write_summary(self.ctx.run_dir, steps, final_loss, stopped)

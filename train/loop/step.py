"""One training step: this rank's share of the global batch, forward and backward over its micro-batches,
the optimizer's step, and what the step measured (loss, gradient and activation norms, overflow)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from train.loader import Loader
from train.loop.context import Context
from train.parallel import pipeline
from train.parallel.collectives import all_mean
from train.parallel.groups import Groups


class Feed:
    """The loader's global batches in training order, as this rank's micro-batches (a pipeline's middle
    stages advance the same positions without reading).

    When the data-parallel ranks do not divide the global batch's micro-batches (an elastic run short of
    replicas: train/loop/elastic.py), the first ranks take one more (train/loader.py `share`), and each of the
    others runs a padding micro-batch, a copy of one of its own whose gradient is scaled to nothing: every rank runs
    the engine's `accumulation` backward passes, and ZeRO's reductions stay in step. `weights` scales each slot's
    gradient: ranks x accumulation / micro-batches for a real one, so that what DeepSpeed averages over the ranks'
    slots is the global batch's mean, and 0 for a padding one; all 1.0 when the split is even."""

    def __init__(self, loader: Loader, ctx: Context, micro_batch: int, accumulation: int):
        self.loader, self.ctx, self.micro_batch, self.accumulation = loader, ctx, micro_batch, accumulation
        self.positions = loader.positions()
        mine = loader.local_batch // micro_batch
        weight = ctx.data_world * accumulation / (loader.global_batch // micro_batch)
        self.weights = [weight] * mine + [0.0] * (accumulation - mine)

    def restart(self) -> None:
        """Continue from the loader's state (after a rollback reloaded it)."""
        self.positions = self.loader.positions()

    def next(self) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The next global batch's number and this rank's (inputs, targets) micro-batches."""
        g = next(self.positions)
        if not self.ctx.feeds_data:
            return g, []
        tokens = torch.from_numpy(self.loader.batch(g).astype(np.int64)).to(self.ctx.device)
        mine = [(m[:, :-1], m[:, 1:]) for m in tokens.split(self.micro_batch)]
        return g, mine + mine[:1] * (self.accumulation - len(mine))  # padding: each past len(mine) weighs nothing


@dataclass
class StepResult:
    batch: int  # the global batch trained on
    lr: float
    loss: float  # mean over the micro-batches and the data-parallel ranks
    grad_norm: float | None  # before clipping; None when the scaler skipped the update
    activation_norm: float
    overflow: bool  # the (real or simulated) loss scaler skipped this update
    seconds: float
    compute_seconds: float = 0.0  # this rank's forward compute, apart from its waits in collectives (stragglers.py)


class ComputeTimer:
    """Seconds of compute in the timed blocks: CUDA events on a GPU (read once the step has synchronized), the
    clock on a CPU, where the work is done when the call returns."""

    def __init__(self, device: torch.device):
        self.cuda, self.seconds, self.events = device.type == "cuda", 0.0, []

    def __enter__(self) -> "ComputeTimer":
        if self.cuda:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        else:
            self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        else:
            self.seconds += time.perf_counter() - self.began

    def total(self) -> float:
        pairs = zip(self.events[::2], self.events[1::2])
        return self.seconds + sum(start.elapsed_time(end) for start, end in pairs) / 1e3


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def gradient_norm(model: torch.nn.Module, groups: Groups | None = None) -> torch.Tensor:
    """The L2 norm of all gradients (what DeepSpeed's ZeRO optimizers report as the global grad norm), on the
    device; with the model split over a tensor group, the shards' squares summed over the group and the
    replicated parameters' counted once."""
    grads = [p for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())

    def squares(params: list) -> torch.Tensor:  # each gradient's norm read in place, where `pow(2)` would write a copy
        return torch.stack([torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32) for p in params]).square().sum()

    split = [p for p in grads if getattr(p, "tensor_model_parallel", False)]  # only after parallelize()
    whole = [p for p in grads if not getattr(p, "tensor_model_parallel", False)]
    total = (squares(whole) if whole else 0.0) + (groups.sum_over_tensor(squares(split)) if split else 0.0)
    return torch.as_tensor(total).sqrt()


def skip_unless_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """The coming update skipped on the device if the gradients are not finite, with no read of the device:
    torch's fused AdamW leaves the weights, its moments and its step count as they were when its `found_inf` is
    set (torch/optim/adam.py `_fused_adam`; GradScaler's own switch). On ZeRO-0 no DeepSpeed optimizer wraps
    ours, so nothing else would keep a nan or an inf from the weights; ZeRO 1-3 skip such a step themselves
    (zero/stage_1_and_2.py `step`: `is_invalid_grad_norm`)."""
    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()


class TrainStep:
    """Runs a step on the engine: 1F1B through a pipeline's engine, or forward/backward per micro-batch."""

    def __init__(self, engine, model: torch.nn.Module, feed: Feed, ctx: Context, own_grad_norm: bool):
        self.engine, self.model, self.feed, self.ctx, self.own_grad_norm = engine, model, feed, ctx, own_grad_norm

    def __call__(self, lr: float, poison: float = 1.0, slow: float = 1.0) -> StepResult:
        """The next batch at `lr`. `poison` scales the gradients only (an injected nan or overflow); the loss
        reported is the true one; `slow` stretches this rank's compute by that factor (an injected straggler:
        relative, as a GPU at half speed is, so that the drill means the same on any device).
        The seconds include reading the batch."""
        t0 = time.perf_counter()
        batch, micro_batches = self.feed.next()
        engine = self.engine
        set_lr(engine, lr)
        skipped_before = engine.skipped_steps
        timer = ComputeTimer(self.ctx.device)
        if self.ctx.pipelined:
            with timer:  # compute and the stages' waits, inseparable inside DeepSpeed's schedule
                losses, activations, grad_norm = self._pipelined(micro_batches, poison)
        else:
            losses, activations, grad_norm = self._whole(micro_batches, poison, timer)
        if slow > 1.0:
            if timer.cuda:
                torch.cuda.synchronize(self.ctx.device)  # the events' times are read once they have run
            spent = timer.total()
            with timer:
                time.sleep((slow - 1.0) * spent)
        if not self.own_grad_norm:
            grad_norm = engine.get_global_grad_norm()  # a tensor on the device (a float after an overflow)
        # The step's one read of the device: the loss and activation norm averaged over ranks, and the grad norm.
        loss, act_norm, *norm = all_mean([torch.stack(losses).sum(), activations],
                                         [] if grad_norm is None else [grad_norm])
        grad_norm = norm[0] if norm else None
        seconds = time.perf_counter() - t0
        overflow = engine.skipped_steps > skipped_before
        if self.own_grad_norm and grad_norm is not None and not math.isfinite(grad_norm):
            overflow = True  # skipped on the device (skip_unless_finite): counted with DeepSpeed's skips
            engine.skipped_steps += 1  # which its checkpoints keep
        if overflow:  # the update was skipped: its norm (inf or nan) is no measurement of the run
            grad_norm = None
        return StepResult(batch, lr, loss, grad_norm, act_norm, overflow, seconds, timer.total())

    def _pipelined(self, micro_batches: list, poison: float):
        """1F1B over the micro-batches, the optimizer step at the end; the mean loss on every stage, each micro-batch's
        weighted as `_whole` weighs it (its padding's by 0)."""
        engine, loss_fn = self.engine, self.engine.module.loss_fn
        loss_fn.gradient_factor, loss_fn.weights = poison, iter(self.feed.weights)
        try:
            losses = [engine.train_batch(iter(micro_batches))]
        finally:
            loss_fn.gradient_factor, loss_fn.weights = 1.0, None
        return losses, pipeline.activation_norm(engine.module, self.ctx.groups), None

    def _whole(self, micro_batches: list, poison: float, timer: ComputeTimer):
        engine, grad_norm, losses = self.engine, None, []
        for (inputs, targets), weight in zip(micro_batches, self.feed.weights, strict=True):
            # no collective in a forward of ZeRO 0-2 (ZeRO-3 gathers weights in it, tensor groups reduce)
            with timer:  # bf16 at ZeRO-0: the engine's forward runs under autocast (train/optim.py deepspeed_config)
                micro_loss = engine(inputs, targets)
            # on the device, one reduction a step: each rank's share of the global batch's mean (padding: none)
            losses.append(micro_loss.detach() * (weight / len(micro_batches)))
            engine.backward(pipeline.scale_gradient(micro_loss, poison * weight))
            if self.own_grad_norm and engine.is_gradient_accumulation_boundary():
                grad_norm = gradient_norm(self.model, self.ctx.groups)  # all-reduced by backward, before the clip
                skip_unless_finite(engine.optimizer, grad_norm)
            engine.step()  # the optimizer steps at the last micro-batch (gradient_accumulation_steps)
        return losses, self.model.last_activation_norm, grad_norm

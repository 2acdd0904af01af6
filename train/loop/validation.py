"""The validation loss per source, every `eval_every` steps and at the last."""

from __future__ import annotations

import numpy as np
import torch

from train.loader import validation_batches
from train.loop.config import LoopConfig
from train.loop.context import Context
from train.parallel import pipeline
from train.parallel.collectives import all_mean


class Validation:
    def __init__(self, engine, cfg: LoopConfig, ctx: Context):
        self.engine, self.cfg, self.ctx = engine, cfg, ctx

    def due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(every and step % every == 0) or step == self.cfg.max_steps

    def __call__(self) -> dict[str, float]:
        cfg = self.cfg
        return validation_losses(self.engine, cfg.shards, list(cfg.validation_sources), cfg.train.micro_batch_size,
                                 cfg.eval_micro_batch, cfg.train.eval_batches, self.ctx)


def validation_losses(engine, shards_dir: str, sources: list[str], micro: int, eval_micro: int, max_batches: int,
                      ctx: Context) -> dict:
    """Mean loss per source over its first `max_batches * micro` validation sequences per rank (the
    training micro-batch sets how many, so that the number does not change with `eval_micro`), split
    evenly over the ranks and run `eval_micro` at a time: without a backward there are no
    activations to keep, and under ZeRO-3 every forward gathers all the weights, so fewer, larger
    forwards cost less. The sums stay on the device until one reduction per source."""
    engine.eval()
    out = {}
    with torch.no_grad():
        for source in sources:
            batches = [torch.from_numpy(rows.astype(np.int64)).to(ctx.device) for rows in validation_batches(
                shards_dir, source, eval_micro, rank=ctx.data_rank, world_size=ctx.data_world,
                limit=max_batches * micro * ctx.data_world)]
            count = sum(len(tokens) for tokens in batches)
            if not count:  # the same on every rank: each gets the same number of sequences
                continue
            if ctx.pipelined:
                total = pipeline.validation_loss(engine, [(t[:, :-1], t[:, 1:]) for t in batches], ctx.groups)
            else:
                total = sum(engine(t[:, :-1], t[:, 1:]).double() * len(t) for t in batches)
            out[source] = all_mean([total / count])[0]
    engine.train()
    return out

"""The held-out evaluation set (corpus/evalset.py), every `eval_every` steps and at the last: bits per byte and
the loss per token of each source, each subset and the whole set."""

from __future__ import annotations

import numpy as np
import torch

from corpus import evalset
from train.loader import eval_batches, read_index
from train.loop.config import LoopConfig
from train.loop.context import Context
from train.parallel import pipeline
from train.parallel.collectives import all_mean


class Evaluation:
    def __init__(self, engine, cfg: LoopConfig, ctx: Context):
        self.engine, self.cfg, self.ctx = engine, cfg, ctx
        index = read_index(cfg.shards)
        self.units = index.get("eval", {}).get("units", [])
        self.pad, self.eos = index.get("pad_id"), index.get("eos_id")

    def due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.units) and (bool(every and step % every == 0) or step == self.cfg.last_step)

    def __call__(self) -> dict[str, float]:
        nll = unit_nll(self.engine, self.cfg.shards, len(self.units), self.cfg.eval_micro_batch, self.pad, self.eos,
                       self.ctx)
        return evalset.metrics(self.units, nll)


def unit_nll(engine, shards_dir: str, units: int, eval_micro: int, pad: int, eos: int, ctx: Context) -> list[float]:
    """Each unit's summed negative log-likelihood (nats) over every token it scores (not <pad>, not </s>). Each
    data-parallel rank runs its share of the windows `eval_micro` at a time (without a backward there are no
    activations to keep, and under ZeRO-3 every forward gathers all the weights, so fewer, larger forwards cost
    less); the sums stay on the device until one reduction."""
    engine.eval()
    sums = []
    with torch.no_grad():
        for unit in range(units):
            batches, counts = [], []
            for rows in eval_batches(shards_dir, unit, eval_micro, pad, rank=ctx.data_rank, world_size=ctx.data_world):
                targets = evalset.targets(rows, pad, eos)
                batches.append((torch.from_numpy(rows[:, :-1].astype(np.int64)).to(ctx.device),
                                torch.from_numpy(targets).to(ctx.device)))
                counts.append(int((targets != evalset.IGNORE).sum()))
            if ctx.pipelined:
                total = pipeline.eval_nll(engine, batches, counts, ctx.groups)
            else:
                total = torch.zeros((), dtype=torch.float64, device=ctx.device)
                for (x, y), n in zip(batches, counts):
                    loss = engine(x, y)  # the mean over the targets scored: every rank runs every forward
                    if n:
                        total += loss.double() * n
            sums.append(total)
    engine.train()
    # Tensor and pipeline ranks of one replica hold the same sums: the world's mean times the replicas is their sum.
    return [v * ctx.data_world for v in all_mean(sums)] if sums else []

"""Who this worker is, where its run lives, and the run's incident log."""

from __future__ import annotations

import logging
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train import records
from train.parallel.groups import Groups

log = logging.getLogger("train")


@dataclass
class Context:
    rank: int
    world: int
    run_dir: Path
    device: torch.device
    groups: Groups | None = None  # the tensor x pipeline x data process groups when the model is split (train.parallel)
    node: str | None = None  # Ray's id of the node this rank runs on

    @property
    def data_rank(self) -> int:
        """Which share of each batch this rank trains on: the ranks of a tensor group and of a pipeline share theirs."""
        return self.groups.data_rank if self.groups else self.rank

    @property
    def data_world(self) -> int:
        return self.groups.dims.dp if self.groups else self.world

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def pipelined(self) -> bool:
        return self.groups is not None and self.groups.dims.pp > 1

    @property
    def feeds_data(self) -> bool:
        """Whether this rank's engine takes the batches: a pipeline's first stage (inputs) and last (targets)."""
        return not self.pipelined or self.groups.stage in (0, self.groups.dims.pp - 1)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / records.CHECKPOINTS


def incident(ctx: Context, step: int, what: str) -> None:
    """One line in the run's incidents.jsonl (and the worker's log): what happened to the run, and when."""
    log.warning("step %d: %s", step, what)
    records.incident(ctx.run_dir, step, ctx.rank, what)


PIPELINE_SEED_STRIDE = 100  # Megatron's offset per pipeline rank (megatron/training/initialize.py, _set_random_seed)


def rank_seed(seed: int, groups: Groups | None) -> int:
    """The seed of this rank's global RNGs, which draw the dropout masks. Every pipeline stage gets its own:
    seeded alike, blocks i, i + L/P, i + 2L/P ... of the stages would draw the same masks on every micro-batch
    (DeepSpeed's own per-stage offset is commented out in deepspeed/runtime/pipe/module.py, and seed_layers
    reseeds every layer alike). The ranks of a tensor group share theirs: the residual stream a mask falls on
    is replicated over the group and must stay so. Data-parallel replicas share theirs too (Megatron's
    default), on other data. Without a pipeline, the configured seed itself."""
    return seed + PIPELINE_SEED_STRIDE * (groups.stage if groups is not None else 0)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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

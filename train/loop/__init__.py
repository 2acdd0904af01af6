"""The training loop every Ray Train worker runs: DeepSpeed over our model, our loader, our checkpoints.

`train_loop(config)` is Ray Train's worker function: a `Trainer` (trainer.py) built from the typed
`LoopConfig` (config.py), then `fit()`. The same function runs under Ray Train on a cluster, in the
screen's proxy jobs and in tests.
"""

from __future__ import annotations

import logging
from pathlib import Path

from train.loop.config import LoopConfig

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def train_loop(config: LoopConfig) -> None:
    """The worker's whole run; rank 0 also writes its log to the run folder's train.log (appended across
    restarts), since the workers' output stays off the driver's terminal."""
    import ray.train
    import torch

    from train.loop.context import Context, quiet
    from train.loop.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format=FORMAT)
    train_ctx = ray.train.get_context()
    handler = None
    if train_ctx.get_world_rank() == 0:
        handler = logging.FileHandler(Path(config.run_dir) / "train.log")
        handler.setFormatter(logging.Formatter(FORMAT))
        logging.getLogger().addHandler(handler)
    try:
        quiet()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        ctx = Context(train_ctx.get_world_rank(), train_ctx.get_world_size(), Path(config.run_dir), device)
        Trainer(config, ctx, local_rank=train_ctx.get_local_rank(),
                local_world=train_ctx.get_local_world_size()).fit()
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()

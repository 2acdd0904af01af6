"""The training loop every Ray Train worker runs: DeepSpeed over our model, our loader, our checkpoints.

`train_loop(config)` is Ray Train's worker function: a `Trainer` (trainer.py) built from the typed
`LoopConfig` (config.py), then `fit()`. The same function runs under Ray Train on a cluster, in the
screen's proxy jobs and in tests.
"""

from __future__ import annotations

import logging
from pathlib import Path

from train import goodput, records
from train.loop.config import LoopConfig

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def train_loop(config: LoopConfig):
    """The worker's whole run; rank 0 also writes its log to the run folder's train.log (appended across
    restarts), since the workers' output stays off the driver's terminal. Returns the run's Progress (None when
    it stopped before starting)."""
    import ray.train
    import torch

    from train import failures  # here, not at the top: it imports Ray Train, which a driver's loop config never needs
    from train.deepspeed_import import import_deepspeed
    from train.loop.context import Context, quiet
    from train.loop.faults import start_attempt
    from train.loop.trainer import Trainer

    import_deepspeed()  # first: whatever of DeepSpeed's the worker imports next would take MLflow with it
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    train_ctx = ray.train.get_context()
    handler = None
    if train_ctx.get_world_rank() == 0:
        handler = logging.FileHandler(Path(config.run_dir) / records.TRAIN_LOG)
        handler.setFormatter(logging.Formatter(FORMAT))
        logging.getLogger().addHandler(handler)
    rank, node, trainer = train_ctx.get_world_rank(), ray.get_runtime_context().get_node_id(), None
    try:
        quiet()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        ctx = Context(rank, train_ctx.get_world_size(), Path(config.run_dir), device, node=node)
        failures.write_identity(ctx.run_dir, rank, node)
        if ctx.leader:
            goodput.mark(ctx.run_dir, "start")
        stop = start_attempt(ctx, config.launched_at, config.train.max_stalled_restarts, config.last_step)
        if stop is not None:
            return stop_before_starting(ctx, stop)
        trainer = Trainer(config, ctx, local_rank=train_ctx.get_local_rank(), local_world=train_ctx.get_local_world_size())
        return trainer.fit()
    except Exception as error:  # where this rank was, for the controller's record (train/failures.py)
        if trainer is not None:
            trainer.watchdog.stop()  # the process lives on until Ray Train ends it: no hang to report meanwhile
        step, phase = (None, "start-up") if trainer is None else trainer.progress.where()
        error.train_failure = failures.describe_exception(error, step, phase, rank, node)
        raise
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def seeds_loop(configs: list[LoopConfig]) -> None:
    """The train stage's run, then its runs of other seeds (`train.seeds`), one after another on the same workers:
    a Ray Train job's start costs more than a laptop's run. A restart of the job goes through them again, and
    each resumes from its own checkpoints. The first run stopping (the autopilot, a repeated error) stops the rest."""
    import time

    import ray.train

    first, began = train_loop(configs[0]), time.time()
    if first is None or first.stopped is not None:
        return
    for config in configs[1:]:
        progress = train_loop(config)
        if progress is None or progress.stopped is not None:
            break
    if ray.train.get_context().get_world_rank() == 0:
        goodput.mark(configs[0].run_dir, "seed_runs", seconds=time.time() - began)


def stop_before_starting(ctx, stop) -> None:
    """The run given up (`stop`: a failures.GiveUp) instead of another attempt. Rank 0 writes it down where the
    stage and a reader look (summary.json's `stopped`, incidents.jsonl, the logbook); every rank returns, so
    Ray Train ends the run."""
    import time

    from train.loop.context import incident

    if ctx.leader:
        incident(ctx, stop.step, stop.detail.splitlines()[0])
        records.log_entry(ctx.run_dir, time=time.time(), step=stop.step, kind=stop.rule, detail=stop.detail,
                          actions=["stop the run"], why=stop.why)
        records.write_summary(ctx.run_dir, stop.step, None, stop.detail)

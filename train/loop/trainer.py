"""The training run on one worker: its parts put together, and `fit()`, the loop itself.

Each part has one job, in its own module of this package:
- `engine.build_engine`: the model and DeepSpeed's engine for the configured layout;
- `step.Feed`, `step.TrainStep`: this rank's micro-batches, forward, backward, the optimizer, the norms;
- `checkpointer.Checkpointer`: save, prune, resume, roll back, tell Ray Train;
- `pilot.Pilot`: the autopilot's decisions applied to the engine, the loader and the checkpoints;
- `metrics.Metrics`: metrics.jsonl, MLflow and the progress line (rank 0);
- `evaluation.Evaluation`, `export.export`;
- `faults`: the watchdog (and, before a Trainer is built, each attempt's start and the decision to give up);
- `elastic.Elastic`: a short group's wait for its nodes, and its growth at a checkpoint (`train.elastic`);
- `drill.Drill`: the faults a drill injects (`train.inject`), called at fixed points, a no-op without any.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from model.configs import flops_per_token
from train import goodput
from train.failures import PlannedRestart
from train.loader import Loader
from train.loop.checkpointer import Checkpointer
from train.loop.config import LoopConfig
from train.loop.context import Context, rank_seed, seed_everything
from train.loop.engine import build_engine, groups_for
from train.loop.export import export
from train.loop.drill import Drill
from train.loop.elastic import Elastic
from train.loop.faults import watchdog_for
from train.loop.metrics import Metrics
from train.loop.pilot import Pilot
from train.loop.step import Feed, TrainStep
from train.loop.stragglers import Stragglers
from train.loop.evaluation import Evaluation
from train.parallel.collectives import barrier, set_default_timeout


@dataclass
class Progress:
    step: int = 0  # the last step done
    loss: float = float("nan")  # its loss
    stopped: str | None = None  # why the run stopped before max_steps
    phase: str = "start-up"  # what the loop is doing: start-up, step, evaluation, checkpoint, export

    def where(self) -> tuple[int | None, str]:
        """The step and phase a failure happens in (a step's failure belongs to the step under way)."""
        if self.phase == "start-up":
            return None, self.phase
        return (self.step + 1 if self.phase == "step" else self.step), self.phase


class Trainer:
    def __init__(self, cfg: LoopConfig, ctx: Context, *, local_rank: int, local_world: int):
        """Start-up: everything up to the first step, under the watchdog's start-up limit."""
        t = cfg.train
        self.cfg, self.ctx = cfg, ctx
        self.drill = Drill(t.inject, ctx, hang_seconds=t.hang_seconds, startup_seconds=t.startup_seconds)
        self.watchdog = watchdog_for(ctx, t.hang_seconds, t.startup_seconds)
        try:
            self._start(cfg, ctx, local_rank, local_world)
        except BaseException:
            self.watchdog.stop()  # the failure is the exception's to report, not a hang's
            raise

    def _start(self, cfg: LoopConfig, ctx: Context, local_rank: int, local_world: int) -> None:
        t = cfg.train
        set_default_timeout(t.collective_timeout_seconds)  # every group from here on: ours, DeepSpeed's
        ctx.groups = groups_for(cfg, ctx, local_rank, local_world)
        seed_everything(rank_seed(t.seed, ctx.groups))  # dropout: one stream per pipeline stage
        built = build_engine(cfg, ctx, spans_nodes=ctx.world > local_world)
        self.mark("built")
        self.engine, self.model = built.engine, built.model
        self.schedule = cfg.schedule()
        self.metrics = Metrics(cfg, ctx, flops_per_token(cfg.architecture, cfg.seq_len) * cfg.tokens_per_step)
        self.checkpointer = Checkpointer(self.engine, ctx, every=t.checkpoint_every, keep=t.keep_checkpoints,
                                         keep_healthy=t.keep_healthy, last_step=cfg.last_step,
                                         background=t.background_checkpoints, on_written=self.metrics.checkpoint)
        self.pilot = Pilot(cfg, ctx, self.engine, self.schedule, self.checkpointer,
                           scaler=self.drill.loss_scaler(t.precision))
        barrier()
        self.drill.start_up()
        resumed = self.checkpointer.resume()
        self.pilot.resume(resumed)
        self.loader = Loader(cfg.shards, cfg.global_batch, rank=ctx.data_rank, world_size=ctx.data_world, seed=t.seed,
                             micro_batch=t.micro_batch_size, skip_ranges=self.pilot.state.skip_ranges,
                             state=resumed and resumed["loader"])
        feed = Feed(self.loader, ctx, t.micro_batch_size, cfg.accumulation_at(ctx.data_world))
        self.step = TrainStep(self.engine, self.model, feed, ctx, built.own_grad_norm)
        self.evaluation = Evaluation(self.engine, cfg, ctx)
        self.stragglers = Stragglers(ctx, t.stragglers)
        self.replacing: set[int] = set()  # ranks named stragglers, their nodes to leave at the next checkpoint
        self.progress = Progress(step=resumed["step"] if resumed else 0)
        self.elastic = Elastic(cfg, ctx)
        # ready: before the initial save (its blocked time is a checkpoint's, not start-up's), and before a short
        # elastic group's wait for its nodes (goodput's replacement_wait, under the start-up limit)
        self.mark("ready", replicas=ctx.data_world, of=t.data_parallel)
        self.elastic.start(self.progress.step)
        self.watchdog.beat(self.progress.step, t.hang_seconds)  # start-up is done: each step has hang_seconds
        if resumed is None and self.pilot.enabled:
            self.save(healthy=True)  # the initial weights: a rollback target before the first checkpoint

    def fit(self) -> Progress:
        run, cfg = self.progress, self.cfg
        while run.stopped is None and run.step < cfg.last_step:
            run.phase = "step"
            effects = self.drill.before_step(run.step + 1)
            result = self.step(self.schedule.lr(run.step + 1) * effects.lr_factor, effects.poison, effects.slow)
            run.step, run.loss = run.step + 1, result.loss
            self.watchdog.beat(run.step)
            named = self.stragglers.observe(run.step, result.compute_seconds)
            if cfg.train.stragglers.exclude:
                self.replacing.update(named)
            self.metrics.step(run.step, result, self.pilot.after_step(result.overflow), self.engine.skipped_steps)
            decision = self.pilot.observe(run.step, result)
            if decision is not None and decision.stop:
                run.stopped = self.pilot.stop(run.step, decision)
                break
            if decision is not None:
                run.step = self.pilot.intervene(decision, result.batch, self.loader)["step"]
                self.drill.rolled_back()
                self.step.feed.restart()
                self.watchdog.beat(run.step)
                continue
            if self.evaluation.due(run.step):
                run.phase, began = "evaluation", time.monotonic()
                self.metrics.evaluation(run.step, self.evaluation(), time.monotonic() - began)
                self.watchdog.beat(run.step)
            if self.checkpointer.due(run.step):
                run.phase = "checkpoint"
                self.save(healthy=self.pilot.healthy(run.step), report=True)
                self.watchdog.beat(run.step)
                if self.replacing:
                    self.leave_stragglers(run.step)
                if run.step < cfg.last_step and (grow := self.elastic.grow(run.step)):
                    self.checkpointer.flush()  # published before the group ends
                    raise PlannedRestart(grow)
        run.phase = "checkpoint"
        self.checkpointer.flush()  # the last save, written and published
        self.watchdog.stop()
        if run.stopped is None and cfg.export_dir:
            run.phase, began = "export", time.monotonic()
            export(self.engine, self.model, cfg, self.ctx)
            self.mark("export", seconds=time.monotonic() - began)
        self.metrics.close(run.step, run.loss, run.stopped)
        return run

    def leave_stragglers(self, step: int) -> None:
        """The straggling ranks' nodes drained and this attempt ended, once this step's checkpoint is published:
        Ray Train restarts the group without them, and the run resumes from here."""
        t = self.cfg.train
        self.checkpointer.flush()
        why = self.stragglers.replace(step, self.replacing, t.health, (t.cpus_per_worker, t.gpus_per_worker))
        self.replacing = set()
        if why is not None:
            raise PlannedRestart(why)

    def mark(self, event: str, **fields) -> None:
        """An event on the run's timeline (rank 0), for the goodput account (train/goodput.py)."""
        if self.ctx.leader:
            goodput.mark(self.ctx.run_dir, event, **fields)

    def save(self, healthy: bool, report: bool = False) -> None:
        """A checkpoint of this step, with what a restart or a rollback needs beside the weights."""
        meta = {"loader": self.loader.state_dict(), "schedule": {"factor": self.schedule.factor},
                "loss_scale": self.pilot.loss_scale(), "metrics": {"loss": self.progress.loss},
                "health": {"healthy": healthy}, "autopilot": self.pilot.state.to_dict()}
        self.checkpointer.save(self.progress.step, meta, report_loss=self.progress.loss if report else None)

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
from functools import partial
from pathlib import Path

import numpy as np
import torch

from pipelines.config import AutopilotConfig
from train import autopilot, checkpoint, pipeline
from train.collectives import all_mean, backend, barrier
from train.hardware import peak_for
from train.parallel import Groups, ParallelDims, full_state_dict, parallelize, tensor_group_problem
from train.loader import Loader, validation_batches
from train.network import efa_problem
from train.build import build
from train.optim import INITIAL_SCALE_POWER, Schedule, adamw, deepspeed_config

log = logging.getLogger("train")

FLUSH_SECONDS = 2.0  # rank 0 sends metrics to MLflow this often


@dataclass
class Context:
    """Who this worker is and where the run lives."""

    rank: int
    world: int
    run_dir: Path
    device: torch.device
    groups: Groups | None = None  # the tensor x pipeline x data process groups when the model is split (train.parallel)

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


# --------------------------------------------------------------------------- small pieces


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_tflops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None  # on CPU: tokens/s only, no MFU
    return peak_for(torch.cuda.get_device_name(device), precision)


class Watchdog:
    """Ends this worker process when what is under way runs past its limit: a hang becomes a restart.

    It starts with the worker, so start-up (building the model, DeepSpeed's initialize, the
    checkpoint load, where OPT-175B's runs hung on storage) has a limit of its own; `beat` then
    starts each step's clock, with the step limit from the first step on."""

    def __init__(self, seconds: float, on_hang):
        self.seconds, self.on_hang = seconds, on_hang
        self.beat_at, self.step, self.started = time.monotonic(), 0, False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def beat(self, step: int, seconds: float | None = None) -> None:
        """Step `step` is done (0: start-up is); `seconds`: the limit from now on."""
        self.beat_at, self.step, self.started = time.monotonic(), step, True
        if seconds is not None:
            self.seconds = seconds

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):  # at most a second late, whatever the limit was
            stalled = time.monotonic() - self.beat_at
            if stalled > self.seconds:
                self.on_hang(self.step, stalled, self.started)
                os._exit(3)


class Faults:
    """`train.inject`: each fault fires once; fired ones are recorded in the run folder first."""

    def __init__(self, faults: list[dict], ctx: Context):
        self.ctx, self.path = ctx, ctx.run_dir / "injected.json"
        self.faults = [dict(f, index=i) for i, f in enumerate(faults)]
        self.overflow_until = 0  # the last step of an overflow burst under way

    def _fired(self) -> set[int]:
        try:
            return set(json.loads(self.path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return set()

    def _record(self, index: int) -> None:
        fired = sorted(self._fired() | {index})
        tmp = self.path.with_suffix(f".{self.ctx.rank}.tmp")
        tmp.write_text(json.dumps(fired))
        os.replace(tmp, self.path)

    def before_step(self, step: int, hang_seconds: float) -> dict:
        """Fire this step's faults (step 0: start-up, before the checkpoint load); returns the effects
        the step applies: {"lr_factor": x, "nan": True, "overflow": True}."""
        due = [f for f in self.faults if f["step"] == step]
        if not due:
            return {"overflow": True} if step <= self.overflow_until else {}
        fired = self._fired()
        barrier()  # every rank has read the same record before rank 0 adds to it
        effects: dict = {}
        for fault in due:
            if fault["index"] in fired:
                continue
            if fault["kind"] in ("spike", "nan", "overflow"):  # on every rank alike
                if self.ctx.leader:
                    self._record(fault["index"])
                    incident(self.ctx, step, f"injected {fault['kind']}" +
                             {"spike": f" (LR x {fault['factor']:g})", "nan": "",
                              "overflow": f" ({fault['count']} steps)"}[fault["kind"]])
                if fault["kind"] == "spike":
                    effects["lr_factor"] = fault["factor"]
                elif fault["kind"] == "nan":
                    effects["nan"] = True
                else:
                    self.overflow_until = step + fault["count"] - 1
                    effects["overflow"] = True
                continue
            rank = self.ctx.world - 1 if fault["rank"] is None else fault["rank"]
            if rank != self.ctx.rank:
                continue
            self._record(fault["index"])
            incident(self.ctx, step, f"injected {fault['kind']} on rank {rank}")
            if fault["kind"] == "kill":
                os._exit(1)  # the worker process dies, as on a lost GPU or an ECC error
            if fault["kind"] == "hang":
                time.sleep(10 * hang_seconds)  # stalls until the watchdog ends the process
        barrier()
        return effects


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
    """The worker's whole run; rank 0 also writes its log to the run folder's train.log (appended across
    restarts), since the workers' output stays off the driver's terminal."""
    import ray.train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = None
    if ray.train.get_context().get_world_rank() == 0:
        handler = logging.FileHandler(Path(config["run_dir"]) / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
    try:
        _train(config)
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _train(config: dict) -> None:
    quiet()
    import deepspeed
    import ray.train

    from model.configs import OPTConfig, flops_per_token

    train_ctx = ray.train.get_context()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ctx = Context(train_ctx.get_world_rank(), train_ctx.get_world_size(), Path(config["run_dir"]), device)
    ckpt_dir = ctx.run_dir / "checkpoints"
    faults = Faults(config["inject"], ctx)

    def on_hang(done: int, stalled: float, started: bool) -> None:
        if started:
            incident(ctx, done + 1, f"step {done + 1} has run {stalled:.0f} s "
                                    f"(train.hang_seconds={config['hang_seconds']}): ending this worker")
        else:
            incident(ctx, done, f"start-up (model build, DeepSpeed initialize, checkpoint load) has run {stalled:.0f} s "
                                f"(train.startup_seconds={config['startup_seconds']}): ending this worker")

    watchdog = Watchdog(config["startup_seconds"], on_hang)
    if device.type == "cpu":  # DeepSpeed's shared-memory allreduce would be compiled with g++ on first use
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    seed_everything(config["seed"])  # the same on every rank: a tensor group draws the same dropout masks
    tp, pp = config["tensor_parallel"], config["pipeline_parallel"]
    if tp > 1 or pp > 1:
        dims = ParallelDims.for_world(ctx.world, tp=tp, pp=pp)
        split = tensor_group_problem(dims, ctx.rank, train_ctx.get_local_rank(), train_ctx.get_local_world_size())
        if split is not None:  # every layer's all-reduces would cross the network: refuse rather than crawl
            raise RuntimeError(split)
        ctx.groups = Groups(dims, ctx.rank)
    model_config = OPTConfig(**config["model"])
    ds_config = deepspeed_config(micro_batch=config["micro_batch"], accumulation=config["accumulation"],
                                 world_size=ctx.data_world, zero_stage=config["zero_stage"], precision=config["precision"],
                                 grad_clip=config["grad_clip"], pipeline=ctx.pipelined)
    if ctx.pipelined:  # only this stage's layers, each drawn from its own streams (the same weights as built whole)
        deepspeed.init_distributed(dist_backend=backend())  # PipelineModule asks DeepSpeed's comm for ranks; initialize() is later
        model = pipeline.pipeline_module(model_config, ctx.groups, seed=config["seed"],
                                         activation_checkpointing=model_config.activation_checkpointing)
    else:
        model = build(model_config, ds_config, seed=config["seed"], rank=ctx.rank)
        if ctx.groups:  # built whole from the seed (ZeRO 0-2), then this rank's shard of it kept
            parallelize(model, ctx.groups)
    engine, _, _, _ = deepspeed.initialize(  # a pipeline's engine takes its module's own process grid as mpu
        model=model, optimizer=adamw(model, config["lr"], config["weight_decay"]), config=ds_config,
        mpu=None if ctx.pipelined else ctx.groups)
    # DeepSpeed reports the pre-clip grad norm from its ZeRO and mixed-precision optimizers only.
    own_grad_norm = config["zero_stage"] == 0 and config["precision"] == "fp32"
    grad_norm = None
    schedule = Schedule(config["lr"], config["warmup_steps"], config["total_steps"], config["final_lr_ratio"])
    settings = AutopilotConfig(**config["autopilot"])
    # Without fp16 there is no loss scale to collapse; when overflows are injected, a simulated one.
    scaler = autopilot.SimulatedScaler() if config["precision"] != "fp16" and any(
        f["kind"] == "overflow" for f in config["inject"]) else None
    fp16 = config["precision"] == "fp16" or scaler is not None
    state_file = ctx.run_dir / "autopilot.json"
    saved = autopilot.load_state(state_file)  # written before every intervention: newer than any checkpoint
    if saved is not None and ctx.leader:  # a rollback decided before a crash: its abandoned checkpoints stay out
        checkpoint.abandon_after(ckpt_dir, saved[1]["rolled_back_to"], saved[1]["decided_at"])
    barrier()
    if backend() == "nccl":  # its communicator exists by now (DeepSpeed's initialize broadcast the weights)
        problem = efa_problem(spans_nodes=train_ctx.get_world_size() > train_ctx.get_local_world_size())
        if problem is not None:
            raise RuntimeError(problem)

    def skipped(reason: str) -> None:
        incident(ctx, 0, f"checkpoint skipped on load: {reason}")

    faults.before_step(0, config["startup_seconds"])
    resumed = checkpoint.load_latest(engine, ckpt_dir, on_skip=skipped)
    step = 0
    loader_state = None
    pilot = saved[0] if saved is not None else autopilot.State()
    if resumed is not None:
        step, loader_state = resumed["step"], resumed["loader"]
        if saved is None and "autopilot" in resumed:
            pilot = autopilot.State.from_dict(resumed["autopilot"])
        if scaler is not None:
            scaler.scale = resumed.get("loss_scale", scaler.initial)
        if ctx.leader:
            incident(ctx, step, f"resumed from {Path(resumed['path']).name}")
    apply_settings(engine, schedule, pilot, config)
    loader = Loader(config["shards"], config["global_batch"], rank=ctx.data_rank, world_size=ctx.data_world, seed=config["seed"],
                    skip_ranges=pilot.skip_ranges, state=loader_state)
    positions = loader.positions()
    detectors = autopilot.Detectors(settings)
    logbook = autopilot.Logbook(ctx.run_dir)
    clean_steps = 0  # steps since the last incident: a checkpoint is healthy after a window of them

    sink = MetricSink(ctx, config["tracking_uri"], config["mlflow_run_id"]) if ctx.leader else None
    stalled = restarts_without_progress(ctx, step if resumed is not None else None, config["max_stalled_restarts"])
    watchdog.beat(step, config["hang_seconds"])  # start-up is done: each step has hang_seconds from here
    seq_len = config["seq_len"]
    tokens_per_step = config["global_batch"] * seq_len
    flops = flops_per_token(model_config, seq_len) * tokens_per_step
    peak = peak_tflops(device, config["precision"])
    loss = float("nan")
    progress_at = 0.0
    stopped = stalled

    def save(at: int, healthy: bool) -> Path:
        meta = {"loader": loader.state_dict(), "schedule": {"factor": schedule.factor},
                "loss_scale": current_scale(), "metrics": {"loss": loss}, "health": {"healthy": healthy},
                "autopilot": pilot.to_dict()}
        path = checkpoint.save(engine, ckpt_dir, at, meta)
        if ctx.leader:
            checkpoint.prune(ckpt_dir, config["keep_checkpoints"], config["keep_healthy"])
        return path

    def current_scale() -> float:
        return scaler.scale if scaler is not None else loss_scale(engine)

    if resumed is None and settings.enabled:
        save(0, healthy=True)  # the initial weights: a rollback target before the first checkpoint

    while stopped is None and step < config["max_steps"]:
        effects = faults.before_step(step + 1, config["hang_seconds"])
        t0 = time.perf_counter()
        g = next(positions)
        micro_batches = []
        if ctx.feeds_data:
            tokens = torch.from_numpy(loader.batch(g).astype(np.int64)).to(device)
            micro_batches = [(m[:, :-1], m[:, 1:]) for m in tokens.split(config["micro_batch"])]
        lr = schedule.lr(step + 1) * effects.get("lr_factor", 1.0)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        # An injected nan or overflow poisons the step's gradients; the loss it reports is the true one.
        poison = float("nan") if effects.get("nan") else 1e38 if effects.get("overflow") else 1.0
        skipped_before = engine.skipped_steps
        if ctx.pipelined:  # 1F1B over the micro-batches, the optimizer step at the end; the mean loss on every stage
            engine.module.loss_fn.gradient_factor = poison
            losses = [engine.train_batch(iter(micro_batches))]
            engine.module.loss_fn.gradient_factor = 1.0
            activations = pipeline.activation_norm(engine.module, ctx.groups)
        else:
            losses = []
            for inputs, targets in micro_batches:
                micro_loss = engine(inputs, targets)
                losses.append(micro_loss.detach())  # on the device: one reduction per step, no sync per micro-batch
                engine.backward(pipeline.scale_gradient(micro_loss, poison))
                if own_grad_norm and engine.is_gradient_accumulation_boundary():
                    grad_norm = gradient_norm(model, ctx.groups)  # all-reduced by backward at the boundary, before the clip
                engine.step()  # the optimizer steps at the last micro-batch (gradient_accumulation_steps)
            activations = model.last_activation_norm
        step += 1
        if not own_grad_norm:
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
        loss, act_norm = all_mean([torch.stack(losses).mean(), activations])
        seconds = time.perf_counter() - t0
        watchdog.beat(step)
        overflow = engine.skipped_steps > skipped_before
        if overflow:  # the scaler skipped the update: DeepSpeed reports inf, which is no measurement of the run
            grad_norm = None
        if scaler is not None:
            scaler.update(overflow)
        observed = {"loss": loss, "grad_norm": grad_norm, "loss_scale": current_scale(), "fp16": fp16,
                    "overflow": overflow, "activation_norm": act_norm}
        if ctx.leader:
            metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": observed["loss_scale"],
                       "overflow": int(overflow), "skipped_steps": engine.skipped_steps, "activation_norm": act_norm,
                       "tokens_per_second": tokens_per_step / seconds, "batch": g,
                       "tflops_per_device": flops / seconds / ctx.world / 1e12}
            if peak:
                metrics["mfu"] = metrics["tflops_per_device"] / peak
            sink.log(step, metrics)
            if time.monotonic() - progress_at > 5 or step == config["max_steps"]:
                progress_at = time.monotonic()
                log.info("step %d/%d loss %.4f lr %.2e tokens/s %s", step, config["max_steps"], loss, lr,
                         f"{tokens_per_step / seconds:,.0f}")
        found = detectors.observe(step, observed) if settings.enabled else None
        if found is None:
            # An overflow-skipped step is not clean: a checkpoint in the middle of an overflow burst is no
            # rollback target (a rollback there would land inside the burst it is escaping).
            clean_steps = 0 if overflow else clean_steps + 1
        else:
            clean_steps = 0
            decision = autopilot.decide(pilot, found, settings, fp16)
            if decision.stop:
                stopped = f"autopilot stopped the run at step {step}: {found.kind} ({found.detail}); {decision.why}"
                if ctx.leader:
                    logbook.append({"time": time.time(), "step": step, "kind": found.kind, "detail": found.detail,
                                    "actions": ["stop"], "why": decision.why})
                break
            step, meta = intervene(engine, decision, pilot, settings, g, loader, schedule, config, ctx, logbook,
                                   state_file, ckpt_dir)
            detectors.rolled_back()
            faults.overflow_until = 0  # an injected overflow burst belongs to the steps that were undone
            if scaler is not None:
                scaler.scale = meta.get("loss_scale", scaler.initial)
                if "reset_loss_scale" in decision.actions:
                    scaler.reset()
            positions = loader.positions()
            watchdog.beat(step)
            continue
        evaluate = config["eval_every"] and step % config["eval_every"] == 0
        if evaluate or step == config["max_steps"]:
            val = validation_losses(engine, config["shards"], config["validation_sources"], config["micro_batch"],
                                    config["eval_micro_batch"], config["eval_batches"], ctx)
            if ctx.leader and val:
                sink.log(step, {f"val_loss.{s}": v for s, v in val.items()} | {"val_loss": float(np.mean(list(val.values())))})
            watchdog.beat(step)
        if config["checkpoint_every"] and (step % config["checkpoint_every"] == 0 or step == config["max_steps"]):
            healthy = clean_steps >= min(settings.window, step) and not (fp16 and current_scale() < settings.scale_floor) \
                and not detectors.trending_up()
            path = save(step, healthy)
            watchdog.beat(step)
            report_checkpoint(step, loss, path, ctx)

    watchdog.stop()
    if stopped is None and config["export_dir"]:
        export(engine, model, config, ctx)
    if ctx.leader:
        (ctx.run_dir / "summary.json").write_text(json.dumps({"steps": step, "final_loss": loss, "stopped": stopped}))
        sink.close()


def gradient_norm(model: torch.nn.Module, groups: Groups | None = None) -> float:
    """The L2 norm of all gradients (what DeepSpeed's ZeRO optimizers report as the global grad norm); with
    the model split over a tensor group, the shards' squares summed over the group and the replicated
    parameters' counted once."""
    grads = [p for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    split = [p.grad.detach().float().pow(2).sum() for p in grads if getattr(p, "tensor_model_parallel", False)]
    whole = [p.grad.detach().float().pow(2).sum() for p in grads if not getattr(p, "tensor_model_parallel", False)]
    total = sum(whole) + (groups.sum_over_tensor(sum(split)) if split else 0.0)  # split only after parallelize()
    return float(torch.as_tensor(total).sqrt())


def loss_scale(engine) -> float:
    return float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)


def apply_settings(engine, schedule: Schedule, pilot, config: dict) -> None:
    """The autopilot's standing changes: LR factor, a fresh warmup after an optimizer reset, the clip."""
    schedule.factor = pilot.lr_factor
    schedule.rewarm_from, schedule.rewarm_steps = pilot.rewarm_from, config["autopilot"]["rewarm_steps"]
    clip = pilot.clip if pilot.clip is not None else config["grad_clip"]
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = clip  # ZeRO 1-3 and the fp16/bf16 wrappers read this
    engine._config.gradient_clipping = clip  # ZeRO 0 fp32 reads the config


def intervene(engine, decision, pilot, settings, g: int, loader: Loader, schedule: Schedule, config: dict,
              ctx: Context, logbook, state_file: Path, ckpt_dir: Path) -> tuple[int, dict]:
    """Roll back, skip, lower the LR or the clip, reset the scaler or Adam: the state is written first
    (so a crash from here on neither loses nor repeats the intervention), then applied; the loader
    continues from the target with the new skip ranges."""
    incident_step = decision.incident.step
    before = incident_step - 1 - settings.rollback_steps  # the update of step s - 1 shows in the loss of step s

    def healthy_before(meta: dict) -> bool:
        return meta.get("step", 10**18) < before and meta.get("health", {}).get("healthy", False)

    metas = (checkpoint.read_meta(p) or {} for p in checkpoint.published(ckpt_dir))
    target_meta = next((m for m in metas if healthy_before(m)), None)
    if target_meta is None:
        raise RuntimeError(f"autopilot: no healthy checkpoint before step {before} to roll back to")
    target_step = target_meta["step"]
    autopilot.apply_to_state(pilot, decision, settings, target_step, loader.position_of(target_meta["loader"]), g)
    decided_at = time.time()
    if ctx.leader:
        autopilot.save_state(state_file, pilot, {"rolled_back_to": target_step, "decided_at": decided_at})
        logbook.append({
            "time": decided_at, "step": incident_step, "kind": decision.incident.kind, "detail": decision.incident.detail,
            "actions": list(decision.actions), "why": decision.why, "rolled_back_to": target_step,
            "skipped_batches": pilot.skip_ranges[-1] if "skip" in decision.actions else None,
            "lr_factor": pilot.lr_factor, "clip": pilot.clip, "intervention": pilot.interventions})
        incident(ctx, incident_step, f"autopilot: {decision.incident.kind}: {', '.join(decision.actions)} "
                                     f"(back to step {target_step})")
    barrier()
    if ctx.leader:
        checkpoint.abandon_after(ckpt_dir, target_step, decided_at)
    barrier()
    meta = checkpoint.load_latest(engine, ckpt_dir, accept=lambda m: m.get("step") == target_step)
    if meta is None:
        raise RuntimeError(f"autopilot: checkpoint step {target_step} no longer verifies")
    if "reset_optimizer" in decision.actions:
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        inner.state.clear()  # Adam's moments and step counts; a fresh warmup follows
    if "reset_loss_scale" in decision.actions and config["precision"] == "fp16":  # else: the simulated scaler
        before_reset, after = reset_loss_scale(engine)
        if ctx.leader:
            incident(ctx, incident_step, f"loss scale reset: {before_reset:g} -> {after:g}, hysteresis and the "
                                         f"window to the next doubling restarted")
    apply_settings(engine, schedule, pilot, config)
    loader.set_skip_ranges(pilot.skip_ranges)
    loader.load_state_dict(meta["loader"])
    return target_step, meta


def reset_loss_scale(engine) -> tuple[float, float]:
    """DeepSpeed's dynamic loss scale back to its initial value, as if no overflow had happened: the scale
    through the `loss_scale` property every DeepSpeed fp16 wrapper has (ZeRO 1-3 and the fp16
    optimizers), the scaler's hysteresis refilled (else the next single overflow halves it at once)
    and the window to the next doubling started now. Raises when the engine does not take it, rather
    than let the logbook claim a reset that did not happen. Returns the scale before and after."""
    before = loss_scale(engine)
    engine.optimizer.loss_scale = 2.0 ** INITIAL_SCALE_POWER
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "dynamic", False):
        scaler.cur_hysteresis = scaler.delayed_shift
        scaler.last_overflow_iter = scaler.cur_iter - 1
    after = loss_scale(engine)
    if after != 2.0 ** INITIAL_SCALE_POWER or (scaler is not None and getattr(scaler, "dynamic", False)
                                               and scaler.cur_hysteresis != scaler.delayed_shift):
        raise RuntimeError(f"autopilot: the loss scale reset did not take ({type(engine.optimizer).__name__}: "
                           f"scale {after:g})")
    return before, after


def restarts_without_progress(ctx: Context, resumed_step: int | None, limit: int) -> str | None:
    """Why to stop instead of training, when this start-up is the (limit + 1)-th in a row from the same
    checkpoint: a fault that comes back before the next checkpoint every time is not bad luck, and
    restarting forever would burn the cluster. Every start-up is appended to the run's `starts.json`
    (the step it resumed from, 0 for a fresh start); every rank reads it before rank 0 appends, so all
    reach the same answer. 0: never stop."""
    path = ctx.run_dir / "starts.json"
    starts = json.loads(path.read_text()) if path.exists() else []
    barrier()
    starts.append(resumed_step or 0)
    if ctx.leader:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(starts))
        os.replace(tmp, path)
    in_a_row = next((i for i, s in enumerate(reversed(starts)) if s != starts[-1]), len(starts))
    if limit and in_a_row - 1 > limit:
        why = (f"{in_a_row - 1} restarts in a row from step {starts[-1]} without reaching another checkpoint "
               f"(train.max_stalled_restarts={limit}): see incidents.jsonl for the faults")
        if ctx.leader:
            incident(ctx, starts[-1], why)
        return why
    return None


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
    """The final weights as a Hugging Face folder, with the tokenizer: one piece of the model at a time
    (embeddings, each block, the final LayerNorm) is gathered on every rank (under ZeRO-3; a block of
    175B is 3.6 GB in fp16) and written by rank 0 into safetensors files of at most 5 GB, so neither
    a GPU nor rank 0's host ever holds the whole model. A tensor-parallel model (ZeRO 0-2, built whole
    in the first place) is gathered whole by rank 0's tensor group, the one replica that writes."""
    import deepspeed

    from corpus import tokenizer
    from model.configs import OPTConfig
    from model.hf import save_pretrained
    from model.opt import OPT

    tok = None
    tok_path = Path(config["shards"]) / tokenizer.FILE
    if ctx.leader:
        if tok_path.is_file():
            tok = tokenizer.load(str(tok_path))
        else:
            log.warning("%s is missing: the model is exported without a tokenizer", tok_path)

    if ctx.pipelined:
        pipeline.export_model(engine.module, ctx.groups, OPTConfig(**config["model"]), partial(
            save_pretrained, out_dir=config["export_dir"], tokenizer=tok))
        return
    if ctx.groups:
        if ctx.data_rank != 0:  # the other replicas hold the same weights
            return
        whole = full_state_dict(model, ctx.groups)
        if ctx.leader:
            unsplit = OPT(OPTConfig(**config["model"]))
            unsplit.load_state_dict(whole)
            save_pretrained(unsplit, config["export_dir"], tokenizer=tok)
        return

    def gather(part):
        return deepspeed.zero.GatheredParameters(list(part.parameters()), modifier_rank=None)

    save_pretrained(model, config["export_dir"], tokenizer=tok, gather=gather, write=ctx.leader)

"""The training stage's config section (train/) and the fields it shares with the screen's proxy runs.

What these sections can check by themselves is here, in each `validate`; the rules that need the model's
sizes or the GPU tables are train/rules.py's, which pipelines/config.py runs when a config is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import ConfigError, at_least, local_path, no_credentials, positive
from train.rules import DEEPSPEED_MIN_LOSS_SCALE, layout_rule


def check_engine(section: object, key: str) -> None:
    """A training section's DeepSpeed settings (train, screen.proxy): a ZeRO stage, a precision its devices have,
    a layout the training stage takes (layout_rule)."""
    if section.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{key}.zero_stage", f"expected 0, 1, 2 or 3, got {section.zero_stage}")
    if section.precision == "fp16" and section.gpus_per_worker == 0:
        raise ConfigError(f"{key}.precision", "fp16 needs GPUs (DeepSpeed has no fp16 on CPU): use fp32 or bf16 "
                          "with gpus_per_worker: 0")
    broken = layout_rule(section.parallel.tensor, section.parallel.pipeline, section.zero_stage, section.precision)
    if broken:
        raise ConfigError(f"{key}.{broken[0]}", broken[1])


@dataclass
class ParallelConfig:
    """How the training workers split the model (train/parallel/groups.py, train/parallel/pipeline.py); data parallelism is
    what is left: num_workers / (tensor x pipeline). `python -m pipelines.plan` says which layout is fastest."""

    tensor: int = 1  # Megatron-style tensor parallelism: each layer split over this many neighbouring workers
    pipeline: int = 1  # pipeline stages (DeepSpeed's pipeline engine, 1F1B): the layers split into this many runs

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "tensor", "pipeline")

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline

    def check(self, key: str, train: "TrainConfig") -> None:
        """What depends on the rest of the training section (what needs the model's sizes or the GPU tables
        is train/rules.py's, run by load_config's `checks`)."""
        t, p = self.tensor, self.pipeline
        if train.num_workers % t:
            raise ConfigError(f"{key}.tensor", f"{t} does not divide num_workers={train.num_workers}")
        if train.num_workers % (t * p):
            raise ConfigError(f"{key}.pipeline", f"tensor {t} x pipeline {p} does not divide num_workers={train.num_workers}")


@dataclass
class EngineConfig:
    """What a Ray Train + DeepSpeed run is given, in the training stage (`train`) and in each of the screen's
    proxy runs (`screen.proxy`): one set of fields and checks for both, each section's YAML keys flat. The screen
    turns its proxy section into a TrainConfig with these fields as they are (screen/stage.py)."""

    model: str = "tiny"  # a name from model.configs: tiny, 125m, ..., 175b
    num_workers: int = 2  # Ray Train workers (one per GPU on a cluster)
    gpus_per_worker: int = 0
    cpus_per_worker: float = 0.5  # fractional locally, so Ray Data can still schedule
    zero_stage: int = 2
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    micro_batch_size: int = 1  # sequences per worker per forward/backward
    global_batch_tokens: int | None = None  # None: the model's batch from OPT's Table 1
    lr: float | None = None  # None: the model's peak LR from OPT's Table 1
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate_engine(self, key: str) -> None:
        at_least(self, key, 1, "num_workers", "micro_batch_size", "global_batch_tokens")
        at_least(self, key, 0, "gpus_per_worker")
        positive(self, key, "cpus_per_worker", "lr")
        check_engine(self, key)
        self.parallel.check(f"{key}.parallel", self)


@dataclass
class AutopilotConfig:
    """The stability autopilot (train/autopilot_policy.py); defaults modelled on OPT, PaLM and OLMo."""

    enabled: bool = True
    window: int = 50  # steps of history for the rolling mean and sigma
    warmup: int = 20  # steps before the spike detectors arm
    loss_sigma: float = 6.0
    loss_ratio: float = 0.1  # and at least 10% above the rolling mean
    grad_sigma: float = 6.0
    grad_ratio: float = 2.0  # and at least three times the rolling mean (grad norms are heavy-tailed)
    patience: int = 1  # consecutive steps with the loss over the line before it is an incident
    grad_patience: int = 3  # the same for the grad norm: a single-step grad-norm burst is common and harmless
    # fp16: a loss scale under this is a collapse, and a checkpoint at a scale under it is not healthy. It sits
    # above DeepSpeed's own minimum (DEEPSPEED_MIN_LOSS_SCALE), where DeepSpeed's next overflow ends the run: with
    # 2, the step that halves the scale to 1 is seen and rolled back (the scaler reset) before that can happen.
    # (OPT called a scale >= 1 healthy; its fairseq scaler went on below 1.)
    scale_floor: float = 2.0
    overflow_window: int = 50
    overflow_limit: int = 10  # overflow-skipped steps within overflow_window
    activation_window: int = 100  # 0: off
    activation_growth: float = 0.5  # the second half of the window's mean over the first's, minus one
    # The checkpoint rolled back to is older than the step before the incident by at least this many steps
    # (an incident seen at step s was caused by an update at step s - 1 or earlier; PaLM went ~100 steps back).
    rollback_steps: int = 10
    skip_margin: int = 10  # batches skipped past the incident's
    repeat_window: int = 500  # another incident within this many steps escalates
    lr_factor: float = 0.5
    clip_to: float = 0.3
    rewarm_steps: int = 50  # after an optimizer reset
    budget: int = 8  # interventions, after which the run stops

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "window", "patience", "grad_patience", "overflow_window", "overflow_limit", "repeat_window")
        at_least(self, key, 0, "warmup", "activation_window", "rollback_steps", "skip_margin", "rewarm_steps", "budget")
        positive(self, key, "loss_sigma", "grad_sigma", "lr_factor", "clip_to", "scale_floor")


@dataclass
class StragglerConfig:
    """Naming a rank that is slower than its peers (train/loop/stragglers.py): one slow GPU sets the pace of all
    of them. Each rank's forward compute per step, its median over `window` steps (one stalled step is not a
    slow GPU), against the median of the others'."""

    window: int = 50  # steps per comparison (0: off); one small all_gather each
    margin: float = 0.5  # slower than the others' median by more than this fraction ...
    patience: int = 2  # ... in this many windows in a row: named, once
    # Named, its node drained at the next checkpoint and the run restarted from it on the other nodes and the
    # ones the autoscaler brings (a planned restart: the same global batch, an exact resume). Within the same
    # limit as the health check's drains (health.max_excluded_fraction, over the run).
    exclude: bool = False

    def validate(self, key: str) -> None:
        at_least(self, key, 0, "window")
        at_least(self, key, 1, "patience")
        positive(self, key, "margin")


@dataclass
class HealthConfig:
    """Node health checks and exclusion (train/health.py)."""

    # Probe every node before the first start, and a node implicated in failures; None: when the cluster has
    # more than one node (a single machine has nowhere else to go).
    enabled: bool | None = None
    min_fraction: float = 0.5  # of the node's reference (its GPU's peak, or the other nodes' median)
    collective: bool = True  # the all-reduce test (two processes on the node: a few seconds)
    failures: int = 2  # a node with this many failures ...
    window_seconds: float = 6 * 3600.0  # ... within this long is checked again
    # The most of the nodes training can use that the run drains, over the run (at least one). Past it, nothing
    # more is drained: the run stops (first check) or goes on without the drain (a restart), and says the cause
    # looks systemic. Hardware faults strike nodes one by one: Llama 3's 54 days on 2,000 nodes had 419
    # unexpected interruptions, about 8 a day. A quarter of the nodes failing at once is a bad image, driver,
    # NCCL setting or a bug in the probe, and draining them would empty the cluster (Ray cannot undo a drain).
    max_excluded_fraction: float = 0.25

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "failures")
        positive(self, key, "window_seconds")
        if not 0.0 < self.min_fraction <= 1.0:
            raise ConfigError(f"{key}.min_fraction", f"expected a fraction in (0, 1], got {self.min_fraction}")
        if not 0.0 < self.max_excluded_fraction <= 1.0:
            raise ConfigError(f"{key}.max_excluded_fraction",
                              f"expected a fraction in (0, 1], got {self.max_excluded_fraction}")


@dataclass
class InjectConfig:
    """A fault to inject, for tests and demos; each fires once, even across restarts."""

    kind: Literal["kill", "hang", "error", "slow", "spike", "nan", "overflow", "unhealthy"]
    # kill: a worker process dies; hang: a step stalls until the watchdog ends it; error: the worker raises
    # an exception, on every attempt (a bug) (kill, hang and error at step 0: during start-up, before the
    # checkpoint load); slow: from `step` on, the worker's every step's compute takes `factor` times as long
    # (a straggler: a GPU at 1 / factor of its speed, whatever the device); spike: the LR is multiplied by
    # `factor` for that step; nan: that step's gradients are NaN; overflow: `count` steps from `step` overflow
    # (fp16's scaler skips them; on fp32/bf16 a simulated scaler); unhealthy: `node` fails every health check
    # from `step` on (0: the check before the first start), as a node with a bad GPU would
    step: int
    rank: int | None = None  # kill, hang, error, slow: the worker it happens on (None: the last rank) ...
    node: str | None = None  # ... or every worker on this Ray node (its id; benchmarks/chaos.py); unhealthy: required
    factor: float | None = None  # spike (default 50) and slow (default 2)
    count: int = 1  # overflow

    def validate(self, key: str) -> None:
        at_least(self, key, 0 if self.kind in ("kill", "hang", "error", "unhealthy") else 1, "step")
        at_least(self, key, 1, "count")
        at_least(self, key, 0, "rank")
        if self.factor is not None and not self.factor > (1.0 if self.kind == "slow" else 0.0):
            raise ConfigError(f"{key}.factor", f"expected a number over {1 if self.kind == 'slow' else 0}, got {self.factor}")
        if self.kind == "unhealthy" and not self.node:
            raise ConfigError(f"{key}.node", "an unhealthy fault names its node (a Ray node id)")

    @property
    def times(self) -> float:
        """`factor`, or the kind's default (spike: the LR x 50; slow: compute x 2)."""
        return self.factor if self.factor is not None else {"spike": 50.0, "slow": 2.0}.get(self.kind, 1.0)


@dataclass
class TrainConfig(EngineConfig):
    warmup_tokens: int = 375_000_000  # linear warmup (OPT: 375M tokens; 2000 steps for 175B)
    total_tokens: int = 300_000_000_000  # linear decay to final_lr_ratio * lr over this many tokens
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    max_steps: int | None = None  # None: total_tokens' worth of steps
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    dropout: float | None = None  # on the residual branches; None: the model's (OPT: 0.1)
    checkpoint_every: int = 100  # steps (0: never, for throwaway runs such as the screen's proxies)
    keep_checkpoints: int = 3  # the last K ...
    keep_healthy: int = 5  # ... plus the newest H marked healthy (the autopilot's rollback targets)
    # A save blocks training only while the state is copied to host memory; a thread writes, hashes and
    # publishes it (false: every rank waits for the whole write, as OPT-175B's did: about 100 s at 175B).
    background_checkpoints: bool = True
    eval_every: int = 100  # steps between evaluations on the whole held-out set (0: only at the end)
    eval_micro_batch_size: int | None = None  # sequences per evaluation forward; None: 4 x micro_batch_size
    # Training runs of the same data and settings, seeds seed, seed + 1, ...: the first is the run (checkpoints,
    # export); the others are evaluated only, so that pipelines/compare.py knows the seed-to-seed noise.
    seeds: int = 1
    # Restarts: OPT-175B's run restarted over 100 times, so a worker that dies is restarted from the newest
    # checkpoint that verifies without a limit (-1) by default; a fault that recurs before the next checkpoint
    # max_stalled_restarts times in a row is a bug, not bad luck, and fails the stage.
    max_failures: int = -1  # Ray Train's FailureConfig: worker-group restarts before the stage fails (-1: no limit)
    max_stalled_restarts: int = 3  # restarts in a row from the same checkpoint before the stage fails (0: no limit)
    hang_seconds: float = 1800.0  # a step running longer than this is ended (the worker exits) and restarted
    startup_seconds: float = 3600.0  # the same for start-up: model build, DeepSpeed initialize, checkpoint load
    # A collective waits this long for the slowest rank before it fails (NCCL/gloo's timeout). Longer than
    # hang_seconds and startup_seconds: a hung rank is then ended by its own watchdog, which says why,
    # instead of every rank failing with a bare collective timeout.
    collective_timeout_seconds: float = 4200.0  # every process group: the world group and all made after it
    storage: str | None = None  # checkpoints; None: WORKDIR/train/runs (use shared storage on a cluster)
    seed: int = 0
    inject: list[InjectConfig] = field(default_factory=list)
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    @property
    def data_parallel(self) -> int:
        return self.num_workers // self.parallel.model_parallel

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "max_steps", "keep_checkpoints", "eval_micro_batch_size", "seeds")
        at_least(self, key, 0, "checkpoint_every", "warmup_tokens", "eval_every", "weight_decay", "keep_healthy",
                  "max_stalled_restarts")
        at_least(self, key, -1, "max_failures")
        positive(self, key, "grad_clip", "total_tokens", "hang_seconds", "startup_seconds")
        slowest = max(self.hang_seconds, self.startup_seconds)
        if self.collective_timeout_seconds <= slowest:
            raise ConfigError(f"{key}.collective_timeout_seconds", f"expected more than hang_seconds and startup_seconds "
                              f"({slowest:g}), got {self.collective_timeout_seconds:g}: a hung rank's watchdog must act first")
        self.validate_engine(key)
        no_credentials(self, key, "storage")
        if self.precision == "fp16" and self.autopilot.enabled and self.autopilot.scale_floor <= DEEPSPEED_MIN_LOSS_SCALE:
            raise ConfigError(f"{key}.autopilot.scale_floor", f"expected more than {DEEPSPEED_MIN_LOSS_SCALE}, DeepSpeed's "
                              f"minimum loss scale, got {self.autopilot.scale_floor:g}: at its minimum DeepSpeed ends the "
                              "run on the next overflow, before the autopilot sees a collapse")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{key}.dropout", f"expected a probability in [0, 1), got {self.dropout}")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ConfigError(f"{key}.final_lr_ratio", f"expected a fraction in [0, 1], got {self.final_lr_ratio}")
        for i, fault in enumerate(self.inject):
            if fault.kind == "overflow" and self.zero_stage == 0:
                raise ConfigError(f"{key}.inject[{i}].kind", "overflow needs zero_stage >= 1 (ZeRO's optimizer skips "
                                  "the overflowing step; ZeRO 0 would apply it)")
            if fault.rank is not None and fault.rank >= self.num_workers:
                raise ConfigError(f"{key}.inject[{i}].rank", f"expected a rank below num_workers={self.num_workers}, got {fault.rank}")

    def resolve_paths(self, key: str) -> None:
        if self.storage is not None:
            self.storage = local_path(self.storage, f"{key}.storage")

"""The training stage's config section (train/) and the fields it shares with the screen's proxy runs.

What these sections can check by themselves is here, in each `validate`; the rules that need the model's
sizes or the GPU tables are train/rules.py's, which pipelines/config.py runs when a config is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import LAYOUT, ConfigError, at_least, local_path, no_credentials, positive
from train.rules import DEEPSPEED_MIN_LOSS_SCALE, compile_rule, layout_rule

AUTO = "auto"  # zero_stage: the lowest stage that fits (train/plan/planner.py zero_stage_for)


def check_engine(section: object, key: str) -> None:
    """A training section's DeepSpeed settings (train, screen.proxy): a ZeRO stage, a precision its devices have,
    a layout the training stage takes (layout_rule)."""
    if section.zero_stage not in (0, 1, 2, 3, AUTO):
        raise ConfigError(f"{key}.zero_stage", f"expected 0, 1, 2, 3 or {AUTO}, got {section.zero_stage}")
    if section.precision == "fp16" and section.gpus_per_worker == 0:
        raise ConfigError(f"{key}.precision", "fp16 needs GPUs (DeepSpeed has no fp16 on CPU): use fp32 or bf16 "
                          "with gpus_per_worker: 0")
    tensor, pipeline = section.parallel.tensor, section.parallel.pipeline
    uncompiled = section.compile and compile_rule(tensor, pipeline, section.zero_stage)
    if uncompiled:
        raise ConfigError(f"{key}.compile", uncompiled)
    if section.zero_stage == AUTO:  # chosen where the sections meet (pipelines/config.py), among the stages this rule takes
        return
    broken = layout_rule(tensor, pipeline, section.zero_stage, section.precision)
    if broken:
        raise ConfigError(f"{key}.{broken[0]}", broken[1])


@dataclass
class ParallelConfig:
    """How the training workers split the model (train/parallel/groups.py, train/parallel/pipeline.py); data parallelism is
    what is left: num_workers / (tensor x pipeline). `python -m pipelines.plan` says which layout is fastest."""

    tensor: int = 1
    """[Tensor parallelism](glossary.md#tensor-parallelism), Megatron style: each layer split over this many
    neighbouring workers, which must share a node. It must divide `num_workers` and the model's heads, FFN width
    and vocabulary; it takes ZeRO 0 to 2."""
    pipeline: int = 1
    """[Pipeline](glossary.md#pipeline-parallelism) stages (DeepSpeed's pipeline engine, [1F1B](glossary.md#1f1b)):
    the layers split into this many runs of consecutive layers. `tensor` x `pipeline` must divide `num_workers`; a
    pipeline takes `zero_stage: 1`."""

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

    model: str = "tiny"
    """The OPT model, by name: `tiny` (a laptop's), or one of OPT's Table 1: `125m`, `350m`, `1.3b`, `2.7b`,
    `6.7b`, `13b`, `30b`, `66b`, `175b`."""
    num_workers: int = field(default=2, metadata={LAYOUT: True})
    """Ray Train workers, one per GPU on a cluster. `parallel.tensor` x `parallel.pipeline` must divide it; what is
    left is the [data-parallel](glossary.md#data-parallelism) size."""
    gpus_per_worker: int = field(default=0, metadata={LAYOUT: True})
    """GPUs each worker asks Ray for: 1 on a GPU cluster. 0 trains on CPU, which takes `fp32` or `bf16`."""
    cpus_per_worker: float = field(default=0.5, metadata={LAYOUT: True})
    """CPUs each worker asks Ray for. Fractional on a laptop, so that Ray Data can still schedule its tasks."""
    zero_stage: int | Literal["auto"] = 2
    """The [ZeRO](glossary.md#zero) stage, 0 to 3: what is sharded over the data-parallel workers (1: optimizer
    state; 2: and gradients; 3: and weights). A pipeline takes 1, tensor parallelism 0 to 2, fp16 1 to 3. `auto`:
    the lowest stage the layout takes that the layout planner predicts fits in the GPU's memory (on CPU, the lowest
    it takes), chosen when the config is loaded; a lower stage runs less of DeepSpeed per step
    ([training.md](training.md#zero_stage-auto))."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The training precision. `fp16` keeps fp32 master weights with a dynamic [loss scale](glossary.md#loss-scale),
    as OPT trained, and needs GPUs."""
    micro_batch_size: int = field(default=1, metadata={LAYOUT: True})
    """Sequences per worker per forward and backward pass. Gradients are accumulated over micro-batches up to the
    global batch."""
    global_batch_tokens: int | None = None
    """Tokens per optimizer step over all workers. It must split into whole micro-batches on every data-parallel
    worker. `null`: the model's batch in OPT's Table 1."""
    lr: float | None = None
    """The peak learning rate. `null`: the model's in OPT's Table 1."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={LAYOUT: True})
    """How the workers split the model; data parallelism is what is left: `num_workers` / (tensor x pipeline).
    `.venv/bin/python -m pipelines.plan` says which [layout](glossary.md#layout) is fastest."""
    compile: bool = False
    """`torch.compile` each transformer block, as torchtitan does: its LayerNorms, dropouts, residual adds and ReLU
    fused into fewer kernels. The first steps pay the compile (seconds to a minute); on CPU it needs a C++
    compiler. Takes tensor and pipeline 1 and ZeRO 0-2 ([training.md](training.md#compiled-blocks))."""

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
    """`false`: no detection and no intervention."""
    window: int = 50
    """Steps of history for the rolling mean and standard deviation of the loss and the gradient norm. A
    checkpoint is healthy when this many steps before it had no incident."""
    warmup: int = 20
    """Steps of history the spike detectors wait for before they arm."""
    loss_sigma: float = 6.0
    """A loss spike is a loss above the rolling mean by this many standard deviations (OLMo's 6), and by
    `loss_ratio`."""
    loss_ratio: float = 0.1
    """A loss spike must also be above the rolling mean by this fraction of it (0.1: 10%), so that a very flat
    curve does not alarm on noise."""
    grad_sigma: float = 6.0
    """The same as `loss_sigma`, for the gradient norm."""
    grad_ratio: float = 2.0
    """The same as `loss_ratio`, for the gradient norm: 2.0 is three times the mean, since gradient norms are
    heavy-tailed."""
    patience: int = 1
    """Consecutive steps with the loss over the line before it is an incident."""
    grad_patience: int = 3
    """The same for the gradient norm: a single-step burst of the gradient norm is common and harmless."""
    # It sits above DeepSpeed's own minimum (DEEPSPEED_MIN_LOSS_SCALE), where DeepSpeed's next overflow ends the run.
    # (OPT called a scale >= 1 healthy; its fairseq scaler went on below 1.)
    scale_floor: float = 2.0
    """fp16: a loss scale under this is a collapse, and a checkpoint saved under it is not healthy. It must exceed
    DeepSpeed's minimum of 1, where DeepSpeed ends the run at the next overflow: at 2 the autopilot sees the
    collapse and rolls back first."""
    overflow_window: int = 50
    """Steps over which overflow-skipped steps are counted (`overflow_limit`)."""
    overflow_limit: int = 10
    """Overflow-skipped steps within `overflow_window` that make a loss-scale collapse."""
    activation_window: int = 100
    """Steps over which the final layer's activation norm is watched for growth. 0: off."""
    activation_growth: float = 0.5
    """The growth that is an incident: the mean activation norm of the window's second half over its first
    half's, minus one (0.5: half as large again)."""
    rollback_steps: int = 10
    """A rollback goes to the newest healthy checkpoint at least this many steps before the step whose update
    caused the incident (the step before it). PaLM went about 100 steps back."""
    skip_margin: int = 10
    """After a rollback, the batches from the checkpoint to the incident are skipped, and this many more."""
    repeat_window: int = 500
    """Another incident within this many steps escalates the answer: then also lower the LR, then the clip,
    then reset the loss scale, then Adam's state."""
    lr_factor: float = 0.5
    """On escalation the learning rate is multiplied by this, from then on."""
    clip_to: float = 0.3
    """The gradient clip set at the next escalation; OPT lowered its clip from 1.0 to 0.3."""
    rewarm_steps: int = 50
    """Steps of learning-rate warmup after the optimizer state is reset, the last escalation."""
    budget: int = 8
    """Interventions allowed: at the next incident after them the run stops with the reason."""

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "window", "patience", "grad_patience", "overflow_window", "overflow_limit", "repeat_window")
        at_least(self, key, 0, "warmup", "activation_window", "rollback_steps", "skip_margin", "rewarm_steps", "budget")
        positive(self, key, "loss_sigma", "grad_sigma", "lr_factor", "clip_to", "scale_floor")


@dataclass
class StragglerConfig:
    """Naming a rank that is slower than its peers (train/loop/stragglers.py): one slow GPU sets the pace of all
    of them. Each rank's forward compute per step, its median over `window` steps (one stalled step is not a
    slow GPU), against the median of the others'."""

    window: int = 50
    """Steps per comparison of the ranks' median step times, one small all_gather each. 0: off."""
    margin: float = 0.5
    """A rank whose median step is slower than the others' median by more than this fraction (0.5: 50%), in
    `patience` windows in a row, is named."""
    patience: int = 2
    """Windows in a row a rank must be slow in before it is named, once, with its node."""
    exclude: bool = False
    """`true`: a named straggler's node is also [drained](glossary.md#drain) at the next checkpoint, and the run
    restarts from that checkpoint without it (a planned restart with an exact resume). Drains count against
    `health.max_excluded_fraction`."""

    def validate(self, key: str) -> None:
        at_least(self, key, 0, "window")
        at_least(self, key, 1, "patience")
        positive(self, key, "margin")


@dataclass
class HealthConfig:
    """Node health checks and exclusion (train/health.py)."""

    enabled: bool | None = None
    """Probe the nodes before the first start and at restarts (`restart_probe`). `null`: only when more than one
    node can host a training worker (a single machine has nowhere else to go)."""
    min_fraction: float = 0.5
    """A node under this fraction, in (0, 1], of its reference on any test (the rate a healthy GPU of its kind
    reaches, or the other nodes' median) fails the check and is drained."""
    collective: bool = True
    """Include the all-reduce tests: across the node's GPUs, and with its neighbours in a ring of the nodes."""
    restart_probe: Literal["all", "implicated"] = "all"
    """Which nodes a restart probes, once the failed worker group is torn down. `all`: every node that can host a
    worker and is not drained, in parallel, at every restart, so a node that turned unhealthy without failing is
    found at the next restart. `implicated`: only a node with `failures` failures of its own within
    `window_seconds`, for clusters where a full probe costs too much (docs/training.md#health-checks says what
    each costs at 124 nodes)."""
    failures: int = 2
    """With `restart_probe: implicated`: a node implicated in this many failures within `window_seconds` is probed
    again as the next attempt starts."""
    window_seconds: float = 6 * 3600.0
    """Seconds over which a node's failures are counted (`failures`); the default is 6 hours."""
    max_excluded_fraction: float = 0.25
    """The most of the nodes training can use that the run drains, over the run (at least one), in (0, 1]. Past
    it nothing is drained, the cause looking systemic: a first check stops the run, a restart goes on. Hardware
    fails node by node; many at once is a bad image, driver or setting."""

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "failures")
        positive(self, key, "window_seconds")
        if not 0.0 < self.min_fraction <= 1.0:
            raise ConfigError(f"{key}.min_fraction", f"expected a fraction in (0, 1], got {self.min_fraction}")
        if not 0.0 < self.max_excluded_fraction <= 1.0:
            raise ConfigError(f"{key}.max_excluded_fraction",
                              f"expected a fraction in (0, 1], got {self.max_excluded_fraction}")


@dataclass
class ElasticConfig:
    """Going on with fewer data-parallel replicas when nodes are lost and not replaced (train/loop/elastic.py).
    Ray Train starts the group with the replicas the cluster can host, `min_replicas` at least; gradient
    accumulation makes up the missing ones, so the global batch, the schedule and the samples are the same."""

    enabled: bool = False
    """Go on at a reduced size instead of waiting for the whole group (Ray Train's elastic worker group)."""
    min_replicas: int = 1
    """The fewest data-parallel replicas the run trains on (a replica: `parallel.tensor` x `parallel.pipeline`
    workers); below it, it waits for nodes. A size that does not divide the global batch's micro-batches pads: some
    replicas run one micro-batch that counts for nothing."""
    replacement_wait_seconds: float = 300.0
    """How long a group started short waits for the missing nodes (an autoscaler's replacements) before it goes
    on without them. Once reduced, the run grows back at the first checkpoint after they join."""

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "min_replicas")
        at_least(self, key, 0, "replacement_wait_seconds")


@dataclass
class InjectConfig:
    """A fault to inject, for tests and demos; each fires once, even across restarts."""

    kind: Literal["kill", "hang", "error", "slow", "spike", "nan", "overflow", "unhealthy", "lost", "back"]
    """The fault. `kill`: a worker process dies. `hang`: a step stalls until the watchdog ends it. `error`: the
    worker raises, on every attempt (a bug). `slow`: from `step` on, the worker's compute takes `factor` times as
    long (a straggler). `spike`: the LR is multiplied by `factor` for one step. `nan`: that step's gradients are
    NaN. `overflow`: `count` steps overflow. `unhealthy`: `node` fails every health check from `step` on. `lost`:
    `node` dies and is not replaced; `back`: a node named `node` joins (both need a drill that owns the cluster,
    benchmarks/chaos.py, which acts on the markers they leave in the run folder)."""
    step: int
    """The step it fires at. `kill`, `hang` and `error` at 0 fire during start-up, before the checkpoint load;
    `unhealthy` at 0 fails the check before the first start. The other kinds take 1 or more."""
    rank: int | None = None
    """`kill`, `hang`, `error`, `slow`: the worker it happens on, below `num_workers`. `null`: the last rank."""
    node: str | None = None
    """Instead of `rank`: every worker on this Ray node (its id). Required for `unhealthy` and `lost`; for `back`, the
    joining node's name."""
    factor: float | None = None
    """`spike`: the LR multiplier (`null`: 50). `slow`: how many times as long each step's compute takes, over 1
    (`null`: 2)."""
    count: int = 1
    """`overflow`: how many steps overflow, from `step` on. Each is skipped (the optimizer leaves the weights as
    they were), and fp16's loss scaler halves; on fp32 or bf16 a simulated scaler does."""

    def validate(self, key: str) -> None:
        at_least(self, key, 0 if self.kind in ("kill", "hang", "error", "unhealthy") else 1, "step")
        at_least(self, key, 1, "count")
        at_least(self, key, 0, "rank")
        if self.factor is not None and not self.factor > (1.0 if self.kind == "slow" else 0.0):
            raise ConfigError(f"{key}.factor", f"expected a number over {1 if self.kind == 'slow' else 0}, got {self.factor}")
        if self.kind in ("unhealthy", "lost", "back") and not self.node:
            what = "a name for the node that joins" if self.kind == "back" else "a Ray node id"
            raise ConfigError(f"{key}.node", f"{'an' if self.kind == 'unhealthy' else 'a'} {self.kind} fault names its "
                              f"node ({what})")

    @property
    def times(self) -> float:
        """`factor`, or the kind's default (spike: the LR x 50; slow: compute x 2)."""
        return self.factor if self.factor is not None else {"spike": 50.0, "slow": 2.0}.get(self.kind, 1.0)


@dataclass
class TrainConfig(EngineConfig):
    """The training stage's section: the engine's keys (EngineConfig) and the run's schedule, checkpoints,
    restarts, seeds and health."""

    warmup_tokens: int = 375_000_000
    """Tokens of linear learning-rate warmup from 0 to `lr`. OPT warmed up over 375M tokens for its smaller
    models and over 2000 steps for 175B."""
    total_tokens: int = 300_000_000_000
    """Tokens over which the learning rate decays linearly to `final_lr_ratio` x `lr`, and the run's length unless
    `max_steps` stops it sooner. OPT trained on 300B. For an ablation, set it to the tokens it trains."""
    final_lr_ratio: float = 0.1
    """Where the decay ends, as a fraction of `lr`, in [0, 1]. OPT decayed to 10% of its peak."""
    weight_decay: float = 0.1
    """AdamW's weight decay, as OPT's; none on biases and LayerNorms."""
    max_steps: int | None = None
    """Stop after this many steps. `null`: `total_tokens`' worth. A run stopped before its decay ends gives noisier
    seeds, and compare.py less sure verdicts: lower `total_tokens` instead."""
    grad_clip: float = 1.0
    """The gradient norm is clipped to this; 1.0 is OPT's. The autopilot may lower it (`autopilot.clip_to`)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: less GPU memory, more
    compute."""
    dropout: float | None = None
    """Dropout on the residual branches, in [0, 1). `null`: the model's (OPT's is 0.1). `0.0` lets layouts be
    compared step for step."""
    checkpoint_every: int = 100
    """Steps between [checkpoints](glossary.md#checkpoint). 0: never (throwaway runs, such as the screen's
    proxies)."""
    keep_checkpoints: int = 3
    """The newest checkpoints kept; older ones are deleted, except those `keep_healthy` keeps."""
    keep_healthy: int = 5
    """The newest checkpoints marked healthy, kept as well: the autopilot's rollback targets."""
    background_checkpoints: bool = True
    """Training stops for a save only while the state is copied to host memory; a thread then writes, hashes and
    publishes it. `false`: every rank waits for the whole write, as OPT-175B's did."""
    eval_every: int = 100
    """Steps between evaluations on the whole held-out set (bits per byte per source and subset). 0: only at the
    end, where there is always one."""
    eval_micro_batch_size: int | None = None
    """Sequences per evaluation forward pass. `null`: 4 x `micro_batch_size`."""
    seeds: int = 1
    """Training runs of the same data and settings, seeds `seed`, `seed` + 1, ...: the first is the run (curves in
    MLflow, faults injected); each is evaluated and exported. compare.py needs 3 for a verdict on seed-to-seed
    noise."""
    max_failures: int = -1
    """Worker-group restarts (Ray Train's FailureConfig) before the stage fails. -1: no limit, since OPT-175B's run
    restarted over 100 times."""
    max_stalled_restarts: int = 3
    """Restarts in a row from the same checkpoint before the stage fails: a fault that recurs before the next
    checkpoint is a bug, not bad luck. 0: no limit."""
    hang_seconds: float = 1800.0
    """A step that runs longer than this is ended by a watchdog (the worker exits), and the workers restart from
    the newest good checkpoint."""
    startup_seconds: float = 3600.0
    """The same for a worker's start-up: the model build, DeepSpeed's initialize and the checkpoint load."""
    collective_timeout_seconds: float = 4200.0
    """How long a collective waits for the slowest rank before it fails (NCCL's or gloo's timeout), in every
    process group. Above `hang_seconds` and `startup_seconds`, so that a hung rank's own watchdog ends it first and
    says why."""
    storage: str | None = None
    """Where the training [run folder](glossary.md#run-folder) goes (checkpoints, metrics, logs). `null`:
    WORKDIR/train/runs. On a cluster, storage every node mounts: a path or `file://` URI."""
    seed: int = 0
    """The run's seed: the model's initial weights, the batch order and dropout. The other `seeds` follow it."""
    inject: list[InjectConfig] = field(default_factory=list)
    """Faults to inject, for tests and demos, such as `[{kind: kill, step: 40}]`. Each fires once, even across
    restarts, except `error`, `slow` and `unhealthy`, which last."""
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    """The stability [autopilot](glossary.md#autopilot): it detects loss and gradient-norm spikes, non-finite
    values, loss-scale collapses and growing activations, and answers with escalating rollbacks, as OPT-175B's team
    did by hand."""
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """Naming a [straggler](glossary.md#straggler), a rank slower than its peers: one slow GPU sets the pace of
    all of them."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Node health checks: probe the nodes before the first start and after failures, and drain a bad one."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig, metadata={LAYOUT: True})
    """[Elastic](training.md#elastic-going-on-without-a-lost-node) data parallelism: a run that loses nodes with no
    replacement goes on with fewer replicas, the same global batch, and grows back when they return."""

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
        self.validate_elastic(f"{key}.elastic")
        for i, fault in enumerate(self.inject):
            if fault.rank is not None and fault.rank >= self.num_workers:
                raise ConfigError(f"{key}.inject[{i}].rank", f"expected a rank below num_workers={self.num_workers}, got {fault.rank}")

    def resolve_paths(self, key: str) -> None:
        if self.storage is not None:
            self.storage = local_path(self.storage, f"{key}.storage")

    def validate_elastic(self, key: str) -> None:
        if not self.elastic.enabled:
            return
        if self.elastic.replacement_wait_seconds >= self.startup_seconds:
            raise ConfigError(f"{key}.replacement_wait_seconds", f"expected less than startup_seconds "
                              f"({self.startup_seconds:g}), got {self.elastic.replacement_wait_seconds:g}: the wait is "
                              "part of a start-up, and its watchdog would end it")
        if self.elastic.min_replicas > self.data_parallel:
            raise ConfigError(f"{key}.min_replicas", f"expected at most the run's {self.data_parallel} data-parallel "
                              f"replicas, got {self.elastic.min_replicas}")


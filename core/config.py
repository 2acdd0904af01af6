"""Pipeline configuration: YAML in, typed dataclasses out, every bad key named.

A config is data (torchtitan style): one dataclass per section, defaults that are the embedded
laptop run, and one generic validator that walks the type hints. Anything a user can get wrong
(an unknown key, a wrong type, a value out of range, a path that matches nothing) raises
`ConfigError` with the dotted key and what was expected, which the CLI turns into exit code 2.
`--set a.b=c` overrides go through the same validator, typed by the field they target.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import yaml

from core import storage


class ConfigError(ValueError):
    """A bad config value; str() is the one line the user sees."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


# --------------------------------------------------------------------------- sections


def _at_least(section: object, key: str, low: float, *names: str) -> None:
    """Each named field of `section` must be >= low (None allowed: 'use the default')."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ConfigError(f"{key}.{name}", f"expected a value >= {low}, got {value}")


def _positive(section: object, key: str, *names: str) -> None:
    """Each named field of `section` must be > 0 (None allowed: 'use the default')."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}.{name}", f"expected a positive number, got {value}")


def _check_engine(section: object, key: str) -> None:
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


def layout_rule(tensor: int, pipeline: int, zero_stage: int, precision: str) -> tuple[str, str] | None:
    """The first rule of this project's training stage that a layout breaks, as (its key within a training
    section, the message), or None. One source for the config (train, screen.proxy) and the layout planner
    (train/plan/layout.py: refused_here); they need neither the model's sizes nor the GPU tables."""
    if precision == "fp16" and zero_stage == 0:
        # DeepSpeed's ZeRO-0 fp16 wrapper around a client torch optimizer applies updates loss-scale times
        # too small (platform notes), and has no loss scaler for the autopilot to reset.
        return "zero_stage", "fp16 needs zero_stage 1, 2 or 3"
    if pipeline > 1 and zero_stage != 1:
        return "parallel.pipeline", (f"pipeline parallelism takes zero_stage 1, got {zero_stage}: DeepSpeed's pipeline "
                                     "engine refuses ZeRO-2 and ZeRO-3 (deepspeed/runtime/pipe/engine.py: \"ZeRO-2 and "
                                     "ZeRO-3 are incompatible with pipeline parallelism\"), and under ZeRO-0 it reports "
                                     "no gradient norm, which the autopilot watches")
    if tensor > 1 and zero_stage == 3:
        return "parallel.tensor", ("tensor parallelism takes ZeRO 0-2 here: the model is built whole and then split "
                                   "(train/parallel/groups.py), which ZeRO-3's partitioned build cannot follow")
    return None


# DeepSpeed's dynamic loss scale never goes under this (its `min_loss_scale`: an integer, at least 1); an overflow
# at it raises "Current loss scale already at minimum" and ends the run.
DEEPSPEED_MIN_LOSS_SCALE = 1


# The Pile subsets OPT kept (by `meta.pile_set_name`); the other 14 it dropped.
OPT_PILE_SUBSETS = [
    "Pile-CC", "DM Mathematics", "Gutenberg (PG-19)", "HackerNews",
    "OpenSubtitles", "OpenWebText2", "USPTO Backgrounds", "Wikipedia (en)",
]


@dataclass
class SourceConfig:
    """One raw source; `format` picks the reader (see design.md, Sources in a config)."""

    name: str
    format: Literal["pile", "pushshift", "text", "jsonl"]
    paths: list[str]
    text_field: str = "text"  # jsonl: the field holding the document
    id_field: str | None = None  # jsonl: the field whose value is the id, unchanged
    keep_subsets: list[str] | None = None  # pile: subsets kept (None: OPT's 8); the rest set aside
    split: Literal["file", "blank_lines"] = "file"  # text: one document per file, or per blank-line block

    def validate(self, key: str) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{key}.name", f"expected a short name of letters, digits, '-' or '_', got {self.name!r}")
        if not self.paths:
            raise ConfigError(f"{key}.paths", "expected at least one path or glob")
        if self.keep_subsets is not None and self.format != "pile":
            raise ConfigError(f"{key}.keep_subsets", f"only for format 'pile', this source is '{self.format}'")
        if self.keep_subsets == []:
            raise ConfigError(f"{key}.keep_subsets", "expected at least one subset (or leave it out for OPT's 8)")
        if self.split != "file" and self.format != "text":
            raise ConfigError(f"{key}.split", f"only for format 'text', this source is '{self.format}'")
        if self.format == "pile" and self.keep_subsets is None:
            self.keep_subsets = list(OPT_PILE_SUBSETS)


@dataclass
class IngestConfig:
    """How raw files become documents (corpus/ingest.py)."""

    on_bad_input: Literal["reject", "fail"] = "reject"  # fail: exit 1 at the first bad line, naming it
    task_mb: int = 256  # files smaller than this are read together in one task, up to this many MB

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "task_mb")


@dataclass
class RayConfig:
    """How Ray starts when RAY_ADDRESS is not set (with it set, the cluster decides)."""

    num_cpus: int | None = None  # None: all cores of this machine
    # A groupby moving less than this many MB shuffles in Ray Data tasks (a sort); more, on Ray Data's
    # hash-shuffle actors with partitions sized for the data (core/ray_session.py: groupby). 0: always hash.
    small_shuffle_mb: int = 256

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "num_cpus")
        _at_least(self, key, 0, "small_shuffle_mb")


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI (the cluster's server), else sqlite under workdir
    experiment: str | None = None  # None: the config file's name (local, opt-175b, ...)
    # Where run artifacts go, given to MLflow when it creates the experiment: any URI MLflow writes
    # to (s3://bucket/mlflow, gs://..., file://...) or a folder. None: WORKDIR/mlartifacts.
    artifact_location: str | None = None


@dataclass
class NormalizeConfig:
    """Each rule can be switched off; corpus/normalize.py says what each does."""

    ftfy: bool = True  # ftfy.fix_text: mojibake, HTML entities, bad unicode
    whitespace: bool = True  # OPT's "ad-hoc whitespace normalization"
    gutenberg: bool = True  # Project Gutenberg licence header and footer
    chapter_headings: bool = True  # lone "Chapter One" lines at the start of a book
    min_chars: int = 1  # shorter documents are dropped, with the reason (empty ones always are)

    def validate(self, key: str) -> None:
        _at_least(self, key, 0, "min_chars")


@dataclass
class EvalConfig:
    """The held-out evaluation set (corpus/evalset.py): drawn at normalize, before dedup and the screen, so that
    every data ablation is evaluated on the same documents."""

    fraction: float = 0.0025  # of each source's (and so each subset's) documents; OPT held out ~200 MB of ~800 GB
    seed: int = 0  # the draw is a seeded hash of (source, id): a document is in or out whatever else changes

    def validate(self, key: str) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ConfigError(f"{key}.fraction", f"expected a fraction in [0, 1), got {self.fraction}")


@dataclass
class DedupConfig:
    """dedup/minhash.py says why 5-word shingles; dedup/lsh.py how bands and rows are chosen."""

    threshold: float = 0.95  # OPT: drop documents with Jaccard >= 0.95 to another one
    ngram: int = 5  # word n-gram shingles
    lowercase: bool = True
    num_perm: int = 128
    bands: int | None = None  # None (with rows): the most rows that still find 99.9% of pairs at the threshold
    rows: int | None = None
    seed: int = 1234

    def validate(self, key: str) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"{key}.threshold", f"expected a Jaccard similarity in (0, 1], got {self.threshold}")
        _at_least(self, key, 1, "ngram", "num_perm", "bands", "rows")
        if (self.bands is None) != (self.rows is None):
            raise ConfigError(f"{key}.{'rows' if self.rows is None else 'bands'}", "set bands and rows together, or neither")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ConfigError(f"{key}.bands", f"{self.bands} bands x {self.rows} rows needs more than num_perm={self.num_perm} permutations")


TOKENIZER_FILES = ("vocab", "merges", "fairseq_dict")  # kind gpt2 reads these; paths resolved at load


@dataclass
class TokenizerConfig:
    kind: Literal["train", "gpt2"] = "train"  # train: byte-level BPE trained on the corpus (offline default)
    vocab_size: int = 50272  # train: at most this many ids (a small corpus may give fewer merges)
    vocab: str | None = None  # gpt2: GPT-2's (or OPT's released) vocab.json
    merges: str | None = None  # gpt2: GPT-2's merges.txt
    fairseq_dict: str | None = None  # gpt2: fairseq's dict.txt, for OPT's exact ids from GPT-2's own vocab.json
    train_bytes: int = 1 << 30  # train: text sampled from the corpus to train on (row groups, seeded)

    def validate(self, key: str) -> None:
        _at_least(self, key, 260, "vocab_size")  # 256 bytes + 4 specials
        _at_least(self, key, 1, "train_bytes")
        if self.kind == "gpt2":
            for name in ("vocab", "merges"):
                if getattr(self, name) is None:
                    raise ConfigError(f"{key}.{name}", "required when kind is 'gpt2' (GPT-2's BPE files)")
        else:
            for name in TOKENIZER_FILES:
                if getattr(self, name) is not None:
                    raise ConfigError(f"{key}.{name}", f"only read when kind is 'gpt2' (kind is {self.kind!r})")


@dataclass
class ParallelConfig:
    """How the training workers split the model (train/parallel/groups.py, train/parallel/pipeline.py); data parallelism is
    what is left: num_workers / (tensor x pipeline). `python -m train.plan` says which layout is fastest."""

    tensor: int = 1  # Megatron-style tensor parallelism: each layer split over this many neighbouring workers
    pipeline: int = 1  # pipeline stages (DeepSpeed's pipeline engine, 1F1B): the layers split into this many runs

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "tensor", "pipeline")

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
        _at_least(self, key, 1, "num_workers", "micro_batch_size", "global_batch_tokens")
        _at_least(self, key, 0, "gpus_per_worker")
        _positive(self, key, "cpus_per_worker", "lr")
        _check_engine(self, key)
        self.parallel.check(f"{key}.parallel", self)


@dataclass
class ProxyConfig(EngineConfig):
    """The proxy model of the screen: every proxy run trains it with these settings (only the data and seed differ).
    OPT measured spikes at 1.3B; the defaults are a laptop's."""

    num_workers: int = 1  # Ray Train workers per proxy run
    cpus_per_worker: float = 1.0
    zero_stage: int = 0
    seq_len: int = 2048
    warmup_steps: int = 10  # then a constant LR: no decay to hide spikes

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "seq_len")
        _at_least(self, key, 0, "warmup_steps")
        self.validate_engine(key)


@dataclass
class ScreenConfig:
    """The subset screen (screen/): proxy runs per subset, spike scores, the drop rule (screen/score.py)."""

    enabled: bool = True  # false: every document passes, no proxy runs
    sources: list[str] | None = None  # whose subsets are screened; None: every source of format pile (as OPT)
    subsets: list[str] | None = None  # None: every subset of `sources` that reaches the screen
    steps: int = 100  # per proxy run
    seeds: int = 2  # proxy runs per mixture in the first round (seed, seed + 1, ...); at least 2
    max_seeds: int = 6  # inconclusive subsets get more seeds, round by round, up to this many
    seed: int = 0  # also the sample's
    upweight: float = 0.3  # the candidate subset's share of its mixture's tokens
    ratio: float = 2.0  # the line: a subset whose proxies are this many times as rough as the baseline mix's is spiky
    alpha: float = 0.05  # the chance of a wrong drop (or keep) of a subset on the line, over all its looks
    inconclusive: Literal["keep", "drop"] = "keep"  # what becomes of a subset still undecided at max_seeds
    # Subsets (a source without subsets is its own, e.g. reddit) dropped from training whatever the screen measures:
    # a data ablation that keeps the evaluation set (drawn before, at normalize), where removing a source from
    # `sources` would change it. Their documents go to dropped/ with the reason, as the screen's drops do.
    drop: list[str] = field(default_factory=list)
    spike_ratio: float = 0.25  # a step this far above its fit is counted as a spike (reported, not judged)
    burn_in: int = 10  # first steps not scored
    concurrent_runs: int = 2  # Ray Train jobs of proxy runs at a time
    runs_per_job: int = 1  # proxy runs a Ray Train job takes, one after another, over the rounds (a laptop: many)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # the proxy runs' (set it as tokenize's)

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "concurrent_runs", "runs_per_job")
        _at_least(self, key, 2, "seeds")
        _at_least(self, key, 0, "burn_in", "spike_ratio")
        if self.max_seeds < self.seeds:
            raise ConfigError(f"{key}.max_seeds", f"expected at least seeds = {self.seeds}, got {self.max_seeds}")
        if not self.ratio > 1.0:
            raise ConfigError(f"{key}.ratio", f"expected a ratio above 1 (the line above the baseline mix), got {self.ratio}")
        if not 0.0 < self.alpha < 0.5:
            raise ConfigError(f"{key}.alpha", f"expected an error rate in (0, 0.5), got {self.alpha}")
        if self.inconclusive not in ("keep", "drop"):
            raise ConfigError(f"{key}.inconclusive", f"expected keep or drop, got {self.inconclusive!r}")
        if self.steps < self.burn_in + 4:
            raise ConfigError(f"{key}.steps", f"expected at least burn_in + 4 = {self.burn_in + 4} steps, got {self.steps}")
        if not 0.0 < self.upweight < 1.0:
            raise ConfigError(f"{key}.upweight", f"expected a fraction in (0, 1), got {self.upweight}")
        if self.subsets == []:
            raise ConfigError(f"{key}.subsets", "expected at least one subset (or leave it out: every subset of `sources`)")


@dataclass
class TokenizeConfig:
    seq_len: int = 2048  # OPT; blocks are seq_len + 1 tokens (input and shifted target)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seed: int = 0

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "seq_len")


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
        _at_least(self, key, 1, "window", "patience", "grad_patience", "overflow_window", "overflow_limit", "repeat_window")
        _at_least(self, key, 0, "warmup", "activation_window", "rollback_steps", "skip_margin", "rewarm_steps", "budget")
        _positive(self, key, "loss_sigma", "grad_sigma", "lr_factor", "clip_to", "scale_floor")


@dataclass
class StragglerConfig:
    """Naming a rank that is slower than its peers (train/loop/stragglers.py): one slow GPU sets the pace of all
    of them. Each rank's forward compute per step, averaged over `window` steps, against the median of the
    others'."""

    window: int = 50  # steps per comparison (0: off); one small all_gather each
    margin: float = 0.5  # slower than the others' median by more than this fraction ...
    patience: int = 2  # ... in this many windows in a row: named, once

    def validate(self, key: str) -> None:
        _at_least(self, key, 0, "window")
        _at_least(self, key, 1, "patience")
        _positive(self, key, "margin")


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

    def validate(self, key: str) -> None:
        _at_least(self, key, 1, "failures")
        _positive(self, key, "window_seconds")
        if not 0.0 < self.min_fraction <= 1.0:
            raise ConfigError(f"{key}.min_fraction", f"expected a fraction in (0, 1], got {self.min_fraction}")


@dataclass
class InjectConfig:
    """A fault to inject, for tests and demos; each fires once, even across restarts."""

    kind: Literal["kill", "hang", "error", "slow", "spike", "nan", "overflow"]
    # kill: a worker process dies; hang: a step stalls until the watchdog ends it; error: the worker raises
    # an exception, on every attempt (a bug) (kill, hang and error at step 0: during start-up, before the
    # checkpoint load); slow: from `step` on, the worker's every step takes `seconds` longer (a straggler);
    # spike: the LR is multiplied by `factor` for that step; nan: that step's gradients are NaN;
    # overflow: `count` steps from `step` overflow (fp16's scaler skips them; on fp32/bf16 a simulated scaler)
    step: int
    rank: int | None = None  # kill, hang, error, slow: the worker it happens on (None: the last rank) ...
    node: str | None = None  # ... or every worker on this Ray node (its id; benchmarks/chaos.py)
    factor: float = 50.0  # spike
    count: int = 1  # overflow
    seconds: float = 0.5  # slow

    def validate(self, key: str) -> None:
        _at_least(self, key, 0 if self.kind in ("kill", "hang", "error") else 1, "step")
        _at_least(self, key, 1, "count")
        _at_least(self, key, 0, "rank")
        _positive(self, key, "seconds")


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
        _at_least(self, key, 1, "max_steps", "keep_checkpoints", "eval_micro_batch_size", "seeds")
        _at_least(self, key, 0, "checkpoint_every", "warmup_tokens", "eval_every", "weight_decay", "keep_healthy",
                  "max_stalled_restarts")
        _at_least(self, key, -1, "max_failures")
        _positive(self, key, "grad_clip", "total_tokens", "hang_seconds", "startup_seconds")
        slowest = max(self.hang_seconds, self.startup_seconds)
        if self.collective_timeout_seconds <= slowest:
            raise ConfigError(f"{key}.collective_timeout_seconds", f"expected more than hang_seconds and startup_seconds "
                              f"({slowest:g}), got {self.collective_timeout_seconds:g}: a hung rank's watchdog must act first")
        self.validate_engine(key)
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


@dataclass
class PipelineConfig:
    """The whole pipeline. `local.yaml` is these defaults plus the sample corpus."""

    sources: list[SourceConfig]
    workdir: str = "work"
    sample_corpus: str | None = None  # when set and missing: generate the sample corpus here
    sample_spiky_subset: str | None = None  # the generated sample's Pile subset planted spiky, for the screen to find
    ray: RayConfig = field(default_factory=RayConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    screen: ScreenConfig = field(default_factory=ScreenConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    name: str = "pipeline"  # set from the config file's name at load

    def validate(self, key: str) -> None:
        names = [s.name for s in self.sources]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise ConfigError(f"sources[{i}].name", f"duplicate source name {n!r}")
        if not self.sources:
            raise ConfigError("sources", "expected at least one source")
        if self.sample_spiky_subset is not None and self.sample_spiky_subset not in OPT_PILE_SUBSETS:
            raise ConfigError("sample_spiky_subset", f"expected one of OPT's Pile subsets (the ones the screen screens): "
                              f"{', '.join(OPT_PILE_SUBSETS)}; got {self.sample_spiky_subset!r}")
        for i, source in enumerate(self.screen.sources or []):
            if source not in names:
                raise ConfigError(f"screen.sources[{i}]", f"expected the name of a source ({', '.join(names)}), got {source!r}")


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), workdir: str | None = None,
                checks: Sequence[Callable[[PipelineConfig], None]] = ()) -> PipelineConfig:
    """Read YAML, apply `--set key=value` overrides and `--workdir`, validate, run `checks`, resolve paths.

    `checks` are the rules this package cannot know: each takes the validated config and raises
    ConfigError (train/rules.py's check_config: what needs the model's sizes or the GPU tables;
    pipelines/stages.py's CHECKS is what a run loads with). Relative paths (workdir, sample_corpus,
    source globs) are resolved against the current directory, which is the job's working directory
    under `ray job submit`.
    """
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError("", f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("", f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("", f"config file {str(path)!r} must be a mapping of sections, got {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    for item in overrides:
        apply_override(raw, item)
    if workdir is not None:
        raw["workdir"] = workdir
    config = from_dict(PipelineConfig, raw, "")
    for check in checks:
        check(config)
    return _resolve_paths(config)


def default_config_path() -> Path:
    return Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def apply_override(raw: dict, item: str) -> None:
    """`a.b.c=value` (or `sources.0.paths=[...]`): value typed by the field it targets."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("", f"--set expects dotted.key=value, got {item!r}")
    parts = key.split(".")
    target_type = _type_at(PipelineConfig, parts, key)
    if _is_str_type(target_type):
        value: Any = text  # verbatim: `--set mlflow.experiment=2024` stays a string
    else:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(key, f"--set value {text!r} is not a valid YAML value") from None
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(part, node, here)]
            continue
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ConfigError(here, f"expected a mapping, got {_describe(node)}")
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(last, node, key)] = value
    else:
        node[last] = value


def _list_index(part: str, node: list, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(key, f"expected a list index below {len(node)}, got {part!r}")
    return int(part)


def _type_at(cls: type, parts: list[str], key: str) -> Any:
    """The declared type at a dotted path, so that unknown keys fail before anything is set."""
    tp: Any = cls
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                raise ConfigError(here, f"unknown key; expected one of: {', '.join(hints)}")
            tp = hints[part]
        elif typing.get_origin(tp) is list:
            if not part.isdigit():
                raise ConfigError(here, "expected a list index")
            tp = typing.get_args(tp)[0]
        else:
            raise ConfigError(here, f"cannot set a key inside a value of type {_type_name(tp)}")
    return tp


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if _is_union(tp) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_str_type(tp: Any) -> bool:
    return _strip_optional(tp) is str


def _type_name(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def from_dict(tp: Any, value: Any, key: str) -> Any:
    """Build `tp` from YAML data, checking every type; errors name the dotted key."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return from_dict(arg, value, key)
            except ConfigError as exc:
                errors.append(exc)
        nested = [e for e in errors if e.key != key]
        if len(errors) == 1 and nested:  # Optional[section]: the error inside the section is the useful one
            raise errors[0]
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
        (item_tp,) = typing.get_args(tp)
        return [from_dict(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {_describe(value)}")
        hints = typing.get_type_hints(tp)
        for k in value:
            if k not in hints:
                raise ConfigError(_join(key, str(k)), f"unknown key; expected one of: {', '.join(hints)}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = from_dict(hints[f.name], value[f.name], _join(key, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(_join(key, f.name), f"missing; expected {_type_name(hints[f.name])}")
        obj = tp(**kwargs)
        if hasattr(obj, "validate"):
            obj.validate(key)
        return obj
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):  # YAML 1.1 reads 3e-4 as a string
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool):
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - a type this loader does not know is a bug in the dataclasses
        raise TypeError(f"unsupported config type {tp!r} at {key}")
    raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({'null' if value is None else type(value).__name__})"


def _resolve_paths(config: PipelineConfig) -> PipelineConfig:
    """Relative paths made absolute; `file://` URIs of folders made paths; the sources' URIs kept
    (core/storage.py says which path may be which)."""
    config.workdir = _local(config.workdir, "workdir")
    if config.mlflow.tracking_uri is None:
        config.mlflow.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.join(config.workdir, 'mlflow.db')}"
    if config.mlflow.experiment is None:
        config.mlflow.experiment = config.name
    location = config.mlflow.artifact_location or os.path.join(config.workdir, "mlartifacts")
    config.mlflow.artifact_location = location if storage.is_uri(location) else Path(storage.local_path(location)).as_uri()
    if config.sample_corpus is not None:
        config.sample_corpus = _local(config.sample_corpus, "sample_corpus")
    for source in config.sources:
        source.paths = [p if storage.is_uri(p) else storage.local_path(p) for p in source.paths]
    for key, tok in tokenizers_of(config):
        for name in TOKENIZER_FILES:
            path = getattr(tok, name)
            setattr(tok, name, _local(path, f"{key}.{name}") if path else None)
    if config.train.storage is not None:
        config.train.storage = _local(config.train.storage, "train.storage")
    return config


def _local(path: str, key: str) -> str:
    try:
        return storage.local_path(path)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def tokenizers_of(config: PipelineConfig) -> list[tuple[str, TokenizerConfig]]:
    """Every tokenizer section, by its dotted key."""
    return [("tokenize.tokenizer", config.tokenize.tokenizer), ("screen.tokenizer", config.screen.tokenizer)]


def check_inputs_exist(config: PipelineConfig) -> None:
    """Every input file named in the config must exist: checked before any stage starts."""
    for key, tok in tokenizers_of(config):
        for name in TOKENIZER_FILES:
            path = getattr(tok, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{key}.{name}", f"file {path!r} does not exist")
    for i, source in enumerate(config.sources):
        for j, pattern in enumerate(source.paths):
            try:
                found = storage.expand(pattern)
            except (ValueError, OSError) as exc:  # an unknown scheme, an unreachable bucket
                raise ConfigError(f"sources[{i}].paths[{j}]", f"cannot list {pattern!r}: {exc}") from None
            if not found:
                raise ConfigError(f"sources[{i}].paths[{j}]", f"no file matches {pattern!r}")


def source_files(source: SourceConfig) -> list[str]:
    """The files a source reads (paths or URIs, as its globs name them), sorted, each once."""
    return sorted({p for pattern in source.paths for p in storage.expand(pattern)})


def section_dict(config: PipelineConfig, section: str | tuple[str, ...]) -> Any:
    """A config section (or several, by name) as plain data: what fingerprints and MLflow params are made of."""
    if isinstance(section, tuple):
        return {name: section_dict(config, name) for name in section}
    value = getattr(config, section)
    if isinstance(value, list):
        return [dataclasses.asdict(v) for v in value]
    return dataclasses.asdict(value)

"""The pipeline's config: each stage's section (kept beside its code) composed into one, loaded from YAML.

`load_config` is what every entry point calls (pipelines/full.py, compare.py, the planner's and the
placement probe's command lines). The generic loader is core/config.py's; the rules across sections
are here (PipelineConfig.validate) and in train/rules.py (what needs the model's sizes or the GPU tables).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from core import storage
from core.config import ConfigError, load, local_path, no_credentials
from core.ray_session import RayConfig
from core.tracking import MlflowConfig, environment_tracking_uri
from corpus.config import (OPT_PILE_SUBSETS, EvalConfig, IngestConfig, NormalizeConfig, SourceConfig, TokenizeConfig,
                           TokenizerConfig)
from dedup.config import DedupConfig
from screen.config import ScreenConfig
from train import rules as train_rules
from train.config import AUTO, TrainConfig


@dataclass
class PipelineConfig:
    """The whole pipeline. `local.yaml` is these defaults plus the sample corpus."""

    sources: list[SourceConfig]
    """The raw sources ingest reads, one entry each (required). Their order matters: of duplicates, dedup keeps
    the document of the source listed first. A change of sources changes the evaluation set; to train without a
    source and keep the set, use `screen.drop`."""
    workdir: str = "work"
    """Where the stages' outputs, their cache, the run's summary and (by default) MLflow's store go: a path or
    `file://` URI every node mounts; an object store is refused. `--workdir` overrides it. Another workdir has a
    cache of its own."""
    sample_corpus: str | None = None
    """When set and the folder is missing, `pipelines/full.py` generates the sample corpus there first; `sources`
    must point into it. Generating it changes the raw files, which ingest's fingerprint sees. `null`: none."""
    sample_spiky_subset: str | None = None
    """The Pile subset of the generated sample planted with documents that make gradient norms spike, for the
    screen to find; one of OPT's 8 subsets. Read only when the sample is generated: delete the folder to apply a
    change."""
    ray: RayConfig = field(default_factory=RayConfig)
    """How Ray starts when `RAY_ADDRESS` is not set, and how its shuffles run. With `RAY_ADDRESS` set (`ray job
    submit`), the run joins that cluster."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """Where runs are tracked in MLflow."""
    ingest: IngestConfig = field(default_factory=IngestConfig)
    """The ingest stage: how raw files become documents, and what a bad record does."""
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    """The normalize stage's text rules, each of which can be switched off."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out evaluation set, drawn at normalize (before dedup and the screen) so that every data
    [ablation](glossary.md#ablation) is evaluated on the same documents; its decontamination; and the downstream
    tasks."""
    dedup: DedupConfig = field(default_factory=DedupConfig)
    """The dedup stage: near-duplicates removed with [MinHash-LSH](glossary.md#minhash-lsh), over all sources
    together, every candidate pair checked with its exact Jaccard similarity."""
    screen: ScreenConfig = field(default_factory=ScreenConfig)
    """The screen stage: [proxy runs](glossary.md#proxy-run) per Pile subset, and the rule that drops the subsets
    that make gradient norms spike, as OPT did by hand."""
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    """The tokenize stage: the kept documents to OPT's training sequences, and the evaluation set to its
    windows."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The train stage: Ray Train and DeepSpeed, with checkpoints, restarts, the stability autopilot and
    several seeds."""
    name: str = "pipeline"
    """The run's name, set from the config file's name at load unless the file sets one. It names the MLflow
    experiment (unless `mlflow.experiment` is set) and the training run's folder. Letters, digits, `-`, `_` and
    `.` (not first), never `..`."""

    def validate(self, key: str) -> None:
        # The run's folder and MLflow experiment are named after it: a path of its own would put them elsewhere.
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", self.name) or ".." in self.name:
            raise ConfigError("name", "expected letters, digits, '-', '_' and '.' (not first, never '..'): the run's "
                              f"folder and MLflow experiment are named after it; got {self.name!r}")
        no_credentials(self, "", "workdir", "sample_corpus")
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

    def resolve_paths(self) -> None:
        """Relative paths made absolute; `file://` URIs of folders made paths; the sources' URIs kept
        (core/storage.py says which path may be which); MLflow's defaults filled in under the workdir."""
        self.workdir = local_path(self.workdir, "workdir")
        mlflow = self.mlflow
        if mlflow.tracking_uri is None:
            mlflow.tracking_uri = environment_tracking_uri() or f"sqlite:///{os.path.join(self.workdir, 'mlflow.db')}"
        if mlflow.experiment is None:
            mlflow.experiment = self.name
        location = mlflow.artifact_location or os.path.join(self.workdir, "mlartifacts")
        mlflow.artifact_location = location if storage.is_uri(location) else Path(storage.local_path(location)).as_uri()
        if self.sample_corpus is not None:
            self.sample_corpus = local_path(self.sample_corpus, "sample_corpus")
        for source in self.sources:
            source.resolve_paths()
        for key, tok in tokenizers_of(self):
            tok.resolve_paths(key)
        self.train.resolve_paths("train")


def training_rules(config: PipelineConfig) -> None:
    """train/rules.py's rules (what needs the model's sizes or the GPU tables) on both training sections, here where
    they meet: screen.proxy and then train (the order the sections are read in). The proxy's batch splits over its
    replicas at its own seq_len; train's over its data-parallel workers at tokenize.seq_len. Then `zero_stage: auto`
    becomes the stage it stands for (train/plan/planner.py zero_stage_for)."""
    proxy, train, seq_len = config.screen.proxy, config.train, config.tokenize.seq_len
    train_rules.check_section("screen.proxy", proxy.model, proxy.parallel.tensor, proxy.parallel.pipeline, proxy.gpus_per_worker)
    train_rules.check_batch("screen.proxy", proxy.model, proxy.global_batch_tokens, proxy.seq_len, proxy.micro_batch_size,
                            proxy.num_workers // proxy.parallel.model_parallel)
    train_rules.check_section("train", train.model, train.parallel.tensor, train.parallel.pipeline, train.gpus_per_worker)
    train_rules.check_batch("train", train.model, train.global_batch_tokens, seq_len, train.micro_batch_size,
                            train.data_parallel, seq_len_key="tokenize.seq_len")
    # The stage `auto` stands for (once the models and batches are known good), before anything reads it.
    if AUTO in (proxy.zero_stage, train.zero_stage):
        from train.plan.planner import zero_stage_for

        if proxy.zero_stage == AUTO:  # a proxy run's length: screen/stage.py proxy_train_config's
            proxy.zero_stage = zero_stage_for("screen.proxy", proxy, proxy.seq_len,
                                              config.screen.steps * proxy.batch_tokens, recompute=False)
        if train.zero_stage == AUTO:
            train.zero_stage = zero_stage_for("train", train, seq_len, train.total_tokens,
                                              recompute=train.activation_checkpointing)


# What a run's config is checked with beyond each section's own validation (load_config's `checks`).
CHECKS = (training_rules,)


def default_config_path() -> Path:
    return Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), workdir: str | None = None,
                checks: Sequence[Callable[[PipelineConfig], None]] = ()) -> PipelineConfig:
    """Read YAML (None: configs/local.yaml), apply `--set key=value` overrides and `--workdir`, validate, run
    `checks` (CHECKS is what a run loads with), resolve paths. Relative paths (workdir, sample_corpus,
    source globs) are resolved against the current directory, which is the job's working directory under
    `ray job submit`."""
    overrides = [*overrides, *([f"workdir={workdir}"] if workdir is not None else [])]
    return load(PipelineConfig, path if path is not None else default_config_path(), overrides, checks)


def tokenizers_of(config: PipelineConfig) -> list[tuple[str, TokenizerConfig]]:
    """Every tokenizer section, by its dotted key."""
    return [("tokenize.tokenizer", config.tokenize.tokenizer), ("screen.tokenizer", config.screen.tokenizer)]


def check_inputs_exist(config: PipelineConfig) -> None:
    """Every input file named in the config must exist: checked before any stage starts."""
    for key, tok in tokenizers_of(config):
        tok.check_files_exist(key)
    for i, source in enumerate(config.sources):
        for j, pattern in enumerate(source.paths):
            try:
                found = storage.expand(pattern)
            except (ValueError, OSError) as exc:  # an unknown scheme, an unreachable bucket
                raise ConfigError(f"sources[{i}].paths[{j}]", f"cannot list {pattern!r}: {exc}") from None
            if not found:
                raise ConfigError(f"sources[{i}].paths[{j}]", f"no file matches {pattern!r}")

"""The pipeline's seven stages, declared once, in DAG order (design.md's table)."""

from __future__ import annotations

from corpus import ingest, normalize, tokenize
from dedup import stage as dedup_stage
from screen import stage as screen_stage
from core import storage
from corpus.config import TOKENIZER_FILES, TokenizerConfig, source_files
from pipelines.config import PipelineConfig
from core.dag import Stage
from train import stage as train_stage
from train.downstream import stage as downstream_stage


def raw_files_identity(config: PipelineConfig) -> list[list]:
    """What ingest reads from outside the workdir: each source's files by path (or URI), size and mtime.

    Stat, not content hashes: hashing terabytes of dumps to decide a cache hit would cost as
    much as reading them. A file replaced in place with the same size and mtime is not seen.
    """
    out = []
    for source in config.sources:
        for path in source_files(source):
            out.append([source.name, path, *storage.stat(path)])
    return out


def tokenizer_files_identity(tok: TokenizerConfig) -> list[list]:
    """GPT-2's vocab/merges/dict files, by path, size and mtime (as for raw files)."""
    paths = [getattr(tok, name) for name in TOKENIZER_FILES]
    return [[p, *storage.stat(p)] for p in paths if p is not None]


STAGES: tuple[Stage, ...] = (
    # Each stage's code is its run function's module and every module of ours that it imports (core/imports.py).
    Stage("ingest", (), ("ingest", "sources"), run=ingest.run, external=raw_files_identity),
    Stage("normalize", ("ingest",), ("normalize", "eval"), run=normalize.run),
    Stage("dedup", ("normalize",), ("dedup", "eval"), run=dedup_stage.run),  # eval.decontaminate: its first phase
    Stage("screen", ("dedup",), "screen", run=screen_stage.run,
          external=lambda config: tokenizer_files_identity(config.screen.tokenizer)),
    # normalize's output too: a trained tokenizer is sampled from it, before dedup and the screen, so that their
    # ablations all get the same tokenizer; and its evaluation set, tokenized beside the training shards
    Stage("tokenize", ("screen", "normalize"), "tokenize", run=tokenize.run,
          external=lambda config: tokenizer_files_identity(config.tokenize.tokenizer)),
    Stage("train", ("tokenize",), "train", run=train_stage.run, resumable=True),
    # Each seed's exported model through lm-evaluation-harness: a stage of its own, so that a new task list reruns it
    # and not training (train/downstream/stage.py); normalize's output for the evaluation set its own task is made
    # from. The harness runs by name in a process of its own (code); lm-eval's version and our task files are its
    # external. Its section, eval.downstream, is keyed apart from the `eval` that normalize and dedup key on.
    Stage("downstream", ("train", "normalize"), "eval.downstream", run=downstream_stage.run,
          code=("train.downstream.harness",), external=downstream_stage.identity),
)

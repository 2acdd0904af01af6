"""The pipeline's six stages, declared once, in DAG order (design.md's table).

A stage that is not built yet has `run=None` and names the issue that builds it: the runner
leaves it (and whatever depends on it) out of a default run and says so, and refuses it with
exit code 2 when asked for by name.
"""

from __future__ import annotations

import os

from corpus import ingest, normalize, tokenize
from dedup import stage as dedup_stage
from pipelines.config import TOKENIZER_FILES, PipelineConfig, source_files
from pipelines.dag import Stage
from train import stage as train_stage


def raw_files_identity(config: PipelineConfig) -> list[list]:
    """What ingest reads from outside the workdir: each source's files by path, size and mtime.

    Stat, not content hashes: hashing terabytes of dumps to decide a cache hit would cost as
    much as reading them. A file replaced in place with the same size and mtime is not seen.
    """
    out = []
    for source in config.sources:
        for path in source_files(source):
            st = os.stat(path)
            out.append([source.name, path, st.st_size, st.st_mtime_ns])
    return out


def tokenizer_files_identity(config: PipelineConfig) -> list[list]:
    """GPT-2's vocab/merges/dict files, by path, size and mtime (as for raw files)."""
    tok = config.tokenize.tokenizer
    paths = [getattr(tok, name) for name in TOKENIZER_FILES]
    return [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths if p is not None]


STAGES: tuple[Stage, ...] = (
    Stage("ingest", (), ("ingest", "sources"), run=ingest.run, code=("corpus.ingest", "corpus.readers", "corpus.reddit", "corpus.parts"),
          external=raw_files_identity, issue=3),
    Stage("normalize", ("ingest",), "normalize", run=normalize.run, code=("corpus.normalize", "corpus.parts"), issue=3),
    Stage("dedup", ("normalize",), "dedup", run=dedup_stage.run, code=("dedup.stage", "dedup.minhash", "dedup.lsh", "corpus.parts"),
          issue=4),
    Stage("screen", ("dedup",), "screen", run=None, issue=9),
    # Tokenize reads dedup's documents until the screen (issue 9) is built; then it reads the screen's.
    Stage("tokenize", ("dedup",), "tokenize", run=tokenize.run, code=("corpus.tokenize", "corpus.tokenizer", "corpus.parts"),
          external=tokenizer_files_identity, issue=5),
    Stage("train", ("tokenize",), "train", run=train_stage.run, issue=7, resumable=True,
          code=("train.stage", "train.loop", "train.loader", "train.checkpoint", "train.optim", "train.autopilot",
                "train.plot", "model.opt", "model.configs", "model.hf")),
)

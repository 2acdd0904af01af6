"""The corpus stages' config sections (ingest, normalize with the held-out set, tokenize) and OPT's Pile subsets.

Each section is a dataclass with a `validate(key)` that core/config.py's loader calls as it builds it;
pipelines/config.py composes them into the pipeline's config.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Literal

from core import storage
from core.config import KEYED_APART, ConfigError, at_least, local_path, no_credentials, positive

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
        no_credentials(self, key, "paths")
        if self.keep_subsets is not None and self.format != "pile":
            raise ConfigError(f"{key}.keep_subsets", f"only for format 'pile', this source is '{self.format}'")
        if self.keep_subsets == []:
            raise ConfigError(f"{key}.keep_subsets", "expected at least one subset (or leave it out for OPT's 8)")
        if self.split != "file" and self.format != "text":
            raise ConfigError(f"{key}.split", f"only for format 'text', this source is '{self.format}'")
        if self.format == "pile" and self.keep_subsets is None:
            self.keep_subsets = list(OPT_PILE_SUBSETS)

    def resolve_paths(self) -> None:
        """Local paths made absolute; URIs kept (core/storage.py says which path may be which)."""
        self.paths = [p if storage.is_uri(p) else storage.local_path(p) for p in self.paths]


@dataclass
class IngestConfig:
    """How raw files become documents (corpus/ingest.py)."""

    on_bad_input: Literal["reject", "fail"] = "reject"  # fail: exit 1 at the first bad line, naming it
    task_mb: int = 256  # files smaller than this are read together in one task, up to this many MB
    # What one reader holds at most (corpus/readers.py's Limits): a longer line, a bigger text file read as one
    # document, or a bigger block of one split at blank lines, is a reject naming the file and byte offset ...
    max_line_mb: int = 64
    max_document_mb: int = 256
    # ... and a compressed file that decompresses beyond this many bytes per byte is a reject (a bomb): text
    # compresses 3-10 to 1; a 2 KB zstd file can hold 64 MiB of zeros.
    max_ratio: float = 1000.0

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "task_mb", "max_line_mb", "max_document_mb")
        at_least(self, key, 10, "max_ratio")


@dataclass
class NormalizeConfig:
    """Each rule can be switched off; corpus/normalize.py says what each does."""

    ftfy: bool = True  # ftfy.fix_text: mojibake, HTML entities, bad unicode
    whitespace: bool = True  # OPT's "ad-hoc whitespace normalization"
    gutenberg: bool = True  # Project Gutenberg licence header and footer
    chapter_headings: bool = True  # lone "Chapter One" lines at the start of a book
    min_chars: int = 1  # shorter documents are dropped, with the reason (empty ones always are)

    def validate(self, key: str) -> None:
        at_least(self, key, 0, "min_chars")


@dataclass
class DecontaminateConfig:
    """What counts as a copy of an evaluation document in training (dedup/decontaminate.py), with settings of its
    own: fixed across dedup ablations, and part of the evaluation set's fingerprint.

    A training document T leaves as `near_eval` when, for some evaluation document E, the word n-grams they share
    are at least `threshold` of the smaller one's: |G(T) & G(E)| / min(|G(T)|, |G(E)|) >= threshold.
    13 words: GPT-3's overlap length (Brown et al. 2020, appendix C), long enough that unrelated texts share
    almost none by chance, so what is shared is copied. 0.5 of the smaller document: a near-copy that dedup's
    rule caught (Jaccard >= 0.7 on 5-word shingles, scattered edits) shares more than half its 13-grams, so this
    removes every such copy whatever dedup.threshold is, and also what dedup's Jaccard cannot see: an evaluation
    document inside a longer training one, or a training document that is a piece of one (Paloma's concern,
    Magnusson et al. 2023); a few quoted sentences or shared boilerplate in long documents stay well below it."""

    ngram: int = 13  # words per n-gram
    threshold: float = 0.5  # of the smaller document's distinct n-grams, shared with one evaluation document

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "ngram")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"{key}.threshold", f"expected a fraction of n-grams in (0, 1], got {self.threshold}")


@dataclass
class DownstreamConfig:
    """Downstream tasks through lm-evaluation-harness (train/downstream/): each seed's exported model scored on
    `tasks`, zero-shot by default as OPT's were, by the downstream stage after train.

    `tasks` are lm-eval's names (a task, group or tag: `lm_eval --tasks list`) or ours (corpus/lm_eval_tasks/:
    `heldout_continuation`, made offline from this evaluation set). A name neither knows is refused at load
    (corpus/lm_eval_names.py, which reads them without importing lm-eval)."""

    tasks: list[str] = field(default_factory=list)  # none: the stage evaluates nothing
    limit: int | None = None  # examples per task at most (lm-eval's first ones; ours are shuffled): None for all
    num_fewshot: int = 0
    batch_size: int = 16
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: the model's, as exported
    gpus: float = 0  # of the evaluation's Ray task (the seeds go one after another); over 1: each model split over them
    cpus: float = 1  # of that task, and torch's threads
    seed: int = 0  # heldout_continuation's draw, and lm-eval's generators

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "limit", "batch_size")
        at_least(self, key, 0, "num_fewshot", "gpus")
        positive(self, key, "cpus")
        for i, name in enumerate(self.tasks):
            if name in self.tasks[:i]:
                raise ConfigError(f"{key}.tasks[{i}]", f"{name!r} is listed twice")
        from corpus import lm_eval_names as names

        if unknown := names.unknown(self.tasks):
            i = self.tasks.index(unknown[0])
            version = names.lm_eval_version()
            raise ConfigError(f"{key}.tasks[{i}]", f"unknown task {unknown[0]!r}: neither ours ({', '.join(names.ours())})"
                              + (f" nor a task, group or tag of lm-eval {version} (`lm_eval --tasks list`)" if version
                                 else " and lm-eval is not installed"))


@dataclass
class EvalConfig:
    """The held-out evaluation set (corpus/evalset.py): drawn at normalize, before dedup and the screen, so that
    every data ablation is evaluated on the same documents; and what is removed from training as its copies
    (`decontaminate`, in the dedup stage's first phase)."""

    fraction: float = 0.0025  # of each source's (and so each subset's) documents; OPT held out ~200 MB of ~800 GB
    seed: int = 0  # the draw is a seeded hash of (source, id): a document is in or out whatever else changes
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    # after training: the downstream stage's section alone (KEYED_APART), so that a new task list reruns only it
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig, metadata={KEYED_APART: True})

    def validate(self, key: str) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ConfigError(f"{key}.fraction", f"expected a fraction in [0, 1), got {self.fraction}")

    def identity(self) -> int:
        """What the evaluation set's fingerprint adds to its documents' hashes (corpus/normalize.py): the
        decontamination settings, so that runs whose training was decontaminated differently are not compared."""
        d = self.decontaminate
        settings = f"eval.decontaminate\0ngram={d.ngram}\0threshold={float(d.threshold)!r}"
        return int.from_bytes(hashlib.sha256(settings.encode()).digest(), "big")


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
        at_least(self, key, 260, "vocab_size")  # 256 bytes + 4 specials
        at_least(self, key, 1, "train_bytes")
        if self.kind == "gpt2":
            for name in ("vocab", "merges"):
                if getattr(self, name) is None:
                    raise ConfigError(f"{key}.{name}", "required when kind is 'gpt2' (GPT-2's BPE files)")
        else:
            for name in TOKENIZER_FILES:
                if getattr(self, name) is not None:
                    raise ConfigError(f"{key}.{name}", f"only read when kind is 'gpt2' (kind is {self.kind!r})")

    def resolve_paths(self, key: str) -> None:
        for name in TOKENIZER_FILES:
            path = getattr(self, name)
            setattr(self, name, local_path(path, f"{key}.{name}") if path else None)

    def check_files_exist(self, key: str) -> None:
        for name in TOKENIZER_FILES:
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{key}.{name}", f"file {path!r} does not exist")


@dataclass
class TokenizeConfig:
    seq_len: int = 2048  # OPT; blocks are seq_len + 1 tokens (input and shifted target)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seed: int = 0

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "seq_len")


def source_files(source: SourceConfig) -> list[str]:
    """The files a source reads (paths or URIs, as its globs name them), sorted, each once."""
    return sorted({p for pattern in source.paths for p in storage.expand(pattern)})

"""The corpus stages' config sections (ingest, normalize with the held-out set, tokenize) and OPT's Pile subsets.

Each section is a dataclass with a `validate(key)` that core/config.py's loader calls as it builds it;
pipelines/config.py composes them into the pipeline's config.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Literal

import zstandard

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
    """A short name of letters, digits, `-` or `_`, unique among the sources. Each document's `source` column,
    the per-source metrics and the rows of compare.py's tables carry it."""
    format: Literal["pile", "pushshift", "text", "jsonl"]
    """The reader. `pile`: JSON lines whose `meta.pile_set_name` is the subset. `pushshift`: Reddit's `RC_*`
    (comments) and `RS_*` (submissions) zstd dumps, rebuilt into threads as OPT did. `text`: plain UTF-8 files.
    `jsonl`: JSON lines, plain, `.gz` or `.zst`."""
    paths: list[str]
    """Files or globs to read: local paths, or any URI that pyarrow or fsspec reads (`s3://`, `gs://`, `abfs://`,
    `file://`). Each must match at least one file, which is checked before any stage starts. A URI may not hold
    a user or password."""
    text_field: str = "text"
    """`jsonl` only: the field that holds the document's text."""
    id_field: str | None = None
    """`jsonl` only: the field whose value becomes the document's id, unchanged. `null`: the id is made from the
    file and line."""
    keep_subsets: list[str] | None = None
    """`pile` only: the Pile subsets kept, by `meta.pile_set_name`; the other documents go to `subset_not_kept/`.
    `null`: the 8 subsets OPT kept (Pile-CC, DM Mathematics, Gutenberg (PG-19), HackerNews, OpenSubtitles,
    OpenWebText2, USPTO Backgrounds, Wikipedia (en))."""
    split: Literal["file", "blank_lines"] = "file"
    """`text` only: `file` makes each file one document (BookCorpus, CC-Stories); `blank_lines` makes each block
    between blank lines one, read block by block."""
    zstd_window_log: int | None = None
    """The largest zstd window this source's `.zst` files may use, as log2 bytes (10 to 31): the memory a reader
    holds per file. A frame that needs more is a reject naming this key. `null`: 31 (2 GiB) for `pushshift`, whose
    dumps are written with `zstd --long=31`; 27 (128 MiB) for the others, libzstd's own limit without `--long`."""

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
        low, high = zstandard.WINDOWLOG_MIN, zstandard.WINDOWLOG_MAX
        if self.zstd_window_log is not None and not low <= self.zstd_window_log <= high:
            raise ConfigError(f"{key}.zstd_window_log", f"expected a zstd window's log2 size, {low} (1 KiB) to {high} "
                              f"(2 GiB), got {self.zstd_window_log}")
        if self.format == "pile" and self.keep_subsets is None:
            self.keep_subsets = list(OPT_PILE_SUBSETS)

    def resolve_paths(self) -> None:
        """Local paths made absolute; URIs kept (core/storage.py says which path may be which)."""
        self.paths = [p if storage.is_uri(p) else storage.local_path(p) for p in self.paths]


@dataclass
class IngestConfig:
    """How raw files become documents (corpus/ingest.py)."""

    on_bad_input: Literal["reject", "fail"] = "reject"
    """What a bad record does (malformed JSON, no text field, invalid UTF-8, a truncated `.zst` or `.gz`).
    `reject`: it goes to `rejects/` with its file, line, byte offset and reason, and the read goes on. `fail`: the
    stage stops at the first one (exit 1), naming it."""
    task_mb: int = 256
    """The most input, in MB, that one ingest task reads: small files are packed together up to it (fewer when
    cores would otherwise idle). A file is never split, so a bigger one is a task of its own."""
    max_line_mb: int = 64
    """The longest line, in MB, that a reader holds. A longer line is a reject naming its file and byte offset,
    so a broken file cannot exhaust a worker's memory."""
    max_document_mb: int = 256
    """The biggest document, in MB: a `text` file read as one document, or one blank-line block, over this is a
    reject naming its file and byte offset. The blocks after it are still read."""
    max_ratio: float = 1000.0
    """The most bytes a compressed file may decompress to per compressed byte; a file past it is a reject (a
    decompression bomb). Judged over its recent output (about 125 MiB at 1000), not the whole file, so an
    incompressible start buys no room for a bomb after it. Text compresses about 3 to 10 to 1, so the default stops
    only bombs. At least 10."""

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "task_mb", "max_line_mb", "max_document_mb")
        at_least(self, key, 10, "max_ratio")


@dataclass
class NormalizeConfig:
    """Each rule can be switched off; corpus/normalize.py says what each does."""

    ftfy: bool = True
    """Repair mojibake, HTML entities and bad Unicode with ftfy's `fix_text`."""
    whitespace: bool = True
    """OPT's whitespace normalization: CRLF and CR become LF, other whitespace runs within a line one space,
    trailing spaces go, three or more newlines become two, and the document is stripped."""
    gutenberg: bool = True
    """Remove the Project Gutenberg licence header and footer, when both of their markers are there."""
    chapter_headings: bool = True
    """Remove lone chapter headings ("Chapter One", "CHAPTER IV.") at the start of a book."""
    min_chars: int = 1
    """Documents shorter than this many characters go to `dropped/` with the reason. Empty documents are always
    dropped."""

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

    ngram: int = 13
    """Words per n-gram. 13 is GPT-3's overlap length: long enough that unrelated texts share almost none by
    chance, so a shared one was copied."""
    threshold: float = 0.5
    """The share of the smaller document's distinct n-grams, in (0, 1], that a training document must share with
    one evaluation document to be removed as `near_eval`. At 0.5 every near-copy that dedup would catch goes,
    and so does an evaluation document inside a longer training one."""

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

    tasks: list[str] = field(default_factory=list)
    """The tasks each seed's exported model is scored on: lm-evaluation-harness names (a task, group or tag:
    `lm_eval --tasks list`) or ours (`heldout_continuation`, made offline from the evaluation set). An unknown name
    is refused at load. `[]`: the stage evaluates nothing."""
    limit: int | None = None
    """The most examples per task: lm-eval's first ones (ours are shuffled first). `null`: every example."""
    num_fewshot: int = 0
    """Examples shown before each question. 0 (zero-shot) is how OPT was evaluated."""
    batch_size: int = 16
    """Examples per forward pass of the evaluation."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """The dtype the model is loaded in for evaluation. `auto`: the dtype it was exported in."""
    gpus: float = 0
    """GPUs of the evaluation's Ray task (the seeds are evaluated one after another). Over 1, each model is split
    over them. 0: on CPU."""
    cpus: float = 1
    """CPUs of the evaluation's Ray task, and torch's threads in it."""
    seed: int = 0
    """The seed of `heldout_continuation`'s draw and of lm-eval's random generators."""

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

    fraction: float = 0.0025
    """The share of each source's documents (and so of each subset's) held out, in [0, 1). They leave the training
    corpus. A change makes another evaluation set, and compare.py refuses to compare runs evaluated on different
    sets."""
    seed: int = 0
    """The seed of the draw, a seeded hash of each document's (source, id): a document is in the set or not
    whatever any other setting does."""
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    """What counts as a copy of an evaluation document in training. Such copies are removed in the dedup stage's
    first phase, with settings of their own, so that every dedup ablation removes the same documents. Part of the
    evaluation set's fingerprint."""
    # The downstream stage's section alone (KEYED_APART): left out of `eval` as normalize and dedup key on it.
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig, metadata={KEYED_APART: True})
    """Downstream tasks through lm-evaluation-harness, run by the downstream stage after train. Its own section:
    a change reruns only that stage, not normalize, dedup or training."""

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
    """A tokenizer in OPT's layout: ids 0-3 are `<s>`, `<pad>`, `</s>`, `<unk>`, and the vocabulary is padded to a
    multiple of 8."""

    kind: Literal["train", "gpt2"] = "train"
    """`train`: a byte-level BPE trained on a seeded sample of the corpus, so nothing is downloaded. `gpt2`: GPT-2's
    BPE read from `vocab` and `merges`, as OPT used."""
    vocab_size: int = 50272
    """`train` only: the most ids the trained BPE has (a small corpus may give fewer). 50272 is OPT's padded
    vocabulary. At least 260 (256 bytes and 4 specials)."""
    vocab: str | None = None
    """`gpt2` only, required there: the path of GPT-2's `vocab.json`, or of OPT's released one."""
    merges: str | None = None
    """`gpt2` only, required there: the path of GPT-2's `merges.txt`."""
    fairseq_dict: str | None = None
    """`gpt2` only: the path of fairseq's `dict.txt`, which maps GPT-2's own `vocab.json` to OPT's exact ids.
    Without it, GPT-2's ids are shifted by 4: OPT's segmentation, but not the released checkpoints' ids."""
    train_bytes: int = 1 << 30
    """`train` only: the bytes of text the BPE is trained on, sampled from the corpus (seeded row groups from every
    source). The default is 1 GiB."""

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
    """The tokenize stage: documents to OPT's training sequences (corpus/tokenize.py)."""

    seq_len: int = 2048
    """Tokens per training sequence, and so the training stage's context length; 2048 is OPT's. Rows hold
    `seq_len + 1` tokens (the inputs and the shifted targets)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer of the training data and of the evaluation set. With `kind: train` it is trained on
    normalize's output, before dedup and the screen, so that their ablations all get the same tokenizer."""
    seed: int = 0
    """The seed of the document order (a seeded hash of each document's source and id) and of the tokenizer's
    training sample. The order depends on it alone, not on the number of CPUs."""

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "seq_len")


def source_files(source: SourceConfig) -> list[str]:
    """The files a source reads (paths or URIs, as its globs name them), sorted, each once."""
    return sorted({p for pattern in source.paths for p in storage.expand(pattern)})

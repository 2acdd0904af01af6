"""OPT's tokenizer: GPT-2's byte-level BPE in fairseq's dictionary layout, built with HF `tokenizers`.

OPT's ids are not GPT-2's. metaseq encodes with GPT-2's BPE and then looks each GPT-2 id up in
fairseq's `dict.txt`, whose symbols come after four specials: `<s>`=0, `<pad>`=1, `</s>`=2,
`<unk>`=3, then the dictionary's lines in order (so "." is 4, not GPT-2's 13). The released
`vocab.json` of the OPT checkpoints has that layout already. Three ways in, one layout out:

- `kind: gpt2` with a vocab.json already in OPT's layout (OPT's or RoBERTa's released files):
  used as is; these are OPT's ids exactly.
- `kind: gpt2` with GPT-2's own vocab.json plus fairseq's dict.txt (`tokenizer.fairseq_dict`):
  remapped through the dictionary, exactly as metaseq does.
- `kind: gpt2` with GPT-2's own vocab.json and no dictionary: the specials, then GPT-2's tokens
  in GPT-2's order (id + 4). Same segmentation as OPT, different ids: fine for training from
  scratch, not for continuing from the released OPT weights (a warning says so).
- `kind: train`: a byte-level BPE trained on the corpus (nothing to download), same specials.

Documents are encoded with `encode_special_tokens` on: a document that contains the text
"</s>" gets the bytes of "</s>", not an end-of-document marker in the middle of itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = 0, 1, 2, 3
GPT2_EOS = "<|endoftext|>"  # GPT-2's only special; OPT ends documents with </s> instead
FILE = "tokenizer.json"


def _byte_level(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2/OPT: no prefix space
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids (fewer when the corpus has fewer merges)."""
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text round-trips
    )
    tok.train_from_iterator(texts, trainer)
    return _for_documents(tok)


def from_gpt2_files(vocab_path: str, merges_path: str, fairseq_dict: str | None = None) -> Tokenizer:
    """GPT-2's (or OPT's) vocab.json + merges.txt, in OPT's id layout (see the module docstring)."""
    vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    if not isinstance(vocab, dict):
        raise ValueError(f"{vocab_path}: expected a JSON object of token -> id")
    merges = read_merges(merges_path)
    lines = Path(fairseq_dict).read_text(encoding="utf-8").splitlines() if fairseq_dict else None
    tok = _byte_level(models.BPE(vocab=opt_vocab(vocab, lines, vocab_path), merges=merges))
    tok.add_special_tokens(list(SPECIALS))
    return _for_documents(tok)


def read_merges(path: str) -> list[tuple[str, str]]:
    merges = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{path}:{number}: expected two symbols separated by one space, got {line!r}")
        merges.append((pair[0], pair[1]))
    return merges


def opt_vocab(vocab: dict[str, int], dict_lines: list[str] | None, where: str = "vocab") -> dict[str, int]:
    """token -> OPT id, from a vocab in OPT's layout, or GPT-2's plus fairseq's dict.txt, or GPT-2's alone."""
    if all(vocab.get(s) == i for i, s in enumerate(SPECIALS)):
        return dict(vocab)  # OPT's (RoBERTa's) released vocab.json: already fairseq's layout
    if any(s in vocab for s in SPECIALS):
        found = {s: vocab[s] for s in SPECIALS if s in vocab}
        raise ValueError(f"{where}: has OPT's special tokens at other ids than 0-3: {found}")
    by_gpt2_id = {i: t for t, i in vocab.items() if t != GPT2_EOS}
    out = {s: i for i, s in enumerate(SPECIALS)}
    if dict_lines is None:
        log.warning("%s: GPT-2 ids shifted by 4 after OPT's specials (no fairseq dict.txt given): the "
                    "segmentation is OPT's, the ids are not those of the released OPT checkpoints", where)
        for gpt2_id in sorted(by_gpt2_id):
            out[by_gpt2_id[gpt2_id]] = len(out)
        return out
    for number, line in enumerate(dict_lines, 1):
        symbol = line.split(" ")[0]
        if not symbol:
            raise ValueError(f"fairseq dict line {number}: empty symbol in {line!r}")
        # A GPT-2 id names its token; anything else (madeupword0000) is a symbol of its own.
        token = by_gpt2_id.get(int(symbol), symbol) if symbol.isdigit() else symbol
        if token in out:
            raise ValueError(f"fairseq dict line {number}: {symbol!r} appears twice")
        out[token] = len(out)
    missing = sorted(set(by_gpt2_id.values()) - set(out))
    if missing:
        raise ValueError(f"fairseq dict: {len(missing)} GPT-2 tokens have no entry (first: {missing[:3]})")
    return out


def _for_documents(tok: Tokenizer) -> Tokenizer:
    check_layout(tok)
    tok.encode_special_tokens = True  # "</s>" in a text is text; not saved in tokenizer.json, so set on load too
    return tok


def check_layout(tok: Tokenizer) -> None:
    for i, special in enumerate(SPECIALS):
        if tok.token_to_id(special) != i:
            raise ValueError(f"tokenizer: {special!r} has id {tok.token_to_id(special)}, OPT's layout needs {i}")


def padded_vocab_size(tok: Tokenizer) -> int:
    """The embedding rows a model needs: the vocabulary rounded up to a multiple of 8 (OPT: 50272)."""
    return -(-tok.get_vocab_size() // 8) * 8


def fingerprint(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:12]


def save(tok: Tokenizer, folder: str | Path) -> Path:
    """tokenizer.json plus the config `transformers.AutoTokenizer` needs to load it as OPT's."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / FILE))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True}, indent=2) + "\n")
    return folder / FILE


@functools.lru_cache(maxsize=4)
def load(path: str) -> Tokenizer:
    """A saved tokenizer, set up for encoding documents; cached per process (Ray workers reuse it)."""
    return _for_documents(Tokenizer.from_file(path))


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """OPT's document encoding: `encode(text.rstrip()) + [</s>]`."""
    return [e.ids + [EOS] for e in tok.encode_batch([t.rstrip() for t in texts], add_special_tokens=False)]

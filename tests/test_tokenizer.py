"""OPT's tokenizer: the id layout, GPT-2's files mapped the way OPT maps them, byte-exact round trips."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corpus import tokenizer
from corpus.tokenizer import BOS, EOS, PAD, SPECIALS, UNK

# A hand-made GPT-2 pair: the 256 byte symbols in GPT-2's order, five merges, <|endoftext|> last.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (printable bytes first, then the rest shifted to 256+)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    order = printable + [b for b in range(256) if b not in printable]
    return {b: table[b] for b in order}


def write_gpt2_files(folder, vocab: dict[str, int] | None = None):
    if vocab is None:
        vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
        for a, b in MERGES:
            vocab[a + b] = len(vocab)
        vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return vocab, str(folder / "vocab.json"), str(folder / "merges.txt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    texts = [f"The {w} of document {i} is the thing in the {w}: naïve café, 東京, emoji 🙂 #{i}."
             for i in range(300) for w in ("theme", "thing", "weather")]
    folder = tmp_path_factory.mktemp("tok")
    tokenizer.save(tokenizer.train(texts, vocab_size=400), folder)
    return tokenizer.load(str(folder / tokenizer.FILE))


def test_trained_tokenizer_has_opt_specials_and_learns_merges(trained):
    assert [trained.token_to_id(s) for s in SPECIALS] == [BOS, PAD, EOS, UNK] == [0, 1, 2, 3]
    assert 300 < trained.get_vocab_size() <= 400  # 256 bytes + 4 specials + merges learned from the texts
    assert len(trained.encode("The thing in the weather").ids) < len("The thing in the weather") / 2


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_byte_level_round_trip_on_any_unicode(trained, text):
    assert trained.decode(trained.encode(text).ids) == text


def test_document_encoding_is_opt_s(trained):
    # encode(text.rstrip()) + [</s>]; a literal "</s>" in a document is text, not an end marker.
    docs = ["Hello world  \n\n", "a </s> b", ""]
    encoded = tokenizer.encode_documents(trained, docs)
    assert encoded[0] == trained.encode("Hello world").ids + [EOS]
    assert [ids.count(EOS) for ids in encoded] == [1, 1, 1] and all(ids[-1] == EOS for ids in encoded)
    assert trained.decode(encoded[1][:-1]) == "a </s> b"
    assert encoded[2] == [EOS]


def test_gpt2_files_load_with_opt_ids_and_gpt2_segmentation(tmp_path):
    from transformers import GPT2Tokenizer

    gpt2_vocab, vocab, merges = write_gpt2_files(tmp_path)
    tok = tokenizer.from_gpt2_files(vocab, merges)
    assert [tok.id_to_token(i) for i in range(4)] == list(SPECIALS)
    assert tok.token_to_id("<|endoftext|>") is None  # OPT ends documents with </s> (id 2) instead
    assert tok.get_vocab_size() == len(gpt2_vocab) - 1 + 4
    reference = GPT2Tokenizer.from_pretrained(tmp_path)  # how the OPT checkpoints' vocab.json/merges.txt load
    for text in ["the theme in the attic", " tin\tthe\n\nthe", "naïve thé 🙂", "a</s>b"]:
        ours = tok.encode(text, add_special_tokens=False)
        assert ours.tokens == reference.tokenize(text)
        assert ours.ids == [gpt2_vocab[t] + 4 for t in reference.tokenize(text)]
    assert "Ġthe" in tok.encode(" the").tokens  # the merges are applied


def test_fairseq_dict_gives_opt_s_permutation(tmp_path):
    gpt2_vocab, vocab, merges = write_gpt2_files(tmp_path)
    # fairseq's dict.txt lists GPT-2 ids by corpus frequency; OPT's id is 4 + the line number.
    order = sorted((i for t, i in gpt2_vocab.items() if t != "<|endoftext|>"), key=lambda i: (i * 7919) % 263)
    (tmp_path / "dict.txt").write_text("".join(f"{i} {1000 - n}\n" for n, i in enumerate(order)) + "madeupword0000 0\n")
    tok = tokenizer.from_gpt2_files(vocab, merges, str(tmp_path / "dict.txt"))
    by_id = {i: t for t, i in gpt2_vocab.items()}
    for line, gpt2_id in enumerate(order):
        assert tok.token_to_id(by_id[gpt2_id]) == 4 + line
    assert tok.token_to_id("madeupword0000") == 4 + len(order)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
    # A dictionary that misses a GPT-2 token is an error, not a silently unknown token.
    (tmp_path / "short.txt").write_text("".join(f"{i} 1\n" for i in order[:-1]))
    with pytest.raises(ValueError, match="1 GPT-2 tokens have no entry"):
        tokenizer.from_gpt2_files(vocab, merges, str(tmp_path / "short.txt"))


def test_vocab_already_in_opt_layout_is_used_as_is(tmp_path):
    gpt2_vocab, _, _ = write_gpt2_files(tmp_path)
    opt = {**{s: i for i, s in enumerate(SPECIALS)}, **{t: i + 4 for t, i in gpt2_vocab.items() if t != "<|endoftext|>"}}
    opt = {t: (i if i < 4 else 4 + (i - 4 + 17) % (len(opt) - 4)) for t, i in opt.items()}  # any order after the specials
    _, vocab, merges = write_gpt2_files(tmp_path, opt)
    tok = tokenizer.from_gpt2_files(vocab, merges)
    assert tok.get_vocab() == opt
    wrong = {**opt, "<s>": opt["!"], "!": 0}
    _, vocab, merges = write_gpt2_files(tmp_path, wrong)
    with pytest.raises(ValueError, match="special tokens at other ids"):
        tokenizer.from_gpt2_files(vocab, merges)


def test_padded_vocab_size_is_opt_s():
    class Sized:
        def __init__(self, n):
            self.n = n

        def get_vocab_size(self):
            return self.n

    assert tokenizer.padded_vocab_size(Sized(50265)) == 50272  # OPT's released vocabulary
    assert tokenizer.padded_vocab_size(Sized(2384)) == 2384


def test_bad_merges_line_is_named(tmp_path):
    _, vocab, merges = write_gpt2_files(tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nh e x\n")
    with pytest.raises(ValueError, match=r"merges.txt:3: expected two symbols"):
        tokenizer.from_gpt2_files(vocab, merges)

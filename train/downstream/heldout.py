"""`heldout_continuation`: a multiple-choice task made offline from the held-out evaluation set (corpus/evalset.py).

An example is a place in an evaluation document: its CONTEXT_CHARS characters before the place are the context, and
the choices are the document's next CONTINUATION_CHARS characters (the answer) and CHOICES - 1 spans as long from
other evaluation documents (the distractors). The places are every STRIDE characters from CONTEXT_CHARS on, at most
PER_DOCUMENT of them in a document, so that long books do not make up the task. A place falls inside a word as often
as not, and the choice follows the context with nothing between them (`target_delimiter: ""`): the answer finishes the
word, which even the laptop's tiny model learns to tell, as well as what follows it, which takes a better one. Every
choice has the same number of characters, so `acc` (the choice of highest log-likelihood) and `acc_norm` (per
character) rank them alike: no choice wins by being shorter. Chance is 1 / CHOICES.

The draw is seeded (`eval.downstream.seed`) and depends only on the set's documents: the examples are listed by
(source, id, place) first, then shuffled into the file's order (so that `eval.downstream.limit`, which takes the
first ones, takes every source), each one's distractors drawn from the other documents' spans, never one with the
answer's text or a repeated one, and the answer put at a drawn place among them. The same set and seed give the same
file, byte for byte.

Like the set itself it needs no network and no data of anyone else's; unlike bits per byte it is scored through
lm-evaluation-harness, as the public tasks are, from the Hugging Face export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

NAME = "heldout_continuation"
CONTEXT_CHARS = 120
CONTINUATION_CHARS = 40  # with the context about 50 tokens: within the tiny model's 64-token training windows
STRIDE = CONTEXT_CHARS + CONTINUATION_CHARS  # no two examples of a document share a character
PER_DOCUMENT = 4
CHOICES = 4


def places(text: str) -> list[tuple[str, str]]:
    """(context, continuation) at each place of a document (none when it is shorter than one)."""
    ends = range(CONTEXT_CHARS, len(text) - CONTINUATION_CHARS + 1, STRIDE)
    return [(text[end - CONTEXT_CHARS:end], text[end:end + CONTINUATION_CHARS]) for end in ends][:PER_DOCUMENT]


def examples(documents: Iterable[tuple[str, str, str]], seed: int) -> list[dict]:
    """(source, id, text) of the evaluation set -> the task's examples, in the file's order."""
    found = sorted((source, doc_id, i, *cut) for source, doc_id, text in documents
                   for i, cut in enumerate(places(text)))
    if len({f[:2] for f in found}) < CHOICES:
        raise ValueError(f"{NAME}: {len({f[:2] for f in found})} documents of the evaluation set have "
                         f"{STRIDE} characters, fewer than the {CHOICES} choices of one example (a larger "
                         "eval.fraction, or leave the task out of eval.downstream.tasks)")
    rng = np.random.default_rng([seed, CHOICES])
    out = []
    for i in rng.permutation(len(found)):
        source, doc_id, place, context, answer = found[i]
        distractors = _distractors(rng, found, (source, doc_id), answer)
        if len(distractors) < CHOICES - 1:  # the other documents' spans are mostly one text: no honest example
            continue
        label = int(rng.integers(CHOICES))
        out.append({"id": f"{source}/{doc_id}/{place}", "context": context,
                    "choices": distractors[:label] + [answer] + distractors[label:], "label": label})
    return out


def _distractors(rng: np.random.Generator, found: list[tuple], document: tuple[str, str], answer: str,
                 rounds: int = 8) -> list[str]:
    """CHOICES - 1 spans of other documents, each unlike the answer and the others (fewer if the draws keep meeting
    the same text)."""
    picked: list[str] = []
    for _ in range(rounds):
        for j in rng.integers(len(found), size=2 * CHOICES):
            other = found[j]
            if other[:2] != document and other[4] != answer and other[4] not in picked:
                picked.append(other[4])
                if len(picked) == CHOICES - 1:
                    return picked
    return picked


def write(documents: Iterable[tuple[str, str, str]], seed: int, path: Path) -> int:
    """The task's data as JSON lines at `path`; the number of examples."""
    rows = examples(documents, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return len(rows)

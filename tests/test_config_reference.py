"""docs/config.md, the config reference: every field documented, the page current, what a change reruns derived
from the stages. Nothing here starts Ray: the stages are read as declarations, never run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from conftest import ROOT
from core.config import KEYED_APART
from core.dag import Stage
from pipelines import config_reference as ref
from pipelines.config import PipelineConfig
from pipelines.stages import STAGES
from screen.config import ProxyConfig
from train.config import EngineConfig

ALL = ("ingest", "normalize", "dedup", "screen", "tokenize", "train", "downstream")


def test_every_config_field_has_a_doc():
    """Every field of every dataclass reachable from PipelineConfig (nested, in lists, inherited) has a docstring."""
    missing = ref.missing_docs(PipelineConfig)
    assert missing == [], ("these config keys have no doc; add a docstring on the line after each field "
                           f"(a string literal, as the other fields have): {', '.join(missing)}")


def test_docs_config_md_is_what_the_generator_writes():
    written = ref.OUTPUT.read_text() if ref.OUTPUT.is_file() else ""
    assert written == ref.reference(), (f"{ref.OUTPUT.relative_to(ROOT)} is stale (a config field or its doc "
                                        f"changed): run `{ref.COMMAND}` and commit the result")


def test_the_page_lists_every_shipped_config():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(ref.CONFIGS)


@pytest.mark.parametrize("key, expected", [
    ("sources[].paths", ALL),
    ("ingest.max_ratio", ALL),
    ("normalize.min_chars", ALL[1:]),
    ("eval.fraction", ALL[1:]),  # normalize draws the set; dedup decontaminates against it
    ("eval.decontaminate.ngram", ALL[1:]),
    ("dedup.threshold", ("dedup", "screen", "tokenize", "train", "downstream")),
    ("screen.drop", ("screen", "tokenize", "train", "downstream")),
    ("screen.proxy.zero_stage", ("screen", "tokenize", "train", "downstream")),
    ("train.parallel.pipeline", ()),  # a layout key: the run goes on in the new layout (docs/training.md)
    ("tokenize.tokenizer.kind", ("tokenize", "train", "downstream")),
    ("train.inject[].kind", ("train", "downstream")),
    ("eval.downstream.tasks", ("downstream",)),  # keyed apart from `eval`: not normalize, dedup or train
    ("mlflow.experiment", ()),
    ("ray.num_cpus", ()),
    ("workdir", ()),
    ("name", ()),
])
def test_what_a_change_reruns(key, expected):
    assert ref.reruns(PipelineConfig, STAGES)[key] == expected


def test_every_fingerprinted_key_is_a_documented_key():
    """The keys section_dict puts in the stages' fingerprints are named as the page names them: none is missed."""
    documented = {e.key for e in ref.entries(PipelineConfig) if e.leaf}
    keyed = set().union(*ref.fingerprinted(PipelineConfig, STAGES).values())
    assert keyed and keyed <= documented, sorted(keyed - documented)


# A small config of its own, for the checker and the derivation: documented and undocumented fields, a nested
# section, a list of sections, a base class and a field keyed apart.


@dataclass
class Leaf:
    documented: int = 1
    """Has a doc."""
    bare: int = 2  # a trailing comment is not a doc


@dataclass
class Group:
    size: int = 3
    """A value of the group."""
    apart: Leaf = field(default_factory=Leaf, metadata={KEYED_APART: True})
    """A section of a stage of its own, left out of the group's."""


@dataclass
class Base:
    inherited: float | None = None


@dataclass
class Small(Base):
    mode: Literal["reject", "fail"] = "reject"
    """A choice."""
    inner: Leaf = field(default_factory=Leaf)
    """A section."""
    items: list[Leaf] = field(default_factory=list)
    """A list of sections."""
    group: Group = field(default_factory=Group)
    """A section with one keyed apart inside."""
    blank: str = "x"
    """   """


def test_the_doc_check_names_each_undocumented_field():
    assert ref.missing_docs(Small) == ["inherited", "inner.bare", "items[].bare", "group.apart.bare", "blank"]


def test_a_subclass_doc_wins_and_a_base_doc_is_inherited():
    proxy, engine = ref.field_docs(ProxyConfig), ref.field_docs(EngineConfig)
    assert proxy["num_workers"] != engine["num_workers"] and proxy["model"] == engine["model"]


def test_types_and_defaults_as_a_reader_writes_them():
    rows = {e.key: (e.type, e.default) for e in ref.entries(Small)}
    assert rows["inherited"] == ("float | None", "null")
    assert rows["mode"] == ('"reject" | "fail"', "reject")
    assert rows["items"] == ("list[mapping]", "[]")
    assert rows["items[].documented"] == ("int", "1")
    full = {e.key: (e.type, e.default) for e in ref.entries(PipelineConfig)}
    assert full["sources[].name"] == ("str", "required")
    assert full["screen.drop"] == ("list[str]", "[]")
    assert full["train.health.window_seconds"] == ("float", "21600.0")


def test_reruns_are_derived_through_inputs_and_keyed_apart_sections():
    stages = [Stage("a", (), "inner", run=None), Stage("b", ("a",), ("items", "group"), run=None),
              Stage("c", ("b",), "group.apart", run=None), Stage("d", (), "items", run=None)]
    rerun = ref.reruns(Small, stages)
    assert rerun["inner.documented"] == ("a", "b", "c")  # b reads a, c reads b
    assert rerun["items[].bare"] == ("b", "c", "d")
    assert rerun["group.size"] == ("b", "c")
    assert rerun["group.apart.documented"] == ("c",)  # keyed apart: not b's, though b is keyed on `group`
    assert rerun["mode"] == rerun["blank"] == rerun["inherited"] == ()

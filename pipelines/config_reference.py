"""docs/config.md, generated from the config dataclasses: every key's type, default, meaning and what a change reruns.

    .venv/bin/python -m pipelines.config_reference            # print it
    .venv/bin/python -m pipelines.config_reference --write    # write docs/config.md

A key's meaning is its field's attribute docstring, the string literal on the lines after the field (torchtitan's
style), read with `ast` from each class's source through its base classes (a subclass's doc wins). What a change
reruns is derived from pipelines/stages.py's STAGES, never a list kept by hand: the stages whose fingerprinted
section holds the key, as core/config.py's `section_dict` builds it (so a KEYED_APART field counts only for its own
stage), and every stage that reads one of them, transitively. tests/test_config_reference.py fails on a field
without a doc and on a docs/config.md that differs from what this module writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import yaml

from core.config import KEYED_APART, LAYOUT, section_dict
from core.dag import Stage

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "config.md"
COMMAND = ".venv/bin/python -m pipelines.config_reference --write"
NOTHING = "nothing (not in any stage's fingerprint)"
LAID_OUT = "nothing: a layout key, how the stage runs and not what it computes"  # core/config.py LAYOUT

# The configs shipped in configs/, in the order the page lists them (the test checks that it is every one).
CONFIGS = {
    "local.yaml": "The default: the generated sample corpus, a tiny model on 2 CPU workers, Ray in-process, MLflow "
                  "in SQLite under the workdir.",
    "opt-125m.yaml": "OPT-125M on a GPU cluster: 8 workers, one per GPU, ZeRO-1, fp16.",
    "opt-1.3b.yaml": "OPT-1.3B on 64 GPUs: tensor 4 x data 16, ZeRO-2, fp16.",
    "opt-175b.yaml": "OPT-175B on 992 GPUs: tensor 8 x pipeline 4 x data 31, ZeRO-1, fp16.",
}


@dataclass(frozen=True)
class Entry:
    """One key of the config: a value (`leaf`) or a mapping or list of mappings, documented by the keys under it."""

    key: str  # dotted; the keys of a list's entries as `[]`: "sources[].name", "train.inject[].kind"
    type: str  # readable: "int", "float | None", "list[str]", '"reject" | "fail"'
    default: str  # as YAML shows it; "required" for a field without one
    doc: str  # the field's docstring, one paragraph ("" when it has none)
    leaf: bool
    depth: int  # 0 for a key of PipelineConfig itself
    keyed_apart: bool = False  # a section of its own stage, left out of its parent's (core/config.py: KEYED_APART)
    layout: bool = False  # how the stage is laid out, not what it computes: in no fingerprint (core/config.py: LAYOUT)


# --------------------------------------------------------------------------- the fields and their docs


def own_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of the fields declared in `cls`'s own body: each string literal right after a field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    docs = {}
    for field_node, after in zip(node.body, node.body[1:]):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field_node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of every field of a dataclass, base classes first, so that a subclass's doc wins."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(own_docs(klass))
    return docs


def without_none(tp: Any) -> Any:
    """`X | None` as X; any other type as it is."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else tp


def section_type(tp: Any) -> tuple[type | None, bool]:
    """(the dataclass a field holds, whether it holds a list of them), or (None, False) for a value."""
    tp = without_none(tp)
    if dataclasses.is_dataclass(tp):
        return tp, False
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0], True
    return None, False


def entries(cls: type, prefix: str = "", depth: int = 0, laid_out: bool = False) -> Iterator[Entry]:
    """Every key of `cls`, in field order, each section followed by the keys under it (depth first). A section
    marked LAYOUT makes every key under it one (`laid_out`), as the fingerprint leaves it out whole."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        inner, is_list = section_type(hints[f.name])
        layout = laid_out or bool(f.metadata.get(LAYOUT))
        yield Entry(key, type_name(hints[f.name]), default_text(f), docs.get(f.name, ""), inner is None, depth,
                    bool(f.metadata.get(KEYED_APART)), layout)
        if inner is not None:
            yield from entries(inner, key + ("[]." if is_list else "."), depth + 1, layout)


def missing_docs(cls: type) -> list[str]:
    """The dotted key of every field of `cls`, nested and inherited ones included, that has no docstring."""
    return [e.key for e in entries(cls) if not e.doc.strip()]


def type_name(tp: Any) -> str:
    """A type as a reader writes it: `int`, `float | None`, `list[str]`, `"reject" | "fail"`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return "list[mapping]" if dataclasses.is_dataclass(item) else f"list[{type_name(item)}]"
    if tp is type(None):
        return "None"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def default_text(f: dataclasses.Field) -> str:
    """The field's default as YAML shows it (a default_factory's value too), or "required"."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return "" if dataclasses.is_dataclass(value) else yaml_text(value)


def yaml_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if yaml.safe_load(value) == value and value.strip() == value and value else json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return repr(value)


# --------------------------------------------------------------------------- what a change reruns


def example(cls: type) -> Any:
    """An instance of `cls` with every list of sections holding one entry and every required value a placeholder,
    so that section_dict shows every key (no validation runs: it is never loaded)."""
    hints, kwargs = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        inner, is_list = section_type(hints[f.name])
        if inner is not None:
            kwargs[f.name] = [example(inner)] if is_list else example(inner)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = placeholder(without_none(hints[f.name]))
    return cls(**kwargs)


def placeholder(tp: Any) -> Any:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)[0]
    if typing.get_origin(tp) is list:
        return []
    return tp() if tp in (str, int, float, bool) else None


def flat_keys(value: Any, prefix: str) -> Iterator[str]:
    """The dotted keys of a section's plain data (section_dict's), a list of mappings' as `[]`."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flat_keys(v, f"{prefix}.{k}")
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for v in value:
            yield from flat_keys(v, prefix + "[]")
    else:
        yield prefix


def fingerprinted(schema: type, stages: Sequence[Stage]) -> dict[str, set[str]]:
    """{stage: the keys its fingerprint holds}: what section_dict gives of each of its sections."""
    config = example(schema)
    out = {}
    for stage in stages:
        out[stage.name] = {key for name in section_names(stage) for key in flat_keys(section_dict(config, name), name)}
    return out


def reruns(schema: type, stages: Sequence[Stage]) -> dict[str, tuple[str, ...]]:
    """{key: the stages a change of it reruns, in DAG order}, for every value key of `schema`: the stages whose
    fingerprint holds it, and every stage that reads one of those, transitively through `inputs`."""
    keyed = fingerprinted(schema, stages)
    out = {}
    for entry in entries(schema):
        if not entry.leaf:
            continue
        hit: set[str] = set()
        for stage in stages:  # DAG order: a stage's inputs come before it
            if entry.key in keyed[stage.name] or hit.intersection(stage.inputs):
                hit.add(stage.name)
        out[entry.key] = tuple(s.name for s in stages if s.name in hit)
    return out


# --------------------------------------------------------------------------- the page


def cell(text: str) -> str:
    """Text for a Markdown table cell: one line, its pipes escaped (GitHub reads `\\|` inside code spans too)."""
    return " ".join(text.split()).replace("|", "\\|")


def table(rows: list[Entry], rerun: dict[str, tuple[str, ...]]) -> list[str]:
    lines = ["| Key | Type | Default | A change reruns | Meaning |", "|---|---|---|---|---|"]
    for e in rows:
        stages = ", ".join(rerun[e.key]) or (LAID_OUT if e.layout else NOTHING)
        default = e.default if e.default == "required" else f"`{e.default}`"
        lines.append(f"| `{e.key}` | `{cell(e.type)}` | {cell(default)} | {stages} | {cell(e.doc)} |")
    return lines + [""]


def section_pages(all_entries: list[Entry], rerun: dict[str, tuple[str, ...]]) -> list[str]:
    """A heading per section (nested ones under their parent's table), its doc, and a table of its value keys."""
    lines: list[str] = []
    for i, e in enumerate(all_entries):
        if e.leaf:
            continue
        level = "#" * min(2 + e.depth, 4)
        under = e.key + ("[]." if e.type == "list[mapping]" else ".")
        rows = [x for x in all_entries[i + 1:] if x.leaf and x.key.startswith(under) and x.depth == e.depth + 1]
        lines += [f"{level} `{e.key}`", "", e.doc, ""]
        if e.type == "list[mapping]":
            what = "Required" if e.default == "required" else f"Default: `{e.default}`"
            lines += [f"A list; each entry has the keys below, written `{e.key}[].<key>` here and set by index "
                      f"(`{e.key}.0.<key>`). {what}.", ""]
        lines += table(rows, rerun) if rows else []
    return lines


def stage_table(stages: Sequence[Stage]) -> list[str]:
    lines = ["| Stage | Reads the output of | Fingerprinted on |", "|---|---|---|"]
    for s in stages:
        lines.append(f"| {s.name} | {', '.join(s.inputs) or 'the raw files'} | "
                     f"{', '.join(f'`{name}`' for name in section_names(s))} |")
    return lines + [""]


def idle_keys(all_entries: list[Entry], rerun: dict[str, tuple[str, ...]]) -> list[str]:
    """The top-level keys and sections (`ray.*`) a change of which reruns nothing, in field order."""
    out = []
    for e in (x for x in all_entries if x.depth == 0):
        prefix = e.key + ("[]." if e.type == "list[mapping]" else ".")
        under = [x for x in all_entries if x.leaf and (x.key == e.key or x.key.startswith(prefix))]
        if all(not rerun[x.key] for x in under):
            out.append(f"`{e.key}`" if e.leaf else f"`{e.key}.*`")
    return out


def section_names(stage: Stage) -> tuple[str, ...]:
    return stage.section if isinstance(stage.section, tuple) else (stage.section,)


def apart_lines(all_entries: list[Entry], stages: Sequence[Stage]) -> list[str]:
    """A line for each section keyed apart from its parent: which stages' fingerprints leave it out."""
    lines = []
    for e in (x for x in all_entries if x.keyed_apart):
        parent = e.key.rsplit(".", 1)[0]
        keyed = [s.name for s in stages if parent in section_names(s)]
        lines.append(f"`{e.key}` is a section of its own: it is not part of the `{parent}` that "
                     f"{' and '.join(keyed) or 'no stage'} {'is' if len(keyed) == 1 else 'are'} fingerprinted on.")
    return lines


def intro(stages: Sequence[Stage], idle: list[str], apart: list[str]) -> list[str]:
    return [
        "# Config reference", "",
        f"<!-- Generated from the config dataclasses by pipelines/config_reference.py; do not edit by hand. "
        f"Run `{COMMAND}` after changing a config field or its doc. -->", "",
        "Every key of the pipeline's config: its type, its default, what it means, and which stages a change "
        "reruns. Each key's meaning is the docstring under its field in the code, so the two cannot drift apart.", "",
        "## Setting keys", "",
        "A run reads one YAML file (`--config`, default `configs/local.yaml`); a key the file leaves out takes the "
        "default below. `--set dotted.key=value` overrides any key, its value typed by the key's field; a list's "
        "entries are set by index. `--workdir DIR` is the same as `--set workdir=DIR`.", "",
        "```sh",
        ".venv/bin/python pipelines/full.py --set dedup.threshold=0.9",
        ".venv/bin/python pipelines/full.py --set 'screen.drop=[DM Mathematics]' --ablation no-math",
        ".venv/bin/python pipelines/full.py --set 'sources.0.keep_subsets=[Pile-CC, HackerNews]'",
        "```", "",
        "Every value is checked at load, before anything runs. An unknown key, a wrong type, a value out of range or "
        "a path that matches no file exits with code 2 and one line naming the key:", "",
        "```text",
        "error: config key 'dedup.threshold': expected a Jaccard similarity in (0, 1], got 1.5",
        "```", "",
        "`null` in YAML is Python's `None`: a key typed `int | None` takes a number or `null`. A relative path is "
        "resolved against the directory the command runs in.", "",
        "The configs in `configs/`:", "",
        "| Config | What it runs |", "|---|---|",
        *[f"| `configs/{name}` | {text} |" for name, text in CONFIGS.items()], "",
        "## What a change reruns", "",
        "Each stage's [fingerprint](glossary.md#fingerprint) is a hash of its config sections, its code and its "
        "inputs' fingerprints; ingest's also holds each raw file's path, size and modification time, screen's and "
        "tokenize's their tokenizer files', downstream's the lm-eval version and our task files. A change of a key "
        "reruns the stages fingerprinted on it and every stage after them; "
        f"the others are cache hits. A key in no stage's fingerprint ({', '.join(idle)}) reruns nothing. The "
        "column \"A change reruns\" below is derived from these declarations in `pipelines/stages.py`:", "",
        *stage_table(stages),
        *[line for text in apart for line in (text, "")],
    ]


def render(schema: type, stages: Sequence[Stage]) -> str:
    """The whole page: the intro, the top-level value keys, then a section per top-level section in field order."""
    all_entries = list(entries(schema))
    rerun = reruns(schema, stages)
    top = [e for e in all_entries if e.leaf and e.depth == 0]
    lines = intro(stages, idle_keys(all_entries, rerun), apart_lines(all_entries, stages))
    lines += ["## Top-level keys", ""] + table(top, rerun) + section_pages(all_entries, rerun)
    return "\n".join(lines).rstrip("\n") + "\n"


def reference() -> str:
    """docs/config.md as it should be now."""
    from pipelines.config import PipelineConfig
    from pipelines.stages import STAGES

    return render(PipelineConfig, STAGES)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.config_reference",
                                description="Print docs/config.md, generated from the config dataclasses.")
    p.add_argument("--write", action="store_true", help=f"write it to {OUTPUT.relative_to(ROOT)} instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    text = reference()
    if args.write:
        OUTPUT.write_text(text)
        print(f"wrote {OUTPUT.relative_to(ROOT)}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which task names lm-evaluation-harness knows, and ours, read without importing lm-eval or anything heavy: what
the config's `eval.downstream.tasks` is checked against at load (corpus/config.py), where torch, Ray and MLflow must
stay unimported (tests/test_architecture.py).

Ours are the YAML files in `TASKS` (beside this module, so found from the installed project). lm-eval's are declared
in its ~14,600 task files and the templates they include: their top-level `task:`, `group:` and `tag:` lines (and a
tag's list) are read as text, stopping once every name asked for is found: about a second when a name is unknown
(every file read), less for OPT's list. lm-eval's own index (TaskManager's: every file parsed as YAML, includes
resolved, 8 s or more, and an import of `datasets`) finds no name this misses, in the version pinned
(tests/test_downstream.py checks it); a name it finds that lm-eval does not know fails at lm-eval's load instead.

It is in corpus/, beside the config it checks, because corpus/config.py imports it: it is part of the code of every
stage that reads that config (core/imports.py), the corpus stages too, which import nothing of train/ (an edit here
reruns them all). Keep it to the names.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"  # our tasks' YAML files (their data: train/downstream/)
_NAME = re.compile(r"^['\"]?(task|group|tag)['\"]?:[ \t]*(.*)$", re.M)  # a top-level key, quoted or not
_ITEM = re.compile(r"^[ \t]*-[ \t]*(.+?)[ \t]*$")
_NOT_YAML = (".py", ".md", ".json", ".jsonl", ".txt", ".csv", ".tsv", ".pyc", ".ipynb", ".jpg", ".png", ".sh", ".lark")


def ours() -> dict[str, Path]:
    """{task name: its YAML file} of the tasks this project defines."""
    found: dict[str, Path] = {}
    for path in sorted(TASKS.glob("*.yaml")):
        for name in declared(path.read_text()):
            found[name] = path
    return found


def lm_eval_version() -> str | None:
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return None


def lm_eval_tasks() -> Path | None:
    """lm-eval's folder of task files, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec("lm_eval")
    return Path(spec.origin).parent / "tasks" if spec is not None and spec.origin else None


def unknown(names: list[str]) -> list[str]:
    """The names neither ours nor lm-eval's (a task, group or tag), in the order given."""
    wanted = frozenset(n for n in names if n not in ours())
    return [n for n in names if n in wanted - known(wanted)] if wanted else []


@functools.lru_cache(maxsize=16)
def known(wanted: frozenset[str]) -> frozenset[str]:
    """Those of `wanted` that lm-eval's installed task files declare. Kept per process: the files are the installed
    package's, and a scan costs 0.4 s, which every load of a cluster config paid (the tests load them often)."""
    root = lm_eval_tasks()
    return frozenset(scan(root, set(wanted))) if root is not None else frozenset()


def scan(root: Path, wanted: set[str] | None = None) -> set[str]:
    """The names the task files under `root` declare (only those of `wanted`, stopping when all are found)."""
    found: set[str] = set()
    needles = None if wanted is None else [n.encode() for n in wanted]
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for file in sorted(files):
            if file.endswith(_NOT_YAML):  # task files, and the templates they include, named as they like
                continue
            data = (Path(folder) / file).read_bytes()
            if needles is not None and not any(needle in data for needle in needles):
                continue
            names = declared(data.decode("utf-8", "replace"))
            found |= names if wanted is None else names & wanted
            if wanted is not None and found == wanted:
                return found
    return found


def declared(text: str) -> set[str]:
    """The task, group and tag names a task file declares at its top level (a group's `task:` list is its members)."""
    names = set()
    for match in _NAME.finditer(text):
        key, value = match.group(1), match.group(2).split(" #")[0].strip()
        if value.startswith("["):
            if key == "tag":
                names.update(v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip())
        elif value:
            names.add(value.strip("'\""))
        elif key == "tag":  # a YAML list on the lines below
            for line in text[match.end() + 1:].splitlines():
                item = _ITEM.match(line)
                if item is None:
                    break
                names.add(item.group(1).strip("'\""))
    return names

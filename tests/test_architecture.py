"""The floors of the code (docs/architecture.md), read from the source with `ast`: nothing is imported.

core/ is the ground: it imports no stage package and nothing of model/ or pipelines/. model/ is a library
that imports nothing of ours but itself. The stage packages (corpus, dedup, screen, train) never import
pipelines/, the top. More generally no import runs up a floor (FLOORS), and no two files import each other
through any chain (type-only imports count: they are a cycle a reader must hold too). And no function of
ours runs past MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"core", "pipelines", "corpus", "dedup", "screen", "train", "model"}
STAGES = ("corpus", "dedup", "screen", "train")
MAX_FUNCTION_LINES = 80


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imports(path: Path, root: Path = ROOT, names: bool = False) -> list[tuple[int, str]]:
    """(line, the dotted name imported) of every import in the file, at any depth (inside functions too). With
    `names`, `from a import b` also gives `a.b` (b may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module
            else:  # relative: resolved against the file's own package
                package = path.relative_to(root).parent.parts
                module = ".".join([*package[:len(package) - (node.level - 1)], *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if names]
    return found


def broken(packages: tuple[str, ...], refused: set[str]) -> list[str]:
    """'file:line imports name' for every import of a refused package from the given packages."""
    return [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for package in packages for path in sources(package)
            for line, name in imports(path) if name.split(".")[0] in refused]


# Who may import whom: a package imports only from its own floor or below.
FLOORS = {"core": 0, "model": 0, "corpus": 1, "dedup": 2, "train": 3, "screen": 4, "pipelines": 5, "benchmarks": 6}


def module_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Each module of ours (`train.rules`; a package is its `__init__`) -> the modules of ours it imports, each
    with the line of its first import there. A benchmark imports its siblings by their bare names."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for package in FLOORS for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        graph[name] = {}
        for line, imported in imports(path, root, names=True):
            if name.startswith("benchmarks.") and f"benchmarks.{imported}" in modules:  # a script's folder is on sys.path
                imported = f"benchmarks.{imported}"
            parts = (imported or "").split(".")
            while parts and ".".join(parts) not in modules:  # `from train.spikes import x` -> train.spikes
                parts.pop()
            target = ".".join(parts)
            if target and target != name:
                graph[name].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_up_a_floor():
    up = [f"{m.replace('.', '/')}.py:{line} imports {t}" for m, targets in module_graph().items()
          for t, line in targets.items() if FLOORS[t.split(".")[0]] > FLOORS[m.split(".")[0]]]
    assert up == []


def test_no_two_files_import_each_other_through_any_chain():
    assert cycles(module_graph()) == []


def test_the_cycle_rule_finds_a_planted_cycle(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("from core.b import x\n")
    (tmp_path / "core" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import core.c\n")
    (tmp_path / "core" / "c.py").write_text("def f():\n    from core import a\n")
    (tmp_path / "core" / "d.py").write_text("import core.a\n")
    graph = module_graph(tmp_path)
    assert graph["core.a"] == {"core.b": 1} and graph["core.d"] == {"core.a": 1}
    assert cycles(graph) == [["core.a", "core.b", "core.c"]]


def test_the_packages_are_where_the_rules_look():
    for package in OURS:
        assert sources(package), f"{package}/ has no Python files: has it moved?"


def test_core_imports_no_stage_model_or_pipelines():
    assert broken(("core",), set(STAGES) | {"model", "pipelines"}) == []


def test_model_imports_nothing_of_ours_but_itself():
    assert broken(("model",), OURS - {"model"}) == []


def test_stage_packages_never_import_pipelines():
    assert broken(STAGES, {"pipelines"}) == []


def test_the_rules_see_imports_inside_functions(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import os\n\ndef f():\n    from train.rules import check_batch\n    import pipelines.full\n")
    assert sorted(imports(path)) == [(1, "os"), (4, "train.rules"), (5, "pipelines.full")]


def long_functions(package: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line name is N lines' for every def (methods and nested ones too) longer than `limit`."""
    found = []
    for path in sources(package):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # the def line to the last line
                if lines > limit:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {lines} lines (at most {limit})")
    return found


def test_no_function_of_ours_is_longer_than_80_lines():
    """Every package, the sample generator and the benchmarks included (tests are not held to it)."""
    assert [f for package in sorted(OURS | {"benchmarks"}) for f in long_functions(package)] == []


def test_the_dedup_stage_reads_like_its_phases():
    """dedup/stage.py's run is a call per phase, each phase a module of its own (its docstring's list): under 40
    lines, where it was 106 with seven concerns in one file."""
    assert [f for f in long_functions("dedup", 39) if f.startswith("dedup/stage.py")] == []
    phases = {"exact", "candidates", "verify", "components", "assemble", "output"}
    doc = ast.get_docstring(ast.parse((ROOT / "dedup" / "stage.py").read_text()))
    assert {p for p in phases if f"dedup/{p}.py" in doc and (ROOT / "dedup" / f"{p}.py").is_file()} == phases


@pytest.mark.parametrize("limit, expected", [(3, []), (2, ["f is 3 lines"])])
def test_the_length_rule_counts_from_def_to_last_line(tmp_path, monkeypatch, limit, expected):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    x = 1\n    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [line.split(" ", 1)[1].rsplit(" (", 1)[0] for line in long_functions("pkg", limit)] == expected


def test_ray_tasks_are_typed_records_not_dicts():
    """A task is a frozen dataclass built on the driver (corpus.parts.run_tasks): no `task["key"]` in our code, where
    a misspelt key would fail inside a Ray worker."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for package in sorted(OURS) for path in sources(package)
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "task"
             and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)]
    assert found == []


def test_the_loader_knows_no_section_and_a_config_loads_without_the_engines():
    """core/config.py is the generic loader: every section's dataclass lives beside the code it configures
    (corpus/, dedup/, screen/, train/, core/ray_session.py, core/tracking.py) and pipelines/config.py composes
    them. Loading a config starts no engine: Ray, MLflow, torch and DeepSpeed stay unimported (a Ray worker
    that unpickles a section pays for none of them)."""
    import subprocess

    tree = ast.parse((ROOT / "core" / "config.py").read_text())
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert classes == ["ConfigError"], classes
    code = ("import sys; from pipelines.config import load_config; load_config(None); "
            "print(sorted(m for m in ('ray', 'mlflow', 'torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_production_loop_knows_no_fault_kind():
    """A drill's faults reach the loop through one object (train/loop/drill.py): the trainer, the pilot, the step,
    the stage, the autopilot's policy, the health check and the failure records test for no kind of injected
    fault nor read the drill's files, and the trainer calls the drill only at its hook points, so a drill cannot
    change what they do on a run without one."""
    import typing

    from train.config import InjectConfig
    from train.loop.drill import Drill

    kinds = set(typing.get_args(typing.get_type_hints(InjectConfig)["kind"]))
    assert {"kill", "overflow", "unhealthy"} <= kinds
    found = []
    for name in ("train/loop/trainer.py", "train/loop/pilot.py", "train/loop/step.py", "train/stage.py",
                 "train/autopilot_policy.py", "train/health.py", "train/failures.py"):
        path = ROOT / name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(isinstance(side, ast.Constant) and side.value in kinds
                                                     for side in [node.left, *node.comparators]):
                found.append(f"{name}:{node.lineno} compares with a fault kind")
            if isinstance(node, ast.Attribute) and node.attr in ("INJECT", "INJECTED"):
                found.append(f"{name}:{node.lineno} reads the drill's records.{node.attr}")
    hooks = {"start_up", "before_step", "rolled_back", "loss_scaler"}
    assert hooks <= set(vars(Drill))
    trainer = ROOT / "train" / "loop" / "trainer.py"
    for node in ast.walk(ast.parse(trainer.read_text(), str(trainer))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "drill" \
                and node.attr not in hooks:
            found.append(f"train/loop/trainer.py:{node.lineno} reaches into the drill: .drill.{node.attr}")
    assert found == []

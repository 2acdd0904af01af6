"""Which of the project's modules a module runs, read from the source with `ast`, never imported: the stage
cache's code version (core/dag.py). A hand-kept list of a stage's modules goes stale the day someone adds an
import (the train stage's once missed five), and the cache then reuses output that older code made.

Every import counts, those inside functions too (most of ours are lazy, to keep start-up cheap), and so does
every package's `__init__.py` on the way to a module, which importing it executes. Only the project's modules
are followed: a name resolves when its file is under one of `roots` (the project's root, where core/ is, and
the starting module's own). Imports by name in strings (a Ray runtime env's setup hook) are not seen: a stage
declares those by hand (core.dag.Stage.code)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the folder that holds core/ and every other package of ours


def module_file(name: str, roots: tuple[Path, ...]) -> Path | None:
    """The source file of module `name` under one of `roots`, or None where it is not ours."""
    parts = name.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


def roots_for(module: str) -> tuple[Path, ...]:
    """The project's root and the root `module` itself is found under (tests/ for a test's own stage code)."""
    spec = importlib.util.find_spec(module)  # imports its parent packages, if any, not the module
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"stage code module {module!r} cannot be found")
    own = Path(spec.origin).resolve()
    depth = module.count(".") + (1 if own.name == "__init__.py" else 0)
    return (ROOT, own.parents[depth])


def imported(module: str, roots: tuple[Path, ...] | None = None, parsed: dict | None = None) -> dict[str, Path]:
    """{name: file} of `module` and every project module it imports, transitively, with their packages.
    `parsed`: a cache of each file's imports shared by several calls (the six stages share most modules)."""
    roots = roots or roots_for(module)
    parsed = {} if parsed is None else parsed
    found: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = module_file(name, roots)
        if path is None:
            continue
        found[name] = path
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        stat = path.stat()
        key = (name, path, stat.st_mtime_ns, stat.st_size, roots)  # an edited file is read again
        if key not in parsed:
            parsed[key] = _imports_of(name, path, roots)
        todo += parents + parsed[key]
    return dict(sorted(found.items()))


def _imports_of(name: str, path: Path, roots: tuple[Path, ...]) -> list[str]:
    """The module names `path`'s import statements name, ours or not (the caller keeps ours)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append(target)
            # `from a import b`: b may be a module of package a, or a name defined in it
            out += [f"{target}.{alias.name}" for alias in node.names
                    if alias.name != "*" and module_file(f"{target}.{alias.name}", roots)]
    return out

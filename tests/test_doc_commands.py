"""Every command in the docs is real: the fenced blocks of README.md and docs/*.md, read and checked; none is run.

- Every fenced block names its language (```sh, ```text, ```python, ```yaml, ...): an untagged fence would let a
  command escape the check.
- Every command of a ```sh block (also bash, shell; in a ```console block, the lines after a `$ ` prompt) is
  checked. Lines ending in `\\` are joined and `#` comments dropped; a line is split at `&&`, `||`, `;`, `|` and
  `&`. Leading `VAR=value` assignments, a `$ ` prompt and redirections (`2>&1`, `> file`) are not part of a
  command. A `$(command)` is checked as a command of its own; a here-document's text is not read.
  - The files it names exist (the rule below).
  - `make TARGET ... VAR=value`: each target is a rule of the Makefile and each VAR a variable it reads (CPU only
    the values its `ifeq` tests). ARGS is checked as the arguments of the script `make run` runs
    (pipelines/full.py), PYTEST_ARGS for the files it names.
  - Our entry points (`python SCRIPT.py ...` or `python -m MODULE ...` for a script or module of this repository)
    parse their arguments with their own argparse. Each builds its parser in a top-level `parser()` that runs
    nothing (its main parses with it); a script without one takes no arguments. A `<placeholder>` is given a
    value its flag accepts (its first choice, else 1); one where the command takes no positional stands for
    options and is dropped.
  - `--set key=value` names a key of the config schema (pipelines/config.py's PipelineConfig). Each is applied to
    the raw YAML of the command's `--config` (else configs/local.yaml) by core/config.py's `apply_override`, as a
    run applies it. The result is built with `from_dict`, so a value of the wrong type fails too (unless a value
    is a placeholder).
  - `python`, `mlflow` and `pytest` alone are not on PATH after `make run`: a laptop command says `.venv/bin/...`.
    Inside `ray job submit ... -- CMD`, CMD is checked as a command too, and its bare `python` is the image's.

Which words are checked as repository paths. A word is checked when it is relative (no leading `/` or `~`; a
leading `./` is dropped), holds no `<placeholder>`, `$VAR`, `=` or `scheme://`, and either
- begins with a top-level file or folder of the repository (configs/, pipelines/, benchmarks/, docs/, tests/,
  .ci/, cluster.yaml, Dockerfile, Makefile, ...), or
- ends in .py, .yaml, .yml, .sh or .toml, or in .md with a `/` in it (a bare name.md may be a file a run wrote).
It must then exist; a glob must match something; pytest's `FILE::TEST` and a `#anchor` are read as the file. The
script of `bash X`, `sh X` or `. X` is checked whatever its name. A `--flag=value` or `KEY=value` word is read by
its value. Never checked: what the commands create (work/, data/ and .venv/, made by `make run` and the pipeline),
absolute paths (/fsx, /tmp), URIs, `$VARS` and `<placeholders>`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import glob
import importlib
import io
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, apply_override, from_dict
from pipelines.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
SHELLS = {"sh", "bash", "shell", "console"}
CREATED = {"work", "data", ".venv", "mlruns"}  # made by `make run` and the pipeline: outputs, not repository files
CHECKED_SUFFIXES = (".py", ".yaml", ".yml", ".md", ".sh", ".toml")
SEPARATORS = {"&&", "||", ";", "|", "&"}
NOT_ON_PATH = {"python", "mlflow", "pytest"}  # after `make run` they are in .venv/bin only
PYTHON = re.compile(r"(\S*/)?python3?(\.\d+)?")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"<[^<>]*>|\$")


def docs() -> list[str]:
    return ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


@functools.lru_cache(maxsize=None)
def top_level() -> set[str]:
    """The repository's top-level files and folders (.ci/ included), without what runs and installs create."""
    made = CREATED | {".git", ".pytest_cache", "__pycache__"}
    return {p.name for p in ROOT.iterdir() if not p.name.endswith(".egg-info")} - made


def our_packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


# --------------------------------------------------------------------------- reading the markdown


@dataclass
class Block:
    doc: str
    line: int  # the opening fence's
    lang: str
    lines: list[tuple[int, str]] = field(default_factory=list)
    closed: bool = False


@dataclass
class Command:
    where: str  # "README.md:42"
    words: list[str]
    inner: bool = False  # inside `ray job submit ... --`: run by the image's python

    @property
    def text(self) -> str:
        text = shown(self.words)
        return text if len(text) <= 140 else text[:137] + "..."


def shown(words: list[str]) -> str:
    """Words as a reader would type them: quoted only where the shell needs it (not `<placeholders>`)."""
    return " ".join(shlex.quote(w) if re.search(r"[\s'\"|;&]", w) or not w else w for w in words)


def fenced_blocks(text: str, doc: str) -> list[Block]:
    """The fenced code blocks (``` or ~~~, at any indentation, as in a list item), each line dedented by its fence's."""
    blocks: list[Block] = []
    fence, indent = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not fence:
            if m and not (m.group(2)[0] == "`" and "`" in m.group(3)):
                fence, indent = m.group(2), len(m.group(1))
                info = m.group(3).strip()
                blocks.append(Block(doc, number, info.split()[0].strip("{}.") if info else ""))
        elif m and m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence) and not m.group(3).strip():
            blocks[-1].closed, fence = True, ""
        else:
            blocks[-1].lines.append((number, line[indent:] if line.startswith(" " * indent) else line.lstrip()))
    return blocks


def drop_comment(line: str) -> str:
    """The line up to a `#` that starts a word outside quotes."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """(first line, text) of each command line: `\\` continuations joined, a here-document's body skipped; in a
    console block only `$ ` lines."""
    out: list[tuple[int, str]] = []
    pending, start, heredoc = None, 0, ""
    for number, line in block.lines:
        if heredoc:
            heredoc = "" if line.strip() == heredoc else heredoc
            continue
        if pending is None:
            if block.lang == "console" and not line.lstrip().startswith("$ "):
                continue
            start, pending = number, re.sub(r"^\s*\$ ", "", line)
        else:
            pending += " " + line.strip()
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1]
            continue
        out.append((start, pending))
        here = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", drop_comment(pending))
        pending, heredoc = None, here.group(1) if here else ""
    if pending is not None:
        out.append((start, pending))
    return out


def split_commands(line: str, where: str) -> list[Command]:
    """A shell line's commands: split at && || ; | &, redirections and leading VAR=value assignments dropped; a
    `$(command)` substitution is a command of its own, and a `$VALUE` in its place."""
    line = drop_comment(line)
    inner = re.findall(r"\$\(([^()]*)\)", line)
    line = re.sub(r"\$\(([^()]*)\)", "$VALUE", line)
    line = re.sub(r"(?<!\S)\d*>>?(&\d+|\s*[^\s|;&]+)", " ", line)  # > file, 2>&1 (not a <placeholder>)
    line = re.sub(r"(?<!\S)<\s+\S+", " ", line)  # < file
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, ""
    try:
        words = list(lexer)
    except ValueError as exc:
        return [Command(where, [f"<unreadable: {exc}>", line.strip()])]
    commands, current = [], []
    for word in [*words, ";"]:
        if word not in SEPARATORS:
            current.append(word)
            continue
        while current and (ASSIGNMENT.match(current[0]) or current[0] in ("time", "env", "sudo")):
            current.pop(0)
        if current:
            commands.append(Command(where, current))
        current = []
    return commands + [c for text in inner for c in split_commands(text, where)]


def commands_of(block: Block) -> list[Command]:
    return [c for number, line in logical_lines(block) for c in split_commands(line, f"{block.doc}:{number}")]


# --------------------------------------------------------------------------- the checks


def check_markdown(text: str, doc: str) -> list[str]:
    """Every problem of a markdown file's fenced blocks and shell commands, one line each: 'doc:line: what'."""
    found = []
    for block in fenced_blocks(text, doc):
        if not block.lang:
            found.append(f"{doc}:{block.line}: a fenced block without a language: write ```sh for commands, "
                         "```text for output or trees (```python, ```yaml for code)")
        if not block.closed:
            found.append(f"{doc}:{block.line}: a fence opened here is never closed")
        if block.lang in SHELLS:
            found += [problem for command in commands_of(block) for problem in check_command(command)]
    return found


def check_command(command: Command) -> list[str]:
    words = command.words
    program, args = words[0], words[1:]
    if program.startswith("<unreadable"):
        return [f"{command.where}: `{words[1]}`: not a shell command as written ({program[13:-1]})"]
    found = []
    if program == "make":
        found += check_make(args)
    elif PYTHON.fullmatch(program):
        found += check_python(args)
    elif program == "ray" and args[:2] == ["job", "submit"] and "--" in args:
        cut = args.index("--")
        found += missing_paths(args[:cut])
        inner = args[cut + 1:]
        while inner and ASSIGNMENT.match(inner[0]):
            inner.pop(0)
        if inner:
            found += check_command(Command(command.where, inner, inner=True))
        else:
            found.append("`ray job submit ... --` with no command after `--`")
    else:
        found += missing_paths(words)
        if program in ("bash", "sh", "source", ".") and args:
            found += script_missing(args[0])
    if program in NOT_ON_PATH and not command.inner:
        found.append(f"`{program}` is not on PATH after `make run`: write `.venv/bin/{program}` (inside "
                     "`ray job submit ... --` the image's python is fine)")
    return [f if f.startswith(command.where) else f"{command.where}: `{command.text}`: {f}" for f in found]


def is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.search(word))


def is_repo_path(word: str) -> bool:
    """Whether a word is checked as a path of the repository (the module's docstring has the rule)."""
    word = word.removeprefix("./")
    if not word or word in (".", "..") or word.startswith(("-", "/", "~")) or "://" in word:
        return False
    if is_placeholder(word) or "=" in word:
        return False
    first = word.split("/")[0]
    if first in CREATED:
        return False
    if first in top_level():
        return True
    suffixes = CHECKED_SUFFIXES if "/" in word else tuple(s for s in CHECKED_SUFFIXES if s != ".md")
    return re.split(r"::|#", word)[0].endswith(suffixes)


def missing_paths(words: list[str]) -> list[str]:
    found = []
    for word in words:
        for candidate in (word, word.split("=", 1)[1] if "=" in word else ""):
            if is_repo_path(candidate):
                path = re.split(r"::|#", candidate.removeprefix("./"))[0].rstrip("/")
                if not glob.glob(str(ROOT / path)):
                    found.append(f"{path} does not exist in the repository")
    return found


def script_missing(word: str) -> list[str]:
    """The script a shell runs (`bash X`, `. X`) is a repository file, whatever its name, unless it is one a
    command creates (.venv/bin/activate), absolute or a placeholder; [] when the path rule already checked it."""
    word = word.removeprefix("./")
    if word.startswith(("-", "/", "~")) or is_placeholder(word) or word.split("/")[0] in CREATED or is_repo_path(word):
        return []
    return [] if (ROOT / word).exists() else [f"{word} does not exist in the repository"]


def check_python(args: list[str]) -> list[str]:
    """`python [options] SCRIPT args` or `python -m MODULE args`: the script or module, then its arguments."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in ("-X", "-W") else 1
    if i == len(args) or args[i] == "-c":
        return []
    if args[i] == "-m":
        module, rest = (args[i + 1] if i + 1 < len(args) else ""), args[i + 2:]
        if module.split(".")[0] not in our_packages():
            return missing_paths(rest)  # pytest, pip, venv: their files are checked, not their flags
        path = module_file(module)
        if path is None:
            return [f"no module {module} in the repository"]
        return check_entry_point(path, module, rest)
    script, rest = args[i], args[i + 1:]
    if is_placeholder(script) or script.startswith(("/", "~")):
        return missing_paths(rest)
    if not (ROOT / script).is_file():
        return [f"{script.removeprefix('./')} does not exist in the repository"]
    return check_entry_point(ROOT / script, None, rest)


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


# --------------------------------------------------------------------------- our entry points


def defines_parser(path: Path) -> bool:
    """A top-level `def parser` in the file, or `parser` imported into it (pipelines/plan.py's is the planner's)."""
    return any(isinstance(n, ast.FunctionDef) and n.name == "parser"
               or isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == "parser" for a in n.names)
               for n in ast.parse(path.read_text()).body)


@functools.lru_cache(maxsize=None)
def parser_of(path: Path, module: str | None):
    """The entry point's `parser` function (its module imported: nothing runs), or None for a script without one."""
    if not defines_parser(path):
        return None
    if module is None:
        rel = path.relative_to(ROOT)
        if (path.parent / "__init__.py").is_file():
            module = ".".join(rel.with_suffix("").parts)
        else:  # a script beside its helpers (benchmarks/): importable by name from its folder, as when it runs
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            module = path.stem
    return importlib.import_module(module).parser


def check_entry_point(path: Path, module: str | None, args: list[str]) -> list[str]:
    name = module and f"python -m {module}" or str(path.relative_to(ROOT))
    found = missing_paths(args)
    build = parser_of(path, module)
    if build is None:
        if args:
            found.append(f"{name} takes no arguments (it defines no parser()), got: {shown(args)}")
        return found
    p = build()
    p.prog = name  # not pytest's argv[0]
    error = parse_error(p, fill_placeholders(p, args))
    if error:
        found.append(f"{name} rejects these arguments: {error}")
    return found + set_problems(args)


def fill_placeholders(p: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`<placeholder>` values replaced by one their flag accepts; one where no positional is taken, dropped."""
    positionals = [a for a in p._actions if not a.option_strings]
    out, seen = [], 0
    for i, word in enumerate(args):
        option, _, value = word.partition("=")
        if word.startswith("-") and value and is_placeholder(value):
            out.append(f"{option}={example(p._option_string_actions.get(option))}")
            continue
        if not is_placeholder(word):
            out.append(word)
            if not word.startswith("-") and not (i and takes_value(p, args[i - 1])):
                seen += 1
            continue
        if i and takes_value(p, args[i - 1]):
            out.append(example(p._option_string_actions[args[i - 1]]))
        elif positionals:
            out.append(example(positionals[min(seen, len(positionals) - 1)]))
            seen += 1
    return out


def takes_value(p: argparse.ArgumentParser, word: str) -> bool:
    action = p._option_string_actions.get(word)
    return action is not None and action.nargs != 0


def example(action: argparse.Action | None) -> str:
    if action is not None and action.choices:
        return str(sorted(action.choices)[0])
    return "1"


def parse_error(p: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when the parser takes the arguments (or prints its --help); else the last line it wrote."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            p.parse_args(args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit {exc.code}"
    return None


def set_problems(args: list[str]) -> list[str]:
    """Each `--set key=value` applied to the raw YAML of the command's --config (else configs/local.yaml)."""
    items = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"] + [a[6:] for a in args if a.startswith("--set=")]
    if not items:
        return []
    configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"] + [a[9:] for a in args if a.startswith("--config=")]
    base = ROOT / "configs" / "local.yaml"
    if configs and not is_placeholder(configs[-1]) and (ROOT / configs[-1]).is_file():
        base = ROOT / configs[-1]
    raw = yaml.safe_load(base.read_text()) or {}
    raw.setdefault("name", base.stem)
    found = []
    for item in items:
        if is_placeholder(item.partition("=")[0]):
            continue
        try:
            apply_override(PipelineConfig, raw, item)
        except ConfigError as exc:
            found.append(f"--set {item}: {exc} (pipelines/config.py, docs/config.md)")
    if not found and not any(is_placeholder(item) for item in items):
        try:
            from_dict(PipelineConfig, raw, "")
        except ConfigError as exc:
            found.append(f"{' '.join('--set ' + i for i in items)} on {base.relative_to(ROOT)}: {exc}")
    return found


# --------------------------------------------------------------------------- make


@functools.lru_cache(maxsize=None)
def makefile() -> tuple[set[str], set[str], dict[str, set[str]], str]:
    """The Makefile's targets, the variables it reads, the values an `ifeq` tests each for, and the script of $(ARGS)."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)) - {".PHONY"}
    variables = set(re.findall(r"^([A-Za-z_]\w*)\s*[?:+]?=", text, re.M)) | set(re.findall(r"\$\(([A-Za-z_]\w*)\)", text))
    values: dict[str, set[str]] = {}
    for var, value in re.findall(r"^ifeq\s*\(\$\((\w+)\),\s*([^)\s]+)\)", text, re.M):
        values.setdefault(var, set()).add(value)
    script = re.search(r"(\S+\.py) \$\(ARGS\)", text).group(1)
    return targets, variables, values, script


def check_make(args: list[str]) -> list[str]:
    targets, variables, values, script = makefile()
    found = []
    for word in args:
        if word.startswith("-") or is_placeholder(word.partition("=")[0]):
            continue
        var, eq, value = word.partition("=")
        if not eq:
            if word not in targets:
                found.append(f"no make target '{word}' in the Makefile (its targets: {', '.join(sorted(targets))})")
        elif var not in variables:
            found.append(f"the Makefile reads no variable {var} (it reads: {', '.join(sorted(variables))})")
        elif var in values and value not in values[var]:
            found.append(f"{var}={value}: the Makefile knows {var}={' or '.join(sorted(values[var]))} only")
        elif var == "ARGS":
            found += [f"ARGS: {f}" for f in check_entry_point(ROOT / script, None, shlex.split(value))]
        elif var == "PYTEST_ARGS":
            found += [f"PYTEST_ARGS: {f}" for f in missing_paths(shlex.split(value))]
    return found


# --------------------------------------------------------------------------- the tests


def snippet(*commands: str) -> str:
    return "Some text.\n\n```sh\n" + "\n".join(commands) + "\n```\n"


def test_every_command_in_the_docs_is_real():
    """README.md and docs/*.md: every fenced block has a language, and every shell command names real files, make
    targets, flags of our entry points and config keys."""
    found = [problem for doc in docs() for problem in check_markdown((ROOT / doc).read_text(), doc)]
    assert not found, f"{len(found)} problem(s) in the docs' commands:\n" + "\n".join(found)


@pytest.mark.parametrize("command, expected", [
    (".venv/bin/python pipelines/full.py --no-such-flag", "pipelines/full.py rejects these arguments: "
     "error: unrecognized arguments: --no-such-flag"),
    (".venv/bin/python benchmarks/no_such.py", "benchmarks/no_such.py does not exist in the repository"),
    (".venv/bin/python pipelines/full.py --set dedup.no_such_key=1", "--set dedup.no_such_key=1: config key "
     "'dedup.no_such_key': unknown key"),
    (".venv/bin/python pipelines/full.py --set train.max_steps=many", "config key 'train.max_steps': expected"),
    (".venv/bin/python pipelines/full.py --config configs/no-such.yaml", "configs/no-such.yaml does not exist"),
    ("make run ARGS=\"--only dedup --no-such-flag\"", "ARGS: pipelines/full.py rejects these arguments"),
    ("make no-such-target", "no make target 'no-such-target' in the Makefile"),
    ("make test CPU=avx512", "CPU=avx512: the Makefile knows CPU=avx2 only"),
    ("make test NO_SUCH_VAR=1", "the Makefile reads no variable NO_SUCH_VAR"),
    ("make test PYTEST_ARGS=\"tests/test_no_such.py -k x\"", "tests/test_no_such.py does not exist"),
    ("RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- "
     "python pipelines/full.py --no-such-flag", "rejects these arguments"),
    (".venv/bin/python -m pipelines.plan --gpus <gpus> --no-such-flag", "python -m pipelines.plan rejects these "
     "arguments: error: unrecognized arguments: --no-such-flag"),
    (".venv/bin/python -m pipelines.plan --gpus 0", "--gpus must be positive"),
    (".venv/bin/python -m pipelines.no_such", "no module pipelines.no_such in the repository"),
    (".venv/bin/python -m corpus.sample", "the following arguments are required: out"),
    (".venv/bin/python benchmarks/state_bytes.py --fast", "benchmarks/state_bytes.py rejects these arguments: "
     "benchmarks/state_bytes.py: error: unrecognized arguments: --fast"),
    (".venv/bin/python benchmarks/provenance.py --fast", "benchmarks/provenance.py takes no arguments"),
    (".venv/bin/python benchmarks/bench_dedup.py quality --no-such-flag", "benchmarks/bench_dedup.py rejects"),
    ("python pipelines/full.py", "`python` is not on PATH after `make run`"),
    ("ray up cluster.yml", "cluster.yml does not exist in the repository"),
    ("less docs/no-such-page.md", "docs/no-such-page.md does not exist in the repository"),
    ("bash ci/run", "ci/run does not exist in the repository"),
    ("HEAD_IP=$(ray get-head-ip cluster.yml) && echo $HEAD_IP", "cluster.yml does not exist in the repository"),
])
def test_the_check_reports_a_made_up_command(command, expected):
    found = check_markdown(snippet(command), "snippet.md")
    assert len(found) == 1 and found[0].startswith("snippet.md:4: `") and expected in found[0], found


def test_the_check_reports_an_untagged_fence_and_reads_a_continued_line_as_one_command():
    found = check_markdown("```\nmake run\n```\n\n```sh\n.venv/bin/python pipelines/full.py \\\n  --only dedup \\\n"
                           "  --no-such-flag   # a comment\n```\n", "snippet.md")
    assert len(found) == 2 and found[0].startswith("snippet.md:1: a fenced block without a language"), found
    assert found[1].startswith("snippet.md:6: `.venv/bin/python pipelines/full.py --only dedup --no-such-flag`"), found


def test_the_check_passes_real_commands():
    """Commands as the docs write them: placeholders, outputs the commands create, URIs, comments, pipes and
    continuations, a job's command inside `ray job submit`, make's variables."""
    text = snippet(
        "make run",
        "make run ARGS=\"--only dedup --force\"   # ARGS are full.py's",
        "make test PYTEST_ARGS=\"-k dag tests/test_dag.py\" CPU=avx2",
        "make clean && make install",
        ".venv/bin/python pipelines/full.py --config configs/local.yaml --set dedup.threshold=0.9 \\",
        "    --set 'screen.drop=[DM Mathematics]' --ablation loose-dedup",
        ".venv/bin/python pipelines/full.py --set sources.0.paths='[data/sample/pile/*.jsonl.zst]' --check --verify",
        ".venv/bin/python pipelines/full.py --set train.model=<size> --workdir <dir>",
        ".venv/bin/python pipelines/full.py --help",
        ".venv/bin/python -m pipelines.plan --gpus <gpus> --gpu <gpu> --node p4de.24xlarge --json",
        ".venv/bin/python -m pipelines.plan --config configs/opt-1.3b.yaml --layout tp=8,pp=4,zero=1 --png work/plan.png",
        ".venv/bin/python -m corpus.sample <out> --spiky-subset HackerNews:12",
        ".venv/bin/python pipelines/compare.py base <name> --out work/ablations.png",
        ".venv/bin/mlflow ui --backend-store-uri sqlite:///$PWD/work/mlflow.db",
        "RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- "
        "python pipelines/full.py --config configs/opt-175b.yaml --set train.max_steps=10",
        "RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m pipelines.placement --config configs/opt-175b.yaml",
        "ls work/dedup/ /fsx/opt-pipeline | head; cat docs/cluster.md#launching > /tmp/x 2>&1",
        ".venv/bin/python -m pytest tests/test_plan.py::test_the_command_line -q",
        ".venv/bin/python benchmarks/chaos.py --set train.stragglers.exclude=true --json 2>&1 | tail -5",
        ".venv/bin/python benchmarks/bench_dedup.py scale --docs 100000 400000",
        ".venv/bin/python benchmarks/state_bytes.py",
        "bash benchmarks/gpu_site.sh <have>",
        "ray up cluster.yaml && docker build -t <registry>/opt-pipeline:<tag> .",
        "HEAD_IP=$(ray get-head-ip cluster.yaml); ssh -N -L 5000:$HEAD_IP:5000 ubuntu@<bastion>",
        "bash .ci/run && . .venv/bin/activate",
        "cat > ~/.mlflow/credentials <<'EOF'",
        "[mlflow]",
        "mlflow_tracking_username = admin",
        "python benchmarks/no_such.py   # a here-document's text: not a command",
        "EOF",
    )
    assert check_markdown(text, "snippet.md") == []


def test_every_entry_point_builds_its_parser_in_a_function():
    """Each script or module of ours with an argparse parser builds it in a top-level `parser()` that runs nothing:
    what this test parses the docs' commands with (a script without one is held to taking no arguments)."""
    missing = [str(path.relative_to(ROOT)) for top in sorted(top_level() - {"tests"}) if (ROOT / top).is_dir()
               for path in sorted((ROOT / top).rglob("*.py"))
               if "ArgumentParser" in path.read_text() and not defines_parser(path)]
    assert missing == [], f"argparse without a top-level parser() in: {', '.join(missing)}"


# --------------------------------------------------------------------------- links between the pages

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline code and punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a page (outside fenced blocks), a repeated one numbered as GitHub numbers it."""
    seen: dict[str, int] = {}
    out = set()
    in_block = {number for block in fenced_blocks(text, "") for number in range(block.line, block.line + len(block.lines) + 2)}
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"#{1,6} (.+)", line)
        if m and number not in in_block:
            base = slug(m.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def broken_links(text: str, doc: str) -> list[str]:
    """Each relative link of a page (outside code) whose file or heading does not exist, as `doc:line: target`."""
    in_block = {number for block in fenced_blocks(text, doc) for number in range(block.line, block.line + len(block.lines) + 2)}
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if number in in_block:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            if not path:  # a heading of this page
                if anchor not in anchors(text):
                    found.append(f"{doc}:{number}: {target}: no heading #{anchor} in {doc}")
                continue
            file = (ROOT / doc).parent / path
            if not file.exists():
                found.append(f"{doc}:{number}: {target}: no file {path}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                found.append(f"{doc}:{number}: {target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    return found


def test_every_link_between_the_pages_resolves():
    pages = [*docs(), "CHANGELOG.md"]
    found = [problem for doc in pages for problem in broken_links((ROOT / doc).read_text(), doc)]
    assert not found, f"{len(found)} broken link(s):\n" + "\n".join(found)


def test_the_link_check_reports_a_missing_page_and_a_missing_heading():
    text = "# Top\n\nSee [a](docs/no-such.md), [b](docs/cli.md#no-such-heading), [c](#top), [d](docs/cli.md#make), [e](#nope).\n"
    found = broken_links(text, "README.md")
    assert [f.split(": ", 2)[1] for f in found] == ["docs/no-such.md", "docs/cli.md#no-such-heading", "#nope"], found


# --------------------------------------------------------------------------- the README, a guide

def prose(text: str) -> list[str]:
    """A page's sentences outside code blocks, tables and headings: a paragraph or list item at a time, split after
    `.`, `!` or `?`."""
    in_block = {number for block in fenced_blocks(text, "") for number in range(block.line, block.line + len(block.lines) + 2)}
    items, item = [], []
    for number, line in enumerate(text.splitlines(), 1):
        starts = not line.strip() or number in in_block or re.match(r"\s*(#|\||[-*] |\d+\. )", line)
        if starts and item:
            items.append(" ".join(item))
            item = []
        if line.strip() and number not in in_block and not re.match(r"\s*(#|\|)", line):
            item.append(re.sub(r"^\s*([-*]|\d+\.) ", "", line).strip())
    items += [" ".join(item)] if item else []
    return [s for i in items for s in re.split(r"(?<=[.!?])\s+", i) if s]


def test_the_readme_is_a_short_guide():
    """At most 2,000 words, no sentence over 50, and no commit hash (a figure pinned to a commit belongs in
    docs/benchmarks.md, its story in CHANGELOG.md)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 2000, len(text.split())
    long = [s for s in prose(text) if len(s.split()) > 50]
    assert not long, long
    assert not re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text)


def test_prose_is_split_into_sentences_per_paragraph_and_list_item():
    text = "# A heading\n\nOne sentence. Two\nlines.\n\n- an item\n- another. Last.\n\n```sh\nnot prose. at all\n```\n| a | b |\n"
    assert prose(text) == ["One sentence.", "Two lines.", "an item", "another.", "Last."]

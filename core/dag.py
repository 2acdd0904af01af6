"""The DAG runner: which stages run, which are cache hits, and outputs that are complete or absent.

A stage is data (`Stage`): a name, the stages it reads, the config section it depends on, and a
function that fills a fresh folder; its code is that function's module and every module of ours it
imports (core/imports.py), never a list kept by hand. Its fingerprint is a hash
of its config section, its code and its inputs' fingerprints (plus, for stages that read
outside the workdir, the files they read), so an unchanged stage is found in the cache and a
changed one reruns together with everything downstream of it.

Workdir layout (design.md's contract, plus one folder per completed fingerprint so that
switching an ablation back and forth is a cache hit, not a recompute):

    WORKDIR/<stage>/manifest.json             the current completed output (a copy of one below)
    WORKDIR/<stage>/<fp16>/manifest.json      a completed output
    WORKDIR/<stage>/<fp16>/files.json         every file it holds, with sizes and rows (core/outputs.py)
    WORKDIR/<stage>/<fp16>/output/            its data
    WORKDIR/<stage>/<fp16>/<reason>/          rows set aside (rejects/, dropped/, duplicates/...)
    WORKDIR/<stage>/<fp16>/stage.log          what the stage logged
    WORKDIR/<stage>/.partial-<fp16>-<time>/   a stage being written, or one that failed

A stage writes into `.partial-*`; its manifest is written last and the folder is renamed into
place only then, and the current manifest is replaced atomically after that. A crash at any
point leaves either the previous current output or the new complete one, never a half output
that looks done.

A cache hit is checked before it is used: its files against files.json (a stat each; `--verify`
reads them). A damaged output of a stage that is to run is rebuilt, saying which file and why; one
that a stage needs but that is not selected stops the run (exit 1). Outputs are found by their place
in the workdir, not by the absolute path recorded when they were made, so a workdir can be copied,
moved or synced and used where it lands. A stage that reads no rows while its input committed some
fails: a missing input is never an empty one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from core import console, outputs
from core.config import section_dict, section_of
from core.imports import imported

log = logging.getLogger("pipelines")


class UsageError(ValueError):
    """A stage selection that cannot be run as asked (exit code 2)."""


class DamagedOutput(RuntimeError):
    """A completed output that a stage needs does not match what was committed, and is not to be rebuilt
    in this run (exit code 1)."""


class StageFailed(RuntimeError):
    """A stage raised; the previous good output stays current (exit code 1)."""

    def __init__(self, stage: str, reason: str, partial: Path, log_path: Path):
        self.stage, self.reason, self.partial, self.log_path = stage, reason, partial, log_path
        super().__init__(
            f"stage '{stage}' failed: {reason}\n"
            f"  partial output (not used by later runs): {partial}\n"
            f"  log: {log_path}"
        )


@dataclass
class StageResult:
    """What a stage reports: rows_in must equal rows_out plus every row set aside."""

    rows_in: int
    rows_out: int
    set_aside: dict[str, int] = field(default_factory=dict)  # reason -> rows written beside the output
    metrics: dict[str, float] = field(default_factory=dict)  # anything else worth a number in MLflow
    fields: dict[str, Any] = field(default_factory=dict)  # stage-specific manifest entries (train: steps, final_loss)
    # MLflow tags of the stage's run (train: eval.seeds, eval.fingerprint), kept in the manifest so that a cache
    # hit's run carries them too: a user who filters runs by a tag finds the cache hits as well
    tags: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {"rows_in": self.rows_in, "rows_out": self.rows_out, **self.set_aside}


@dataclass
class StageContext:
    """Everything a stage may touch: its config, its inputs' manifests, and a fresh folder."""

    stage: str
    config: Any  # the whole pipeline's config (pipelines/config.py: PipelineConfig)
    section: Any  # the stage's typed config section (config.dedup for dedup, ...; the first one named)
    inputs: dict[str, dict]  # input stage -> its manifest
    folder: Path  # the stage's fresh run folder
    log: logging.Logger
    mlflow_run_id: str  # log step metrics here (with config.mlflow.tracking_uri), from any process
    fingerprint: str = ""
    resumed: bool = False  # a resumable stage continuing an attempt that did not finish (same MLflow run)

    @property
    def output(self) -> Path:
        """Where the stage's data goes (documents, shards, checkpoints)."""
        path = self.folder / "output"
        path.mkdir(exist_ok=True)
        return path

    def aside(self, reason: str) -> Path:
        """Where rows that leave the stage for `reason` are written (beside the output)."""
        path = self.folder / reason
        path.mkdir(exist_ok=True)
        return path

    def input_output(self, stage: str) -> Path:
        return Path(self.inputs[stage]["output"])


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]
    section: str | tuple[str, ...]  # the config section(s) whose values are part of the fingerprint
    run: Callable[[StageContext], StageResult]
    code: tuple[str, ...] = ()  # modules it runs by name, not by import: its code beside run's imports (code_modules)
    external: Callable[[Any], Any] | None = None  # identity of files read from outside the workdir
    resumable: bool = False  # a rerun after an unfinished attempt continues it (its MLflow run; the stage its own state)


class Tracker(Protocol):
    """What the runner needs from experiment tracking (core.tracking.MlflowTracker)."""

    def stage(self, name: str, params: dict, tags: dict, resume_run_id: str | None = None) -> Any: ...
    def log_metrics(self, metrics: dict[str, float]) -> None: ...
    def set_tag(self, key: str, value: str) -> None: ...
    def final_metrics(self, run_id: str) -> dict[str, float]: ...


@dataclass
class Plan:
    actions: dict[str, str]  # stage -> run | cached | not selected
    fingerprints: dict[str, str]
    damaged: dict[str, str] = field(default_factory=dict)  # stage -> why its cached output is rebuilt


@dataclass
class StageOutcome:
    stage: str
    status: str  # ran | cached
    fingerprint: str
    manifest: dict


def code_modules(stage: Stage, parsed: dict | None = None) -> dict[str, Path]:
    """{name: file} of the project's modules that are the stage's code: its run function's module and what it
    imports, transitively (core/imports.py), with the modules it names by hand (`Stage.code`) and theirs."""
    found: dict[str, Path] = {}
    for name in ([stage.run.__module__] if stage.run is not None else []) + list(stage.code):
        found.update(imported(name, parsed=parsed))
    return dict(sorted(found.items()))


def code_version(stage: Stage, parsed: dict | None = None) -> str:
    """Hash of the source of the stage's code modules: editing any of them reruns the stage."""
    digest = hashlib.sha256()
    for name, path in code_modules(stage, parsed).items():
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def fingerprints(config: Any, stages: list[Stage], parsed: dict | None = None) -> dict[str, str]:
    """Every stage's fingerprint, in DAG order (each depends on its inputs' fingerprints). `parsed`: each module's
    imports as read from its file (core/imports.py), read once for all the stages and kept for the caller's
    later `code_version` calls."""
    prints: dict[str, str] = {}
    parsed = {} if parsed is None else parsed
    for stage in stages:
        body = {
            "stage": stage.name,
            "config": section_dict(config, stage.section),
            "code": code_version(stage, parsed),
            "inputs": {name: prints[name] for name in stage.inputs},
            "external": stage.external(config) if stage.external else None,
        }
        prints[stage.name] = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    return prints


def check_dag(stages: list[Stage]) -> None:
    seen: set[str] = set()
    for stage in stages:
        missing = [i for i in stage.inputs if i not in seen]
        if missing:
            raise ValueError(f"stage {stage.name!r} reads {missing} which are not declared before it")
        if stage.name in seen:
            raise ValueError(f"stage {stage.name!r} is declared twice")
        seen.add(stage.name)


def select(stages: list[Stage], only: list[str] | None, from_: str | None) -> list[str]:
    """The stages asked for (all of them without --only/--from)."""
    names = [s.name for s in stages]
    if only and from_:
        raise UsageError("--only and --from cannot be used together")
    for name in list(only or []) + ([from_] if from_ else []):
        if name not in names:
            raise UsageError(f"unknown stage {name!r}; stages are: {', '.join(names)}")
    if only:
        return [n for n in names if n in only]
    if from_:
        return names[names.index(from_):]
    return names


class Workdir:
    """The on-disk contract of one workdir: completed outputs, the current one, partials."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

    def completed(self, stage: str, fingerprint: str) -> dict | None:
        """The manifest of a completed output with this fingerprint, or None."""
        path = self.stage_dir(stage) / fingerprint[:16] / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return self.located(manifest) if manifest.get("fingerprint") == fingerprint else None

    def current(self, stage: str) -> dict | None:
        try:
            return self.located(json.loads((self.stage_dir(stage) / "manifest.json").read_text()))
        except FileNotFoundError:
            return None

    def located(self, manifest: dict) -> dict:
        """The manifest with its output in this workdir, wherever the workdir was when it was written."""
        relative = manifest.get("output_in_workdir") or f"{manifest['stage']}/{manifest['fingerprint'][:16]}/output"
        return {**manifest, "output": str(self.root.absolute() / relative)}

    def damage(self, manifest: dict, full: bool = False) -> str | None:
        """Why a completed output does not match what was committed (naming the file), or None."""
        return outputs.damage(Path(manifest["output"]).parent, full)

    def make_current(self, manifest: dict) -> None:
        _write_json_atomic(self.stage_dir(manifest["stage"]) / "manifest.json", manifest)

    def new_partial(self, stage: str, fingerprint: str) -> Path:
        """A fresh folder for a stage to write into; earlier partials of the stage are removed."""
        stage_dir = self.stage_dir(stage)
        stage_dir.mkdir(parents=True, exist_ok=True)
        for old in stage_dir.glob(".partial-*"):
            shutil.rmtree(old, ignore_errors=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        path = stage_dir / f".partial-{fingerprint[:16]}-{stamp}"
        path.mkdir()
        return path

    def commit(self, partial: Path, manifest: dict) -> dict:
        """Manifest last, then the rename into place, then the switch of the current manifest."""
        final = self.stage_dir(manifest["stage"]) / manifest["fingerprint"][:16]
        manifest = {**manifest, "output": str(final / "output"),
                    "output_in_workdir": str(final.relative_to(self.root) / "output"),
                    "files": outputs.write_list(partial)}
        _write_json_atomic(partial / "manifest.json", manifest)
        if final.exists():  # --force over a completed output with the same fingerprint
            doomed = final.with_name(f".replaced-{final.name}-{time.time_ns()}")
            final.rename(doomed)
            partial.rename(final)
            shutil.rmtree(doomed, ignore_errors=True)
        else:
            partial.rename(final)
        self.make_current(manifest)
        return manifest


def _write_json_atomic(path: Path, data: dict) -> None:
    """`path` replaced whole, from a temp file made new (a fresh name, O_EXCL, O_NOFOLLOW): a link planted in the
    workdir under a temp file's name is never written through."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_MANIFEST_KEYS = ("stage", "fingerprint", "inputs", "config", "code_version", "counts", "metrics", "started",
                  "finished", "mlflow_run_id", "tags", "output", "output_in_workdir", "files")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Runner:
    """Runs a DAG of stages over one workdir, with caching, tracking and accounting."""

    def __init__(
        self,
        config: Any,
        stages: list[Stage],
        start_engines: Callable[[], None] = lambda: None,
        say: Callable[[str], None] = console.say,
    ):
        check_dag(stages)
        self.config = config
        self.stages = stages
        self.start_engines = start_engines  # Ray is started only when a stage actually runs
        self.say = say
        self.workdir = Workdir(config.workdir)
        # Each module's imports as read from its file, for this run's fingerprints and each manifest's code
        # version: a stage's code is read from source once a run, not once more per stage that runs (a stage
        # that imports pipelines/stages.py reaches 94 modules: 0.9 s each time on 2 cores). A file edited
        # meanwhile is read again (core/imports.py keys it by size and mtime).
        self.parsed: dict = {}

    def plan(self, only: list[str] | None = None, from_: str | None = None, force: bool = False,
             verify: bool = False) -> Plan:
        """What each stage will do, every cached output it uses checked (`verify`: read in full). Raises
        UsageError for a selection that cannot run, DamagedOutput for a damaged input that is not selected.
        Writes nothing."""
        selected = select(self.stages, only, from_)
        prints = fingerprints(self.config, self.stages, self.parsed)
        built = {stage.name: self.workdir.completed(stage.name, prints[stage.name]) for stage in self.stages}
        actions: dict[str, str] = {}
        damaged: dict[str, str] = {}
        for stage in self.stages:
            cached = built[stage.name]
            if stage.name not in selected:
                actions[stage.name] = "not selected"
            elif not force and cached is not None and (problem := self.workdir.damage(cached, verify)) is not None:
                actions[stage.name], damaged[stage.name] = "run", problem
            else:
                actions[stage.name] = "cached" if not force and cached is not None else "run"
        # A selected stage whose input is neither selected nor already built (and intact) cannot run.
        for stage in self.stages:
            if actions[stage.name] in ("run", "cached"):
                for name in stage.inputs:
                    if actions[name] != "not selected":
                        continue
                    if built[name] is None:
                        raise UsageError(
                            f"stage '{stage.name}' needs the output of '{name}' for the current config "
                            f"(fingerprint {prints[name][:12]}), which has not been built; "
                            f"run without --only, or with --from {name}"
                        )
                    if (problem := self.workdir.damage(built[name], verify)) is not None:
                        raise DamagedOutput(f"stage '{stage.name}' needs the output of '{name}', which is damaged: "
                                            f"{problem}; rebuild it with --from {name}")
        return Plan(actions, prints, damaged)

    def execute(self, plan: Plan, tracker: Tracker) -> list[StageOutcome]:
        outcomes: list[StageOutcome] = []
        available: dict[str, dict] = {}  # stage -> manifest usable as an input in this run
        for stage in self.stages:
            fp = plan.fingerprints[stage.name]
            action = plan.actions[stage.name]
            if action == "not selected":
                manifest = self.workdir.completed(stage.name, fp)
                if manifest is not None:
                    available[stage.name] = manifest
                continue
            inputs = {i: available[i] for i in stage.inputs}
            if action == "cached":
                manifest = self.workdir.completed(stage.name, fp)
                self.workdir.make_current(manifest)
                self._track_cache_hit(tracker, stage, manifest)
                self.say(f"[{stage.name}] cache hit ({fp[:12]}): {manifest['output']}")
                outcomes.append(StageOutcome(stage.name, "cached", fp, manifest))
            else:
                if stage.name in plan.damaged:
                    self.say(f"[{stage.name}] its cached output is damaged, rebuilding it: {plan.damaged[stage.name]}")
                manifest = self._execute(tracker, stage, fp, inputs)
                outcomes.append(StageOutcome(stage.name, "ran", fp, manifest))
            available[stage.name] = manifest
        return outcomes

    def _execute(self, tracker: Tracker, stage: Stage, fp: str, inputs: dict[str, dict]) -> dict:
        folder = self.workdir.new_partial(stage.name, fp)
        log_path = folder / "stage.log"
        with console.stage_log(log_path):
            self.start_engines()  # inside: the engines' start-up notices go to the first stage's log
            return self._run_logged(tracker, stage, fp, inputs, folder, log_path)

    def _run_logged(self, tracker: Tracker, stage: Stage, fp: str, inputs: dict[str, dict], folder: Path,
                    log_path: Path) -> dict:
        stage_log = logging.getLogger(f"pipelines.stage.{stage.name}")
        config_section = section_dict(self.config, stage.section, layout=True)
        started, t0 = _now(), time.perf_counter()
        attempt = self.workdir.stage_dir(stage.name) / f".attempt-{fp[:16]}.json"  # an unfinished run of this fingerprint
        resume = json.loads(attempt.read_text())["mlflow_run_id"] if stage.resumable and attempt.is_file() else None
        self.say(f"[{stage.name}] {'resuming' if resume else 'running'} ({fp[:12]}) in {folder}")
        with tracker.stage(
            stage.name,
            params=config_section,
            tags={"stage": stage.name, "fingerprint": fp, "cache_hit": "false"},  # + "counts" when done
            resume_run_id=resume,
        ) as run_id:
            try:
                if stage.resumable:
                    _write_json_atomic(attempt, {"mlflow_run_id": run_id, "started": started})
                first = stage.section[0] if isinstance(stage.section, tuple) else stage.section
                section = section_of(self.config, first)
                ctx = StageContext(stage.name, self.config, section, inputs, folder, stage_log, run_id, fp, bool(resume))
                result = stage.run(ctx)
                _check_result(stage.name, result)
                _check_read_something(result, inputs)
            except BaseException as exc:
                stage_log.error("stage failed:\n%s", traceback.format_exc())
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                raise StageFailed(stage.name, reason, folder, log_path) from exc
            seconds = time.perf_counter() - t0
            counts = result.counts()
            metrics = {**counts, **result.metrics, "seconds": seconds}
            if seconds > 0:
                metrics["rows_per_second"] = result.rows_in / seconds
            tracker.log_metrics(metrics)
            tracker.set_tag("counts", ",".join(counts))  # which metrics are row counts (pipelines/compare.py)
            for key, value in result.tags.items():
                tracker.set_tag(key, value)
            manifest = {
                "stage": stage.name,
                "fingerprint": fp,
                "inputs": {name: m["fingerprint"] for name, m in inputs.items()},
                "config": config_section,
                "code_version": code_version(stage, self.parsed),
                "counts": counts,
                "metrics": {k: v for k, v in metrics.items() if k not in counts},
                "started": started,
                "finished": _now(),
                "mlflow_run_id": run_id,
                "tags": result.tags,
                **{k: v for k, v in result.fields.items() if k not in _MANIFEST_KEYS},
            }
            manifest = self.workdir.commit(folder, manifest)
            attempt.unlink(missing_ok=True)
        aside = ", ".join(f"{k}={v}" for k, v in result.set_aside.items())
        self.say(
            f"[{stage.name}] done in {seconds:.1f}s: rows_in={result.rows_in} rows_out={result.rows_out}"
            + (f" {aside}" if aside else "")
            + (" (its input was empty)" if result.rows_in == 0 else "")
            + f" -> {manifest['output']}"
        )
        return manifest

    def _track_cache_hit(self, tracker: Tracker, stage: Stage, manifest: dict) -> None:
        with tracker.stage(
            stage.name,
            params=manifest["config"],
            tags={
                "stage": stage.name,
                "fingerprint": manifest["fingerprint"],
                "cache_hit": "true",
                "cached_from_run": str(manifest.get("mlflow_run_id")),
                "counts": ",".join(manifest["counts"]),
                **manifest.get("tags", {}),  # the reused run's own (its metrics below are too)
            },
        ):
            # every metric of the reused run, its workers' step by step ones as they ended too (the manifest has only
            # the stage's own), so that the cache hit's run reads like the one it reuses
            reused = tracker.final_metrics(str(manifest.get("mlflow_run_id")))
            tracker.log_metrics({**reused, **manifest["counts"], **manifest.get("metrics", {})})


def _check_result(stage: str, result: Any) -> None:
    if not isinstance(result, StageResult):
        raise TypeError(f"stage {stage!r} returned {type(result).__name__}, expected StageResult")
    counts = result.counts()
    bad = {k: v for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise ValueError(f"counts must be non-negative integers, got {bad}")
    accounted = result.rows_out + sum(result.set_aside.values())
    if result.rows_in != accounted:
        raise ValueError(
            f"counts do not add up: rows_in={result.rows_in} but rows_out + set aside = {accounted} ({counts})"
        )


def _check_read_something(result: StageResult, inputs: dict[str, dict]) -> None:
    """No rows read from an input that committed some: the input went missing or unreadable, it is not empty."""
    if result.rows_in:
        return
    for name, manifest in inputs.items():
        committed = manifest["counts"].get("rows_out", 0)
        if committed:
            raise ValueError(f"read 0 rows, but {name} committed {committed} in {manifest['output']}: that output is "
                             "missing or unreadable, not empty")


def audit(workdir: Workdir, stages: list[Stage], prints: dict[str, str], full: bool = False) -> tuple[list[str], bool]:
    """`full.py --check`: every stage's current output and every completed one, present and intact or not,
    and which of them this config would use; nothing is run or written. Returns the report's lines and
    whether everything found is intact."""
    lines, intact = [], True
    for stage in stages:
        this_built = False
        entries = sorted(workdir.stage_dir(stage.name).glob("*/manifest.json"))
        current = workdir.current(stage.name)
        lines.append(f"{stage.name}: " + (f"current {current['fingerprint'][:12]}" if current else "no current output")
                     + f", {len(entries)} completed output(s)")
        for path in entries:
            try:
                manifest = workdir.located(json.loads(path.read_text()))
            except (json.JSONDecodeError, KeyError) as exc:
                lines.append(f"  {path}: unreadable manifest ({exc})")
                intact = False
                continue
            problem = workdir.damage(manifest, full)
            intact = intact and problem is None
            this_built = this_built or manifest["fingerprint"] == prints[stage.name]
            marks = [m for m, on in (("current", current and current["fingerprint"] == manifest["fingerprint"]),
                                     ("this config's", manifest["fingerprint"] == prints[stage.name])) if on]
            rows = manifest.get("counts", {}).get("rows_out")
            lines.append(f"  {manifest['fingerprint'][:12]} {'/'.join(marks) or '-':<21} "
                         + (f"ok ({rows} rows out)" if problem is None else f"DAMAGED: {problem}"))
        if not this_built:
            lines.append(f"  {prints[stage.name][:12]} this config's         not built")
    return lines, intact


def iter_outcomes_table(outcomes: list[StageOutcome]) -> Iterator[str]:
    for o in outcomes:
        counts = " ".join(f"{k}={v}" for k, v in o.manifest["counts"].items())
        yield f"  {o.stage:<10} {o.status:<10} {counts:<40} {o.manifest['output']}"


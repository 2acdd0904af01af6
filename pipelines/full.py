"""The whole pipeline, one command: `python pipelines/full.py [--config ...] [options]`.

With no arguments: the embedded default (configs/local.yaml): local in-process Ray, the
generated sample corpus, a tiny model, MLflow in a sqlite file under the workdir. Under
`ray job submit` (RAY_ADDRESS set) the same code runs on the cluster.

Exit codes: 0 done; 2 bad config or arguments (one line naming the key); 1 a stage failed, or a cached
output that a stage needs is damaged and not selected to be rebuilt (`--check` names every damaged file).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":  # the pipeline's driver: one glibc arena, set before any import starts a thread
    from core.heap import one_arena  # (pyarrow's import starts two; core/heap.py)

    one_arena()

from core import locks
from core.config import ConfigError
from pipelines.config import PipelineConfig, check_inputs_exist, load_config
from pipelines import summary
from core.dag import DamagedOutput, Plan, Runner, Stage, StageFailed, UsageError, audit, fingerprints, iter_outcomes_table
from pipelines.config import CHECKS
from core.tracking import MAX_TAG_LENGTH, flatten, program, ui_hint, ui_link


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as for a bad config key
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = _Parser(prog="pipelines/full.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (default: configs/local.yaml)")
    p.add_argument("--workdir", help="where stage outputs, manifests and the local MLflow store go")
    p.add_argument("--only", help="run only these stages (comma-separated), from cached upstream outputs")
    p.add_argument("--from", dest="from_", metavar="STAGE", help="run this stage and everything after it")
    p.add_argument("--force", action="store_true", help="ignore the cache for the selected stages")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set dedup.threshold=0.9 (repeatable)")
    p.add_argument("--verbose", action="store_true", help="show Ray's own output (its loggers, and the workers', "
                   "raylet's and GCS's) on the terminal instead of only in the stage logs and Ray's session logs")
    p.add_argument("--force-layout", action="store_true", help="train with the configured GPU layout even when the "
                   "layout planner (python -m pipelines.plan) predicts it will not fit in GPU memory")
    p.add_argument("--check", action="store_true", help="run nothing: audit the workdir, every stage's current and "
                   "completed outputs against the files they were committed with, and say which this config would "
                   "use (exit 1 if any is damaged)")
    p.add_argument("--verify", action="store_true", help="check cached outputs in full (read every Parquet and Arrow "
                   "file) instead of by file list and sizes, before using them or with --check")
    p.add_argument("--ablation", metavar="NAME", help="name this run's data ablation: its MLflow runs are tagged with the "
                   "name and its differences from the config file (default: 'base' without --set, else the --set list); "
                   "compare ablations with pipelines/compare.py")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None, stages: tuple[Stage, ...] | None = None) -> int:
    """`stages`: the pipeline's (pipelines/stages.py's STAGES) unless given; imported after the arguments are
    parsed, so that --help and a bad flag answer before torch and Ray are imported."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad argument (2, one line already printed)
        return int(exc.code or 0)
    if stages is None:
        from pipelines.stages import STAGES

        stages = STAGES
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    try:
        config = load_config(args.config, args.overrides, args.workdir, checks=CHECKS)
        if args.check:
            return check(config, list(stages), args.verify)
        ablation = ablation_tags(args, config)
        if config.sample_corpus and not os.path.isdir(config.sample_corpus):
            from corpus.sample import SPIKY_EVERY, write_sample

            spiky = config.sample_spiky_subset
            print(f"generating the sample corpus in {config.sample_corpus}"
                  + (f" ({spiky} planted spiky, for the screen to find)" if spiky else ""))
            write_sample(config.sample_corpus, spiky={spiky: SPIKY_EVERY} if spiky else None)
        check_inputs_exist(config)
        return run(config, args, only, list(stages), ablation)
    except (ConfigError, UsageError, locks.WorkdirBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (StageFailed, DamagedOutput) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def check(config: PipelineConfig, stages: list[Stage], verify: bool) -> int:
    """`--check`: the workdir's outputs audited, nothing run (core/dag.py's audit). 0: all intact."""
    runner = Runner(config, stages)
    lines, intact = audit(runner.workdir, stages, fingerprints(config, stages), full=verify)
    print(f"workdir {config.workdir} ({'full check' if verify else 'files and sizes'}):")
    for line in lines:
        print(line)
    print("every output found is intact" if intact else "damaged outputs found: a run rebuilds those it selects; "
          "one it needs but does not select stops it")
    return 0 if intact else 1


def ablation_tags(args: argparse.Namespace, config: PipelineConfig) -> dict[str, str]:
    """{"ablation": name, "ablation.diff": "key: base -> this; ..."}: what this run changes in the config file."""
    base = flatten(dataclasses.asdict(load_config(args.config, [], args.workdir, checks=CHECKS)))
    this = flatten(dataclasses.asdict(config))
    diff = [f"{k}: {base.get(k, '(none)')} -> {v}" for k, v in this.items() if base.get(k) != v]
    diff += [f"{k}: {v} -> (none)" for k, v in base.items() if k not in this]
    name = args.ablation or ("base" if not diff else " ".join(args.overrides))
    return {"ablation": name, "ablation.diff": ("; ".join(diff) or "(none)")[:MAX_TAG_LENGTH]}


def run(config: PipelineConfig, args: argparse.Namespace, only: list[str] | None, stages: list[Stage],
        ablation: dict[str, str]) -> int:
    """The selected stages, one run at a time per workdir (core/locks.py)."""
    from core.ray_session import start_ray

    ray_started: list[bool] = []
    runner = Runner(config, stages, start_engines=lambda: ray_started or ray_started.append(start_ray(config.ray, args.verbose)))
    plan = runner.plan(only, args.from_, args.force, args.verify)  # a bad selection or input fails here, before any run
    os.makedirs(config.workdir, exist_ok=True)
    with locks.hold(config.workdir, f"{config.name} [{ablation['ablation']}]") as stale:
        if stale:
            print(f"taking over the workdir from a run that ended without releasing it ({stale})", file=sys.stderr)
        return run_locked(config, args, runner, plan, ablation, ray_started)


def run_locked(config: PipelineConfig, args: argparse.Namespace, runner: Runner, plan: Plan, ablation: dict[str, str],
               ray_started: list[bool]) -> int:
    """`run`'s plan carried out, the workdir held."""
    from core.tracking import MlflowTracker
    from pipelines.ablation_runs import save_view
    from pipelines.compare import headline
    from pipelines.ablations import of_pipeline_run

    layout_files = []
    if plan.actions.get("train") == "run":  # GPU training: its layout priced against the best (train/plan/planner.py)
        from train.plan.planner import startup_check

        layout_files = startup_check(config.train, config.tokenize.seq_len, args.config, args.force_layout,
                                     Path(config.workdir) / "plan")
    tracker = MlflowTracker(config.mlflow.tracking_uri, config.mlflow.experiment,
                            artifact_location=config.mlflow.artifact_location, tags=ablation)
    params = {"config": args.config or "configs/local.yaml", "workdir": config.workdir,
              "only": args.only, "from": args.from_, "force": args.force, "set": args.overrides}
    try:
        with tracker.pipeline(f"{config.name} [{ablation['ablation']}]", params=params, tags=_pipeline_tags(config)) as parent:
            outcomes = runner.execute(plan, tracker)
            table, funnel = summary.write(outcomes, Path(config.workdir))
            for path in (table, funnel, *layout_files):
                tracker.log_artifact(path)
            tracker.set_tag("mlflow.note.content", table.read_text())  # the run's description, on its Overview tab
            tracker.log_metrics({f"{o.stage}.{k}": v for o in outcomes for k, v in o.manifest["counts"].items()})
            figures = headline(of_pipeline_run(tracker.client, tracker.experiment_id, parent))
            tracker.log_metrics(figures)
            view = save_view(tracker.client, tracker.experiment_id, figures)
    finally:
        if any(ray_started):
            import ray

            ray.shutdown()
    print(f"\npipeline '{config.name}' finished; workdir {config.workdir} (summary: {summary.TABLE}, {summary.FUNNEL})")
    for line in iter_outcomes_table(outcomes):
        print(line)
    print(f"\nMLflow: experiment '{config.mlflow.experiment}', run {parent}, store {config.mlflow.tracking_uri}")
    print("  look at it with: " + ui_hint(config.mlflow.tracking_uri, tracker.experiment_id))
    print("  this run: " + ui_link(config.mlflow.tracking_uri, tracker.experiment_id, parent))
    if view:
        print("  every pipeline run's bits per byte and accuracy, side by side: "
              + ui_link(config.mlflow.tracking_uri, tracker.experiment_id, view=view))
    print(f"  ablation '{ablation['ablation']}'; compare ablations with: {program('python')} pipelines/compare.py"
          + (f" --config {args.config}" if args.config else ""))
    return 0


def _pipeline_tags(config: PipelineConfig) -> dict[str, str]:
    tags = {"kind": "pipeline", "config": config.name, "ray": os.environ.get("RAY_ADDRESS", "local")}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parents[1])
        if commit.returncode == 0:
            tags["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return tags


if __name__ == "__main__":
    raise SystemExit(main())

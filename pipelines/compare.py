"""Data ablations side by side: `python pipelines/compare.py [--config C] [--experiment E] [NAME ...]`.

An ablation is every pipeline run tagged with its name (`full.py --ablation NAME`; "base" for the
config file as it is). For each ablation and stage, the newest stage run among its pipeline runs
counts (ran or cache hit: a cache hit logs the counts of the output it reuses), so an ablation
built over several invocations (`--only dedup`, then the rest) is still one column. The table:
rows in and out and every reason rows left, per stage; the subsets the screen dropped; tokens
per source; final training loss (labelled: each ablation's own data, so not a comparison of
corpora) and validation losses; grad-norm spikes and autopilot interventions.
The PNG: each ablation's training loss against the step.

MLflow's own UI shows the same runs: every run carries the `ablation` tag (Group by: ablation).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import ConfigError, load_config
from pipelines.stages import CHECKS, STAGES


TRAIN_LOSS_ROW = "train final loss (own data: not comparable)"


@dataclass
class Ablation:
    name: str
    diff: str
    pipeline_runs: list[str] = field(default_factory=list)
    stages: dict[str, object] = field(default_factory=dict)  # stage -> its newest MLflow run
    loss: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss)


def collect(client, experiment_id: str, names: list[str] | None) -> list[Ablation]:
    """The ablations of an experiment (all, or those named, in that order), newest stage runs first."""
    parents = client.search_runs([experiment_id], "tags.kind = 'pipeline'", order_by=["attributes.start_time DESC"],
                                 max_results=5000)
    found: dict[str, Ablation] = {}
    for run in parents:
        name = run.data.tags.get("ablation")
        if name is None:
            continue
        ablation = found.setdefault(name, Ablation(name, run.data.tags.get("ablation.diff", "")))
        ablation.pipeline_runs.append(run.info.run_id)
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise LookupError(f"no pipeline run tagged ablation={missing[0]!r}; there are: {', '.join(sorted(found)) or 'none'}")
        chosen = [found[n] for n in names]
    else:
        chosen = sorted(found.values(), key=lambda a: (a.name != "base", a.name))
    for ablation in chosen:
        for parent in ablation.pipeline_runs:  # newest first: the first run of a stage found is the one shown
            for run in client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000):
                stage = run.data.tags.get("stage")
                if stage in {s.name for s in STAGES} and stage not in ablation.stages:
                    ablation.stages[stage] = run
        train = ablation.stages.get("train")
        if train is not None:
            source = train.data.tags.get("cached_from_run") if train.data.tags.get("cache_hit") == "true" else train.info.run_id
            history = client.get_metric_history(source, "loss")
            by_step = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # a redone step: its last value
            ablation.loss = sorted(by_step.items())
    return chosen


def rows(ablations: list[Ablation]) -> list[tuple[str, list[str]]]:
    """(label, one cell per ablation) for every quantity any of them has."""
    out: list[tuple[str, list[str]]] = []

    def add(label: str, stage: str, key: str, fmt=lambda v: f"{v:,.0f}") -> None:
        cells = []
        for a in ablations:
            run = a.stages.get(stage)
            value = run.data.metrics.get(key) if run is not None else None
            cells.append("-" if value is None else fmt(value))
        if any(c != "-" for c in cells):
            out.append((label, cells))

    def keys(stage: str, keep) -> list[str]:
        seen: list[str] = []
        for a in ablations:
            run = a.stages.get(stage)
            for key in sorted(run.data.metrics) if run is not None else []:
                if keep(run, key) and key not in seen:
                    seen.append(key)
        return seen

    for stage in (s.name for s in STAGES if s.name != "train"):
        counts = keys(stage, lambda run, key: key in run.data.tags.get("counts", "").split(","))
        for key in sorted(counts, key=lambda k: (k != "rows_in", k != "rows_out", k)):
            add(f"{stage} {key}", stage, key)
        if stage == "screen":
            out.append(("screen dropped subsets", [dropped_subsets(a) for a in ablations]))
    for key in keys("tokenize", lambda run, key: key.startswith("tokens.train.")):
        add(f"tokens {key.removeprefix('tokens.train.')}", "tokenize", key)
    add("train steps", "train", "steps")
    # each ablation's loss on its own training data: which corpus is better, it does not say
    add(TRAIN_LOSS_ROW, "train", "final_loss", lambda v: f"{v:.4f}")
    for key in keys("train", lambda run, key: key.startswith("val_loss")):
        add(f"validation loss{key.removeprefix('val_loss').replace('.', ' ')}", "train", key, lambda v: f"{v:.4f}")
    add("grad-norm spikes", "train", "spikes")
    add("grad-norm mean excess %", "train", "spike_excess", lambda v: f"{v:.2f}")
    add("interventions", "train", "interventions")
    return out


def dropped_subsets(ablation: Ablation) -> str:
    run = ablation.stages.get("screen")
    if run is None:
        return "-"
    return ", ".join(sorted(k.split(".", 1)[1] for k, v in run.data.metrics.items() if k.startswith("dropped.") and v > 0)) or "none"


def table(ablations: list[Ablation]) -> str:
    body = rows(ablations)
    header = ["", *(a.name for a in ablations)]
    widths = [max(len(header[0]), *(len(label) for label, _ in body))]
    widths += [max(len(a.name), *(len(cells[i]) for _, cells in body)) for i, a in enumerate(ablations)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for label, cells in body:
        lines.append("  ".join([label.ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells, widths[1:]))]))
    lines.append("")
    lines += [f"{a.name}: {a.diff or '(none)'}" for a in ablations]
    return "\n".join(lines)


def plot(ablations: list[Ablation], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [a for a in ablations if a.loss]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for a in curves:
        steps, values = zip(*a.loss)
        ax.plot(steps, values, label=a.name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("data ablations")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipelines/compare.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help="ablations to compare (default: all, base first)")
    p.add_argument("--config", help="the pipeline config whose MLflow store and experiment to read (default: configs/local.yaml)")
    p.add_argument("--workdir", help="as given to full.py (its MLflow store is under it by default)")
    p.add_argument("--experiment", help="MLflow experiment (default: the config's)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: the config's)")
    p.add_argument("--out", default="ablations.png", help="the loss-curve chart (default: ablations.png)")
    args = p.parse_args(argv)
    try:
        config = load_config(args.config, [], args.workdir, checks=CHECKS)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mlflow import MlflowClient

    client = MlflowClient(args.tracking_uri or config.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment or config.mlflow.experiment)
    if experiment is None:
        print(f"error: no MLflow experiment {args.experiment or config.mlflow.experiment!r} in "
              f"{args.tracking_uri or config.mlflow.tracking_uri}", file=sys.stderr)
        return 2
    try:
        ablations = collect(client, experiment.experiment_id, args.names)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ablations:
        print(f"error: no pipeline runs in experiment {experiment.name!r}", file=sys.stderr)
        return 2
    print(table(ablations))
    chart = plot(ablations, Path(args.out))
    print(f"\nloss curves: {chart}" if chart else "\nno training runs to plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Data ablations side by side: `python pipelines/compare.py [--config C] [--experiment E] [NAME ...]`.

An ablation is every pipeline run tagged with its name (`full.py --ablation NAME`; "base" for the
config file as it is), read from MLflow by pipelines/ablations.py: one column each.

The first table: rows in and out and every reason rows left, per stage; the subsets the screen
dropped; tokens per source; final training loss (labelled: each ablation's own data, so not a
comparison of corpora); grad-norm spikes and autopilot interventions.

The second: bits per byte on the held-out evaluation set (corpus/evalset.py; each document's `</s>` not
scored), for the whole set (weighted by bytes), its macro average over the domains (each source, or each subset
of a source that has them, weighing the same), each source and each subset, with each row's size (documents,
bytes, tokens scored); each cell the mean over the training seeds (`train.seeds`) with its interval, and for each
ablation its difference from the first (base) with a verdict: `worse` or `better` when the difference's interval
excludes 0, else `within noise`. The third: the downstream tasks (`eval.downstream.tasks`, lm-evaluation-harness's
accuracy per seed), the same way, higher being better.

The rule (core/stats.py `difference`): an ablation that shares at least 3 of base's seeds is paired on them, and
judged by the spread of its own per-seed differences (Student t, n - 1 degrees of freedom); one that does not,
by Welch's t over the two groups. Nothing is pooled across ablations: an ablation noisier than the others keeps
its own, wider, interval, and cannot narrow theirs. Each table holds a 5% family-wise error rate over all of its
comparisons (Bonferroni over every ablation x row): a table of null ablations says `within noise` everywhere 95%
of the time, which benchmarks/ablation_noise.py measures on this path (docs/benchmarks.md). Under 3 seeds there is
no verdict (`not enough seeds`: one degree of freedom would give an interval of +-100); nor for a spread of exactly
0 (`no verdict (zero spread)`), nor for a row with a NaN or infinite seed (`failed seed S`). Runs identical to
base's, bit for bit, are `within noise`. An ablation's seeds are pooled over its runs on the same training data
(pipelines/ablations.py). Only finished runs count; a missing reference (base, or the first ablation named) or
one without a training run, runs evaluated on different sets (their `eval.fingerprint` tags differ), and an
ablation's runs on different data (`data.fingerprint`) are refused (exit 2). The statistics are core/stats.py's,
the screen's too.

The PNG: bits per byte per row and downstream accuracy per task with the intervals, and each ablation's training
loss against the step.

In MLflow (pipelines/ablation_runs.py): each call makes one comparison run in the ablations' experiment, or updates
the one these ablations already have, holding the three tables, each verdict as a tag, the chart and links to the runs
compared; it prints the link that opens it. A refused comparison logs nothing. Every pipeline run carries its own
headline figures (`bpb.<row>`, `accuracy.<task>`: the mean over its seeds, `.ci95`, `.seeds`) and the `ablation` tag.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from core import stats
from core.stats import Difference

if TYPE_CHECKING:  # imported where used: pipelines.ablations imports MLflow and the stages (torch, Ray)
    from pipelines.ablations import Ablation


TRAIN_LOSS_ROW = "train final loss (own data: not comparable)"
ALPHA = 0.05  # each table's family-wise error rate
MACRO = "all, macro"  # the mean over the domains (each source, or each subset of a source that has them)


@dataclass(frozen=True)
class Measure:
    """One table of scores per seed: bits per byte (lower is better) or downstream accuracy (higher is)."""

    title: str
    short: str  # its name in MLflow's metrics and tags (headline, the comparison run's verdicts)
    attr: str  # Ablation's {row: one value per seed} ...
    seeds_attr: str  # ... of these seeds
    lower_is_better: bool
    digits: int

    def values(self, ablation: Ablation) -> dict[str, list[float]]:
        return getattr(ablation, self.attr)

    def seeds(self, ablation: Ablation) -> list[int]:
        return getattr(ablation, self.seeds_attr)

    def verdict(self, d: Difference) -> str:
        if d.side == stats.WITHIN:
            return "within noise"
        if d.side in (stats.ABOVE, stats.BELOW):
            return "worse" if (d.side == stats.ABOVE) == self.lower_is_better else "better"
        return d.side  # why there is none ("not enough seeds (2; 3 decide)", ...)


@dataclass
class Table:
    """One of compare.py's tables as data: printed as text, logged to MLflow as a table (`columns`) and as Markdown
    in the comparison run's description, and the verdicts it reached, {(ablation, row): verdict}."""

    title: str  # the name of its first column, and of its MLflow table ("stages", "bits per byte", ...)
    short: str  # the prefix of its verdicts' tags ("bpb", "accuracy"; "" for a table without verdicts)
    header: list[str]
    body: list[list[str]]
    notes: list[str]
    verdicts: dict[tuple[str, str], str] = field(default_factory=dict)  # keyed by row_name
    judged: int = 0  # its last columns, the differences and verdicts: first after the row's name in MLflow's table

    def text(self) -> str:
        widths = [max(len(r[i]) for r in [self.header, *self.body]) for i in range(len(self.header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [self.header, *self.body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + ([""] + self.notes if self.notes else []))

    def markdown(self) -> str:
        def row(cells: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        lines = [row(self.header), "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.header))) + "|"]
        return "\n".join(lines + [row(r) for r in self.body] + ([""] + self.notes if self.notes else []))

    def columns(self) -> dict[str, list[str]]:
        """{column: its cells}, each name once (a header that repeats, "verdict" for each of several ablations, gets
        the header before it in brackets: "verdict (vs base: no-screen)"), the verdicts next to the row's name:
        MLflow's table view is narrower than the text."""
        names: list[str] = []
        for i, name in enumerate(self.header):
            name = name or self.title
            names.append(f"{name} ({self.header[i - 1]})" if self.header.count(name) > 1 else name)
        cut = len(names) - self.judged
        order = [0, *range(cut, len(names)), *range(1, cut)]
        return {names[i]: [r[i] for r in self.body] for i in order}


BPB = Measure("bits per byte", "bpb", "bpb", "seeds", lower_is_better=True, digits=4)
DOWNSTREAM = Measure("downstream accuracy", "accuracy", "downstream", "downstream_seeds", lower_is_better=False, digits=3)


def verdict(d: Difference) -> str:
    return BPB.verdict(d)


def score_rows(ablations: list[Ablation], measure: Measure = BPB) -> list[str]:
    """Every row any ablation has: the whole set first (and its macro average), then sources and their subsets,
    alphabetically."""
    found = {row for a in ablations for row in measure.values(a)}
    return sorted(found, key=lambda r: (r not in ("", MACRO), r != "", r.split(".")[0], "." in r, r))



def with_macro(ablation: Ablation) -> Ablation:
    """The ablation with its bits per byte's macro average as a row of its own: per seed, the mean over the
    domains (the leaf rows: each subset of a source that has subsets, else the source), so that a small domain
    weighs as much as a large one, where the whole set's row weighs each by its bytes."""
    rows = [r for r in ablation.bpb if r and not any(o.startswith(r + ".") for o in ablation.bpb)]
    if len(rows) < 2:
        return ablation
    macro = list(np.mean([ablation.bpb[r] for r in rows], axis=0))
    return dataclasses.replace(ablation, bpb={**ablation.bpb, MACRO: macro})


def verdicts(scored: list[Ablation], measure: Measure = BPB) -> tuple[list[str], float, dict[str, dict[str, Difference]]]:
    """The rows, the error rate of each comparison (ALPHA over every ablation x row of the table: Bonferroni), and
    {ablation: {row: its Difference from the first ablation's}} for every other ablation. An ablation that shares
    at least MIN_SEEDS of the base's seeds is paired on them, each judged by its own noise (core.stats.difference)."""
    base, others = scored[0], scored[1:]
    rows = score_rows(scored, measure)
    alpha = ALPHA / max(1, len(rows) * len(others))
    out: dict[str, dict[str, Difference]] = {a.name: {} for a in others}
    theirs_all = measure.values(base)
    for a in others:
        shared = [s for s in measure.seeds(base) if s in measure.seeds(a)]
        paired = len(shared) >= stats.MIN_SEEDS
        mine_all = measure.values(a)
        for row in rows:
            if row not in theirs_all or row not in mine_all:
                continue
            sides = [(by_seed(measure.seeds(x), values[row], shared) if paired else (values[row], measure.seeds(x)), x.name)
                     for x, values in ((a, mine_all), (base, theirs_all))]
            failed = [(stats.failed_seed(v, s), who) for (v, s), who in sides]
            failed = [(seed, who) for seed, who in failed if seed is not None]
            if failed:  # no verdict: a NaN would make the interval NaN, and the verdict `within noise`
                out[a.name][row] = Difference(float("nan"), float("nan"), f"failed seed {failed[0][0]} ({failed[0][1]})")
            else:
                out[a.name][row] = stats.difference(sides[1][0][0], sides[0][0][0], alpha, paired)
    return rows, alpha, out


def by_seed(own: list[int], values: list[float], seeds: list[int]) -> tuple[list[float], list[int]]:
    """Values, one per seed of `own`, for `seeds`, in that order (and the seeds)."""
    value = dict(zip(own, values))
    return [value[s] for s in seeds], seeds


def sizes(ablation: Ablation) -> dict[str, list[str]]:
    """{row: [documents, bytes, tokens]} of the evaluation set, from the training run's `eval.size.*` metrics."""
    run = ablation.stages.get("train")
    metrics = run.data.metrics if run is not None else {}
    out: dict[str, list[str]] = {}
    for i, what in enumerate(("documents", "bytes", "tokens")):
        for key, value in metrics.items():
            if key == f"eval.size.{what}" or key.startswith(f"eval.size.{what}."):
                row = key[len(f"eval.size.{what}") + 1:]
                out.setdefault(row, ["-", "-", "-"])[i] = f"{value:,.0f}"
    return out


def score_table(ablations: list[Ablation], measure: Measure = BPB) -> Table | None:
    """A table of scores per seed (bits per byte, or downstream accuracy): each ablation's mean ± its interval, and
    each other's difference from the first with its verdict; None when no ablation has such scores."""
    scored = [with_macro(a) if measure is BPB else a for a in ablations if measure.values(a)]
    if not scored:
        return None
    base, others = scored[0], scored[1:]
    rows, alpha, found = verdicts(scored, measure)
    size = sizes(base) if measure is BPB else {}
    size_header = ["documents", "bytes", "tokens"] if size else []
    header = [measure.title, *size_header, *(a.name for a in scored)]
    for a in others:
        header += [f"vs {base.name}: {a.name}", "verdict"]
    digits = measure.digits
    body, judged = [], {}
    for row in rows:
        cells = [row or "all"] + ((size.get(row, ["-"] * 3) if row != MACRO else ["-"] * 3) if size else [])
        for a in scored:
            values = measure.values(a).get(row)
            half = stats.mean_interval(values, ALPHA) if values else float("nan")
            cells.append("-" if not values else f"{np.mean(values):.{digits}f}" + (f"±{half:.{digits}f}" if np.isfinite(half) else ""))
        for a in others:
            d = found[a.name].get(row)
            shown = "-" if d is None or not np.isfinite(d.delta) else f"{d.delta:+.{digits}f}" + (f"±{d.half:.{digits}f}" if np.isfinite(d.half) else "")
            cells += ["-", "-"] if d is None else [shown, measure.verdict(d)]
            if d is not None:
                judged[(a.name, row_name(row))] = measure.verdict(d)
        body.append(cells)
    seeds = "; ".join(f"{a.name}: seeds {','.join(map(str, measure.seeds(a)))}" for a in scored)
    what = (f"evaluation set eval.fingerprint={base.fingerprint}" if measure is BPB
            else f"tasks: {', '.join(r for r in rows)}")
    notes = [f"{what}; {seeds}.",
             f"Each column: the mean over its seeds ± its 95% interval. vs {base.name}: the difference ± its interval at a "
             f"{ALPHA:.0%} family-wise error rate for the table (Bonferroni over its {len(rows)} rows x {len(others)} "
             f"ablation(s): {alpha:.2g} each); paired t over the seeds shared with {base.name}, each ablation by its own "
             f"noise (Welch's t for one that shares fewer than {stats.MIN_SEEDS}); worse or better: the interval excludes 0"
             + (f"; {MACRO}: the mean over the domains, each source or subset weighing the same" if MACRO in rows else "")
             + "."]
    return Table(measure.title, measure.short, header, body, notes, judged, judged=2 * len(others))


def row_name(row: str) -> str:
    """A row as MLflow's names carry it (headline figures, verdict tags): "all" for the whole set, "macro" for its
    macro average, else the source or `source.subset`."""
    return {"": "all", MACRO: "macro"}.get(row, row)


def headline(ablation: Ablation) -> dict[str, float]:
    """A pipeline run's headline figures, from its own seeds: for each row of the bits-per-byte table `bpb.<row>`
    (`bpb.all`, `bpb.macro`, `bpb.<source>`, `bpb.<source>.<subset>`) and for each downstream task
    `accuracy.<task>`, the mean over the seeds, with `<name>.ci95` (the half-width of its 95% Student t interval;
    none under 2 seeds) and `<name>.seeds`. On the pipeline run, beside the stage counts, MLflow's runs table and
    Compare view show them for every ablation side by side."""
    out: dict[str, float] = {}
    for measure in (BPB, DOWNSTREAM):
        for row, values in measure.values(with_macro(ablation) if measure is BPB else ablation).items():
            name = f"{measure.short}.{row_name(row)}"
            out[name] = float(np.mean(values))
            out[f"{name}.seeds"] = len(values)
            half = stats.mean_interval(values, ALPHA)
            if np.isfinite(half):
                out[f"{name}.ci95"] = half
    return out


def bpb_table(ablations: list[Ablation]) -> str:
    found = score_table(ablations, BPB)
    return found.text() if found else ""


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

    from pipelines.stages import STAGES

    for stage in (s.name for s in STAGES if s.name not in ("train", "downstream")):  # rows of documents, not models
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
    add("eval loss per token (whole set)", "train", "eval.loss", lambda v: f"{v:.4f}")
    add("grad-norm spikes", "train", "spikes")
    add("grad-norm mean excess %", "train", "spike_excess", lambda v: f"{v:.2f}")
    add("interventions", "train", "interventions")
    return out


def dropped_subsets(ablation: Ablation) -> str:
    run = ablation.stages.get("screen")
    if run is None:
        return "-"
    return ", ".join(sorted(k.split(".", 1)[1] for k, v in run.data.metrics.items() if k.startswith("dropped.") and v > 0)) or "none"


def stage_table(ablations: list[Ablation]) -> Table:
    """The first table: the stages' counts, the screen's drops, tokens per source and the training runs' own figures;
    and each ablation's differences from the config file."""
    return Table("stages", "", ["", *(a.name for a in ablations)], [[label, *cells] for label, cells in rows(ablations)],
                 [f"{a.name}: {a.diff or '(none)'}" for a in ablations])


def plot(ablations: list[Ablation], path: Path) -> Path | None:
    """Bits per byte per row and downstream accuracy per task, each ablation's mean with its 95% interval over
    seeds; and the training losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [a for a in ablations if a.loss]
    panels = [(m, [with_macro(a) if m is BPB else a for a in ablations if m.values(a)]) for m in (BPB, DOWNSTREAM)]
    panels = [(m, scored) for m, scored in panels if scored]
    if not curves and not panels:
        return None
    widths = [3] * len(panels) + [2]
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 5), gridspec_kw={"width_ratios": widths})
    for (measure, scored), bars in zip(panels, axes):
        rows = score_rows(scored, measure)
        for k, a in enumerate(scored):
            values = measure.values(a)
            x = np.arange(len(rows)) + (k - (len(scored) - 1) / 2) * 0.8 / max(1, len(scored))
            means = [np.mean(values[r]) if r in values else np.nan for r in rows]
            halves = [stats.mean_interval(values[r], ALPHA) if r in values else np.nan for r in rows]
            bars.errorbar(x, means, yerr=np.nan_to_num(halves), fmt="o", capsize=3, label=f"{a.name} ({len(measure.seeds(a))} seeds)")
        bars.set_xticks(np.arange(len(rows)), [r or "all" for r in rows], rotation=60, ha="right", fontsize=8)
        bars.set_ylabel(measure.title + (" (held-out set)" if measure is BPB else ""))
        bars.set_title(f"{measure.title}: mean and 95% interval over seeds")
        bars.grid(alpha=0.3, axis="y")
        bars.legend(fontsize=8)
    losses = axes[-1]
    for a in curves:
        steps, values = zip(*a.loss)
        losses.plot(steps, values, label=a.name, linewidth=1.2)
    losses.set_xlabel("step")
    losses.set_ylabel("training loss (each on its own data)")
    losses.set_title("training")
    losses.grid(alpha=0.3)
    if curves:
        losses.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="pipelines/compare.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help="ablations to compare (default: all, base first)")
    p.add_argument("--config", help="the pipeline config whose MLflow store and experiment to read (default: configs/local.yaml)")
    p.add_argument("--workdir", help="as given to full.py (its MLflow store is under it by default)")
    p.add_argument("--experiment", help="MLflow experiment (default: the config's)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: the config's)")
    p.add_argument("--out", default="ablations.png",
                   help="the chart: bits per byte, downstream accuracy and training loss (default: ablations.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # after the arguments: these import MLflow and the stages
    from core.tracking import ui_hint, ui_link
    from pipelines.ablation_runs import SAVED_VIEW, VIEW, log_comparison
    from pipelines.ablations import Unreadable, read, store

    try:
        where = store(config=args.config, workdir=args.workdir, experiment=args.experiment, tracking_uri=args.tracking_uri)
        ablations = read(args.names, where=where)
    except Unreadable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tables = [stage_table(ablations)]
    printed = [tables[0].text()]
    for measure, missing in ((BPB, "no evaluation on the held-out set to compare (train stage not run)"),
                             (DOWNSTREAM, "no downstream tasks to compare (downstream stage not run, or "
                                          "eval.downstream.tasks empty)")):
        found = score_table(ablations, measure)
        tables += [found] if found else []
        printed.append(found.text() if found else missing)
    text = "\n\n".join(printed)
    print(text)
    chart = plot(ablations, Path(args.out))
    print(f"\nchart: {chart}" if chart else "\nno training runs to plot")
    command = " ".join(["pipelines/compare.py", *(argv if argv is not None else sys.argv[1:])])
    run_id = log_comparison(where, ablations, [*tables[1:], tables[0]], text, chart, command)
    print(f"\nMLflow: comparison run {run_id} in experiment '{where.experiment}' (made, or updated when asked again)")
    print("  look at it with: " + ui_hint(where.uri, where.experiment_id, run_id))
    if SAVED_VIEW + VIEW in where.client.get_experiment(where.experiment_id).tags:
        print("  every pipeline run's bits per byte and accuracy, side by side: "
              + ui_link(where.uri, where.experiment_id, view=VIEW))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

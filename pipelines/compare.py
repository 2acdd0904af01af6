"""Data ablations side by side: `python pipelines/compare.py [--config C] [--experiment E] [NAME ...]`.

An ablation is every pipeline run tagged with its name (`full.py --ablation NAME`; "base" for the
config file as it is), read from MLflow by pipelines/ablations.py: one column each.

The first table: rows in and out and every reason rows left, per stage; the subsets the screen
dropped; tokens per source; final training loss (labelled: each ablation's own data, so not a
comparison of corpora); grad-norm spikes and autopilot interventions.

The second: bits per byte on the held-out evaluation set (corpus/evalset.py), for the whole set,
each source and each subset, as the mean over the training seeds (`train.seeds`) with its interval,
and for each ablation its difference from the first (base) with a verdict: `worse` or `better` when
the difference's interval excludes 0, else `within noise`. The intervals are Student t over the
seeds: paired (each seed's difference from base) when an ablation ran base's seeds, as by default,
with the spread of those differences pooled over every such ablation in the table (Dunnett's
many-to-one setting: more ablations, more degrees of freedom), Welch's otherwise; at a 5%
family-wise error rate for each ablation (Bonferroni over its rows), so that a null ablation says
`within noise` on all of its rows 95% of the time. Runs identical to base's, bit for bit, are
`within noise` and left out of the pooled spread. One seed gives no interval and no verdict; so does a
spread of exactly 0 (`no verdict (zero spread)`), and a NaN or infinite seed (`failed seed S`: left out of the
pooled spread too). Only finished runs count; a missing reference (base, or the first ablation named) or one
without a training run, and runs evaluated on different sets (their `eval.fingerprint` tags differ), are
refused (exit 2). The statistics are
core/stats.py's, the screen's too.

The PNG: bits per byte per row with the intervals, and each ablation's training loss against the step.

MLflow's own UI shows the same runs: every run carries the `ablation` tag (Group by: ablation).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from core import stats
from core.stats import Difference
from pipelines.ablations import Ablation, Unreadable, read
from pipelines.stages import STAGES


TRAIN_LOSS_ROW = "train final loss (own data: not comparable)"
ALPHA = 0.05  # the table's family-wise error rate
# A difference in bits per byte from the base: above 0 is worse, below better (core.stats.side).
VERDICT = {stats.ABOVE: "worse", stats.BELOW: "better", stats.WITHIN: "within noise"}


def verdict(d: Difference) -> str:
    return VERDICT.get(d.side, d.side)  # or why there is none ("no interval (1 seed)")


def bpb_rows(ablations: list[Ablation]) -> list[str]:
    """Every row any ablation has: the whole set first, then sources and their subsets, alphabetically."""
    found = {row for a in ablations for row in a.bpb}
    return sorted(found, key=lambda r: (r != "", r.split(".")[0], "." in r, r))


def verdicts(scored: list[Ablation]) -> tuple[list[str], float, dict[str, dict[str, Difference]]]:
    """The rows, the error rate of each comparison (ALPHA over an ablation's rows: Bonferroni), and {ablation: {row:
    its Difference from the first ablation's}} for every other ablation. The ablations that ran the base's seeds
    share one estimate of the noise per row (paired_noise), as Dunnett's many-to-one comparisons do."""
    base, others = scored[0], scored[1:]
    rows = bpb_rows(scored)
    alpha = ALPHA / max(1, len(rows))
    out: dict[str, dict[str, Difference]] = {a.name: {} for a in others}
    for row in rows:
        if row not in base.bpb:
            continue
        failed = {a.name: stats.failed_seed(a.bpb[row], a.seeds) for a in scored if row in a.bpb}
        paired = [a for a in others if a.seeds == base.seeds and row in a.bpb and failed[a.name] is None]
        noise = stats.paired_noise(base.bpb[row], [a.bpb[row] for a in paired])
        for a in others:
            if row not in a.bpb:
                continue
            if failed[base.name] is not None or failed[a.name] is not None:  # no verdict, and none of the pooled noise
                who = a if failed[a.name] is not None else base
                out[a.name][row] = Difference(float("nan"), float("nan"), f"failed seed {failed[who.name]} ({who.name})")
            else:
                out[a.name][row] = stats.difference(base.bpb[row], a.bpb[row], alpha, noise if a in paired else None)
    return rows, alpha, out


def bpb_table(ablations: list[Ablation]) -> str:
    """The second table (bits per byte, differences, verdicts); "" when no ablation has an evaluation."""
    scored = [a for a in ablations if a.bpb]
    if not scored:
        return ""
    base, others = scored[0], scored[1:]
    rows, alpha, found = verdicts(scored)
    header = ["bits per byte", *(a.name for a in scored)]
    for a in others:
        header += [f"vs {base.name}: {a.name}", "verdict"]
    body = []
    for row in rows:
        cells = [row or "all"]
        for a in scored:
            values = a.bpb.get(row)
            half = stats.mean_interval(values, ALPHA) if values else float("nan")
            cells.append("-" if not values else f"{np.mean(values):.4f}" + (f"±{half:.4f}" if np.isfinite(half) else ""))
        for a in others:
            d = found[a.name].get(row)
            shown = "-" if d is None or not np.isfinite(d.delta) else f"{d.delta:+.4f}" + (f"±{d.half:.4f}" if np.isfinite(d.half) else "")
            cells += ["-", "-"] if d is None else [shown, verdict(d)]
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    seeds = "; ".join(f"{a.name}: seeds {','.join(map(str, a.seeds))}" for a in scored)
    lines += ["", f"evaluation set eval.fingerprint={base.fingerprint}; {seeds}.",
              f"Each column: the mean over its seeds ± its 95% interval. vs {base.name}: the difference ± its interval at a "
              f"{ALPHA:.0%} family-wise error rate for each ablation (Bonferroni over its {len(rows)} rows: {alpha:.2g} each); "
              "paired t over the seeds, the noise pooled over the ablations that ran the same seeds (Welch's t for one that "
              "did not); worse or better: the interval excludes 0."]
    return "\n".join(lines)


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
    """Bits per byte per row, each ablation's mean with its 95% interval over seeds; and the training losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [a for a in ablations if a.loss]
    scored = [a for a in ablations if a.bpb]
    if not curves and not scored:
        return None
    fig, (bars, losses) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    rows = bpb_rows(scored)
    for k, a in enumerate(scored):
        x = np.arange(len(rows)) + (k - (len(scored) - 1) / 2) * 0.8 / max(1, len(scored))
        means = [np.mean(a.bpb[r]) if r in a.bpb else np.nan for r in rows]
        halves = [stats.mean_interval(a.bpb[r], ALPHA) if r in a.bpb else np.nan for r in rows]
        bars.errorbar(x, means, yerr=np.nan_to_num(halves), fmt="o", capsize=3, label=f"{a.name} ({len(a.seeds)} seeds)")
    bars.set_xticks(np.arange(len(rows)), [r or "all" for r in rows], rotation=60, ha="right", fontsize=8)
    bars.set_ylabel("bits per byte (held-out set)")
    bars.set_title("evaluation: mean and 95% interval over seeds")
    bars.grid(alpha=0.3, axis="y")
    if scored:
        bars.legend(fontsize=8)
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
        ablations = read(args.names, config=args.config, workdir=args.workdir, experiment=args.experiment,
                         tracking_uri=args.tracking_uri)
    except Unreadable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(ablations))
    scores = bpb_table(ablations)
    print("\n" + (scores or "no evaluation on the held-out set to compare (train stage not run)"))
    chart = plot(ablations, Path(args.out))
    print(f"\nchart: {chart}" if chart else "\nno training runs to plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

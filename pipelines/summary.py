"""A pipeline run's summary for people: the stage table (markdown) and a funnel of rows (PNG), written
to the workdir and attached to the run's parent MLflow run.

The funnel has two panels: each stage's rows in, out and set aside by reason (rejected,
duplicate, dropped, ...), as the manifests count them; and each source's documents after every
stage that writes documents (the `source` column of its output, design.md's contract), so that
"where did Reddit go" is one glance. Both are read from the stages' completed outputs, cached or
not, so a rerun that was all cache hits still has its summary.
"""

from __future__ import annotations

from pathlib import Path

DOCUMENT_STAGES = ("ingest", "normalize", "dedup", "screen")  # their outputs are documents with a `source`
TABLE, FUNNEL = "stages.md", "funnel.png"


def stage_table(outcomes, workdir: Path) -> str:
    """One markdown row per stage: whether it ran, rows in and out, every reason rows were set aside, and
    its output (relative to the workdir)."""
    lines = [f"Workdir `{workdir}`", "",
             "| stage | status | rows in | rows out | set aside | seconds | output |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        counts = o.manifest["counts"]
        aside = ", ".join(f"{k} {v:,}" for k, v in counts.items() if k not in ("rows_in", "rows_out") and v) or "-"
        seconds = o.manifest.get("metrics", {}).get("seconds")  # a cache hit: the run that made the output
        took = f"{seconds:.1f}" if seconds is not None else "-"
        output = Path(o.manifest["output"])
        shown = output.relative_to(workdir) if output.is_relative_to(workdir) else output
        lines.append(f"| {o.stage} | {o.status} | {counts['rows_in']:,} | {counts['rows_out']:,} | {aside} | {took} "
                     f"| `{shown}` |")
    return "\n".join(lines) + "\n"


def documents_by_source(outcomes) -> dict[str, dict[str, int]]:
    """{stage: {source: documents in its output}} for the document stages of this run. A row group whose `source`
    statistics say one value (every part is one source's: each task writes one source's documents) is counted from
    its footer; any other row group's `source` is read alone. A dataset scan of the column left the driver 12 MB
    larger at 0.6M documents than at 0.15M, nothing of it live (the scanner's read-ahead buffers, kept by Arrow's
    allocator; docs/benchmarks.md)."""
    import collections

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        parts = sorted(Path(o.manifest["output"]).glob("*.parquet"))
        if o.stage not in DOCUMENT_STAGES or not parts:
            continue
        counts: collections.Counter = collections.Counter()
        for part in parts:
            file = pq.ParquetFile(part)
            if "source" not in file.schema_arrow.names:  # not documents (a test's own stages)
                break
            column = file.schema_arrow.get_field_index("source")
            for i in range(file.metadata.num_row_groups):
                group = file.metadata.row_group(i)
                stats = group.column(column).statistics
                if stats is not None and stats.has_min_max and stats.min == stats.max and stats.null_count == 0:
                    counts[stats.min] += group.num_rows
                    continue
                values = file.read_row_group(i, columns=["source"], use_threads=False).column("source")
                counts.update({row["values"]: row["counts"] for row in pc.value_counts(values).to_pylist()})
        else:
            out[o.stage] = dict(counts)
    return out


def funnel(outcomes, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(outcomes)
    by_source = documents_by_source(outcomes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.55 * max(4, len(stages)) + 2.5),
                                      gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.get_cmap("tab10").colors
    reasons = sorted({k for o in stages for k in o.manifest["counts"] if k not in ("rows_in", "rows_out")})
    color_of = {r: colors[(i + 1) % len(colors)] for i, r in enumerate(reasons)}
    for y, o in enumerate(stages):
        counts = o.manifest["counts"]
        left.barh(y, counts["rows_out"], color=colors[0], label="rows out" if y == 0 else None)
        x = counts["rows_out"]
        for reason in reasons:
            n = counts.get(reason, 0)
            if n:
                left.barh(y, n, left=x, color=color_of[reason], label=reason)
                x += n
        left.text(x, y, f"  {counts['rows_out']:,} of {counts['rows_in']:,}", va="center", fontsize=8)
    handles, labels = left.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    left.legend(unique.values(), unique.keys(), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12),
                ncol=min(4, len(unique)), frameon=False)
    left.set_yticks(range(len(stages)), [f"{o.stage} ({o.status})" for o in stages])
    left.invert_yaxis()
    left.set_xlabel("rows (train: sequences)")
    left.set_title("rows per stage: out, and set aside by reason")
    left.margins(x=0.25)

    names = [s for s in DOCUMENT_STAGES if s in by_source]
    sources = sorted({src for counts in by_source.values() for src in counts})
    for i, source in enumerate(sources):
        counts = [by_source[s].get(source, 0) for s in names]
        right.plot(names, counts, marker="o", color=colors[i % len(colors)],
                   label=f"{source}: {counts[0]:,} -> {counts[-1]:,}")
    right.set_yscale("log")
    right.set_ylabel("documents")
    right.set_title("documents per source after each stage")
    if sources:
        right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(outcomes, folder: Path) -> list[Path]:
    """The table and the funnel in `folder` (the workdir: the latest run's summary, beside the stages'
    folders); their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / TABLE
    table.write_text(stage_table(outcomes, folder))
    return [table, funnel(outcomes, folder / FUNNEL)]

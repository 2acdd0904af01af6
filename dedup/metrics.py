"""The dedup stage's metrics: the banding, what each phase found and moved, who was removed as a copy of whom (the
decontamination's `near_eval.*` and `decontaminate.*` come as they are), and the cluster-size histogram (a file
beside the output, and a plot on the stage's MLflow run)."""

from __future__ import annotations

import collections
import json

from core.dag import StageContext


def lsh_threshold(bands: int, rows: int) -> float:
    """The Jaccard at which a pair becomes a candidate with probability 1/2: 1 - (1 - J^r)^b = 1/2."""
    return (1.0 - 0.5 ** (1.0 / bands)) ** (1.0 / rows)


def stage_metrics(found: dict, shuffled: dict[str, int], documents: int, bands: int, rows: int, ctx: StageContext) -> dict:
    """`found`: the verification's and the assembly's (dedup/verify.py, dedup/assemble.py), the assembly's tally
    rows folded here; `documents`: the documents read."""
    removed, sizes = collections.Counter(), collections.Counter()
    for t in found["tallies"]:
        if t["size"]:
            sizes[int(t["size"])] += t["n"]
        else:
            removed[(t["source"], t["kept_source"])] += t["n"]
    metrics = {"bands": bands, "rows": rows, "lsh_threshold": round(lsh_threshold(bands, rows), 4),
               "exact_duplicates": found["exact_duplicates"], "candidate_pairs": found["candidate_pairs"],
               "candidate_documents_fraction": round(found["candidate_documents"] / documents, 6),
               "verified_pairs": found["verified_pairs"], "clusters": sum(sizes.values()), "rounds": found["rounds"],
               **{k: v for k, v in found.items() if k.startswith(("largest_task_documents.", "largest_key_rows."))}}
    metrics.update({f"shuffled_bytes.{phase.replace(' ', '_')}": n for phase, n in shuffled.items()})
    by_source: collections.Counter = collections.Counter()
    for (source, kept), n in removed.items():
        metrics[f"duplicates.{source}.of.{kept}"] = n
        by_source[source] += n
    metrics.update({f"duplicates.{source}": n for source, n in by_source.items()})
    (ctx.folder / "cluster_sizes.json").write_text(json.dumps(dict(sorted(sizes.items()))) + "\n")
    _log_histogram(sizes, ctx)
    return metrics


def _log_histogram(sizes: collections.Counter, ctx: StageContext) -> None:
    """The cluster-size histogram as a plot on the stage's MLflow run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.tracking import StageRun

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(k) for k in sorted(sizes)], [sizes[k] for k in sorted(sizes)])
    ax.set_xlabel("documents in the cluster")
    ax.set_ylabel("clusters")
    ax.set_title("near-duplicate clusters (kept one of each)")
    fig.tight_layout()
    StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id).log_figure(fig, "cluster_sizes.png")
    plt.close(fig)

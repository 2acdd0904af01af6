"""What MLflow shows of the data ablations, where users compare them: a saved view of the runs table with each
pipeline run's headline figures (compare.headline), and one run per comparison holding compare.py's tables,
verdicts and chart (docs/ablations.md, "In the MLflow UI").

The comparison run (`log_comparison`), one per set of ablations compared (reference first), in their experiment:
- tags `kind=comparison`, `comparison=<the ablations>`, `eval.fingerprint`, `compared.<ablation>` (its pipeline
  runs), and a verdict per ablation and row, `verdict.bpb.<ablation>.<row>` and `verdict.accuracy.<ablation>.<task>`
  (`worse`, `better`, `within noise`, or why there is none), which MLflow's search finds
  (`tags."verdict.bpb.no-screen.all" = 'worse'`);
- metrics `<bpb|accuracy>.<ablation>.<verdict>`: how many rows got each verdict;
- its description: the tables in Markdown, with a link to each run compared;
- artifacts: each table as an MLflow table (`bits_per_byte.json`, `downstream_accuracy.json`, `stages.json`; the
  Artifacts tab shows them as tables, `MlflowClient.load_table` reads them), `tables.txt` (what compare.py printed)
  and the chart, `ablations.png`.
The same comparison asked again updates that run: tags and artifacts are rewritten, and the verdict tags of rows no
longer compared are deleted. Two compare.py started at once may each make a run (MLflow has no unique key).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from core.tracking import BATCH, MAX_TAG_LENGTH, log_metrics, metric_name, ui_link

if TYPE_CHECKING:
    from pipelines.ablations import Ablation, Store

KIND = "comparison"
CHART = "ablations.png"
TEXT = "tables.txt"
LOGGED = "mlflow.loggedArtifacts"  # the run tag that makes MLflow's UI show a JSON artifact as a table
SAVED_VIEW = "mlflow.sharedViewState."  # + an id: an experiment tag holding a view of its runs table, by name
VIEW = "ablations"  # the saved view of the pipeline runs' headline figures (save_view)


def save_view(client, experiment_id: str, figures: dict[str, float]) -> str | None:
    """The experiment's saved view VIEW, made or widened by these headline figures: MLflow's runs table filtered to
    the pipeline runs, newest first, with the figures as columns (the whole set's bits per byte and its macro
    average first, then each task's accuracy, then each source's and subset's bits per byte; the intervals of the
    first ones beside them) and the `ablation` tag. Its name; None without figures. A saved view is the experiment
    tag the UI's "Views" menu writes (`mlflow.sharedViewState.<id>`: name, times, and the page's state as JSON)."""
    if not figures:
        return None
    tag = SAVED_VIEW + VIEW
    old = client.get_experiment(experiment_id).tags.get(tag)
    try:  # as we wrote it; else (edited in the UI, which may compress it) replaced
        state = json.loads(json.loads(old)["state"]) if old else {}
    except (ValueError, KeyError, TypeError):
        state = {}
    shown = [c[len("metrics.`"):-1] for c in state.get("selectedColumns", []) if c.startswith("metrics.`")]
    names = {metric_name(f) for f in figures}
    means = [f for f in names if not f.endswith((".ci95", ".seeds"))]
    intervals = [f"{m}.ci95" for m in means if (m == "bpb.all" or m.startswith("accuracy.")) and f"{m}.ci95" in names]
    first = {"bpb.all": 0, "bpb.all.ci95": 1, "bpb.macro": 2}
    columns = sorted({*shown, *means, *intervals}, key=lambda f: (first.get(f, 3 if f.startswith("accuracy.") else 4), f))
    now = int(time.time() * 1000)
    created = json.loads(old).get("createdAt", now) if state else now
    selected = [f"metrics.`{f}`" for f in columns] + ["tags.`ablation`"]
    state = {"searchFilter": "tags.kind = 'pipeline'", "orderByKey": "attributes.start_time", "orderByAsc": False,
             "selectedColumns": selected, "columnOrder": selected}  # the UI sorts them by name without an order
    client.set_experiment_tag(experiment_id, tag, json.dumps({"name": VIEW, "createdAt": created, "updatedAt": now,
                                                              "state": json.dumps(state)}))
    return VIEW


def key(ablations: list[Ablation]) -> str:
    """What makes a comparison the same one: the ablations, in the order compared (the first is the reference)."""
    return " | ".join(a.name for a in ablations)


def find(where: Store, ablations: list[Ablation]):
    """The comparison run of these ablations (the newest, if a race made two), or None."""
    same = [r for r in where.client.search_runs([where.experiment_id], f"tags.kind = '{KIND}'",
                                                order_by=["attributes.start_time DESC"], max_results=5000)
            if r.data.tags.get("comparison") == key(ablations)]
    return same[0] if same else None


def description(where: Store, ablations: list[Ablation], tables: list, command: str) -> str:
    """The run's description (its Overview tab): what was compared, a link to each run, and the tables in Markdown,
    the verdicts first; the stage table left to tables.txt when all would pass MLflow's limit on a tag."""
    runs = [f"- **{a.name}**{' (the reference)' if i == 0 else ''}: "
            + ", ".join(f"[{r[:8]}]({ui_link(where.uri, where.experiment_id, r, relative=True)})" for r in a.pipeline_runs)
            + (f"; {a.diff}" if a.diff and a.diff != "(none)" else "")
            for i, a in enumerate(ablations)]
    head = [f"Data ablations compared by `{command}`. Asked again, this run is updated.", "", "Pipeline runs:", *runs]
    sections = [f"### {t.title}\n\n{t.markdown()}" for t in tables]
    text = "\n\n".join(["\n".join(head), *sections, f"The chart: {CHART}, in Artifacts."])
    if len(text) > MAX_TAG_LENGTH:
        text = "\n\n".join(["\n".join(head), *sections[:-1], f"The stage table: {TEXT}; the chart: {CHART}, in Artifacts."])
    return text[:MAX_TAG_LENGTH]


def log_comparison(where: Store, ablations: list[Ablation], tables: list, printed: str, chart: Path | None,
                   command: str) -> str:
    """compare.py's tables (compare.Table: not imported, which imports this), verdicts and chart as one run of the
    ablations' experiment, made or updated; its id."""
    from mlflow.entities import RunTag

    client = where.client
    found = find(where, ablations)
    if found is None:
        names = ", ".join(a.name for a in ablations)
        run_id = client.create_run(where.experiment_id, run_name=f"compare [{names}]",
                                   tags={"kind": KIND, "comparison": key(ablations)}).info.run_id
        old: dict[str, str] = {}
    else:
        run_id, old = found.info.run_id, found.data.tags
    tags = {"mlflow.note.content": description(where, ablations, tables, command)}
    fingerprint = next((a.fingerprint for a in ablations if a.fingerprint), None)
    if fingerprint:
        tags["eval.fingerprint"] = fingerprint
    tags.update({metric_name(f"compared.{a.name}"): ",".join(a.pipeline_runs)[:MAX_TAG_LENGTH] for a in ablations})
    counts: dict[str, float] = {}
    for table in tables:
        short = table.short
        for (name, row), verdict in table.verdicts.items() if short else ():
            tags[metric_name(f"verdict.{short}.{name}.{row}")] = verdict
        for a in ablations[1:] if short and table.verdicts else ():
            for verdict in ("worse", "better", "within noise"):
                counts[f"{short}.{a.name}.{verdict}"] = sum(v == verdict for (n, _), v in table.verdicts.items() if n == a.name)
    for stale in (k for k in old if k.startswith(("verdict.", "compared.")) and k not in tags):
        client.delete_tag(run_id, stale)
    items = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(items), BATCH):
        client.log_batch(run_id, tags=items[i : i + BATCH])
    log_metrics(client, run_id, counts)
    log_artifacts(client, run_id, tables, printed, chart, old)
    client.set_terminated(run_id, "FINISHED")
    return run_id


def table_file(table) -> str:
    return metric_name(table.title).replace(" ", "_") + ".json"


def log_artifacts(client, run_id: str, tables: list, printed: str, chart: Path | None, old: dict[str, str]) -> None:
    """The tables as MLflow tables, the printed text and the chart, each replacing the file an earlier call logged.
    A table is written here in log_table's format (pandas' "split" JSON) and listed in the run's loggedArtifacts
    tag as log_table does: log_table itself appends to a file that exists, which would double an updated table."""
    import pandas as pd

    listed = json.loads(old.get(LOGGED, "[]"))
    with tempfile.TemporaryDirectory() as tmp:
        for table in tables:
            path = Path(tmp) / table_file(table)
            pd.DataFrame(table.columns()).to_json(path, orient="split", index=False)
            client.log_artifact(run_id, str(path))
            if {"path": path.name, "type": "table"} not in listed:
                listed.append({"path": path.name, "type": "table"})
        (Path(tmp) / TEXT).write_text(printed)
        client.log_artifact(run_id, str(Path(tmp) / TEXT))
        if chart is not None:
            shutil.copyfile(chart, Path(tmp) / CHART)
            client.log_artifact(run_id, str(Path(tmp) / CHART))
    client.set_tag(run_id, LOGGED, json.dumps(listed))

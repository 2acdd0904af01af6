"""pipelines/compare.py's verdicts and its refusal of ablations evaluated on different sets (on an MLflow store of its
own: the sample's real ablations are compared in tests/test_ablation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import write_config
from pipelines import compare


def test_a_verdict_says_worse_only_beyond_the_seed_noise():
    from core.stats import Difference, difference, t_quantile
    from pipelines.compare import verdict

    rng = np.random.default_rng(0)
    base = list(2.0 + rng.normal(0, 0.01, 3))
    alpha = 0.05 / 14
    # The same runs, bit for bit: nothing to tell.
    same = difference(base, base, alpha, paired=True)
    assert same == Difference(0.0, 0.0, "within") and verdict(same) == "within noise"
    shifted = [b + 0.1 + e for b, e in zip(base, rng.normal(0, 0.002, 3))]
    worse = difference(base, shifted, alpha, paired=True)
    assert verdict(worse) == "worse" and worse.delta == pytest.approx(0.1, abs=0.01) and 0 < worse.half < 0.1
    # Paired: Student t over the per-seed differences, with their own spread and n - 1 degrees of freedom.
    diffs = np.subtract(shifted, base)
    assert worse.half == pytest.approx(t_quantile(1 - alpha / 2, 2) * np.std(diffs, ddof=1) / np.sqrt(3), rel=1e-12)
    assert verdict(difference(shifted, base, alpha, paired=True)) == "better"
    # Seed-to-seed noise as large as the shift: not a difference anyone can claim from 3 seeds.
    noisy = [b + 0.1 + e for b, e in zip(base, rng.normal(0, 0.2, 3))]
    assert verdict(difference(base, noisy, alpha, paired=True)) == "within noise"
    # Other seeds than the base's: Welch's t over the two groups.
    welch = difference(base, list(2.5 + rng.normal(0, 0.01, 4)), 0.05, paired=False)
    assert verdict(welch) == "worse" and np.isfinite(welch.half)
    # Under 3 seeds no verdict, whatever the difference: one degree of freedom would print an interval of +-100.
    for n in (1, 2):
        assert verdict(difference(base[:n], shifted[:n], 0.05, paired=True)) == f"not enough seeds ({n}; 3 decide)"
        assert verdict(difference(base[:n], shifted, 0.05, paired=False)) == f"not enough seeds ({n}; 3 decide)"


def test_each_ablation_is_judged_by_its_own_noise_across_the_whole_table():
    """A noisy ablation neither widens a quiet one's interval nor narrows its own (the pooled rule did both), and
    the table's error rate is split over every ablation x row (Bonferroni): a quiet shift of 0.05 is found beside
    a noisy null ablation, and the noisy one's large chance difference is not."""
    from core.stats import t_quantile
    from pipelines.ablations import Ablation

    rng = np.random.default_rng(1)
    rows = ["", "a", "b"]
    noise = {"base": 0.01, "quiet": 0.01, "noisy": 0.3}
    shift = {"base": 0.0, "quiet": 0.05, "noisy": 0.0}
    seeds = [0, 1, 2, 3, 4]
    common = {row: rng.normal(2.0, 0.02, 5) for row in rows}  # each seed's own draw, shared by every ablation
    tables = [Ablation(name, "", seeds=seeds, bpb={row: list(common[row] + shift[name] + rng.normal(0, noise[name], 5))
                                                   for row in rows}) for name in noise]
    found_rows, alpha, found = compare.verdicts(tables)
    assert found_rows == rows and alpha == pytest.approx(0.05 / 6)
    for name in ("quiet", "noisy"):
        for row in rows:
            d = found[name][row]
            diffs = np.subtract(tables[[t.name for t in tables].index(name)].bpb[row], tables[0].bpb[row])
            assert d.half == pytest.approx(t_quantile(1 - alpha / 2, 4) * np.std(diffs, ddof=1) / np.sqrt(5), rel=1e-9)
    assert all(compare.verdict(found["quiet"][row]) == "worse" for row in rows)
    assert all(compare.verdict(found["noisy"][row]) == "within noise" for row in rows)


def test_null_ablations_with_unequal_noise_hold_the_tables_error_rate():
    """1,000 tables of null ablations (no effect), one three times noisier than the other, through compare.verdicts:
    at most 5% of tables with any verdict (the stated family-wise rate), within this count's own noise. The pooled
    rule before it gave a false verdict on 36-68% of such tables (issue 45); benchmarks/ablation_noise.py measures
    the rule at length."""
    from pipelines.ablations import Ablation

    rng = np.random.default_rng(2)
    rows = [""] + [f"s{i}" for i in range(12)]
    seeds = [0, 1, 2, 3, 4]
    wrong = 0
    for _ in range(1000):
        common = rng.normal(2.0, 0.05, (len(rows), 5))
        tables = [Ablation(name, "", seeds=seeds, bpb={row: list(common[i] + rng.normal(0, sd, 5)) for i, row in enumerate(rows)})
                  for name, sd in (("base", 0.01), ("quiet", 0.01), ("noisy", 0.03))]
        _, _, found = compare.verdicts(tables)
        wrong += any(compare.verdict(d) != "within noise" for by_row in found.values() for d in by_row.values())
    assert wrong <= 70  # 5% of 1,000 is 50; its binomial spread is 7, so 70 is about 3 sd above


def test_the_mean_interval_is_students_t_over_the_seeds():
    from scipy import stats as scipy_stats

    from core.stats import mean_interval

    values = [1.0, 1.2, 0.9, 1.1]
    expected = scipy_stats.t.ppf(0.975, 3) * np.std(values, ddof=1) / np.sqrt(4)
    assert mean_interval(values, 0.05) == pytest.approx(expected, rel=1e-12)
    assert np.isnan(mean_interval([1.0], 0.05))


def pipeline_run(client, experiment: str, name: str, tags: dict, bpb: list[float] | None,
                 status: str = "FINISHED", seeds: list[int] | None = None, downstream: list[float] | None = None) -> str:
    """A pipeline run as full.py leaves it: tagged with its ablation, a train stage run under it logging each
    seed's bits per byte (none: no train stage) and a downstream stage run each seed's accuracy on one task (none:
    no such stage), all ended with `status`. Returns the train run's id."""
    seeds = list(range(len(bpb or downstream or []))) if seeds is None else seeds
    parent = client.create_run(experiment, tags={"kind": "pipeline", "ablation": name})
    train_id = None
    for stage, values, metric in (("train", bpb, "eval.bpb"), ("downstream", downstream, "downstream.cloze")):
        if values is None:
            continue
        run = client.create_run(experiment, tags={"mlflow.parentRunId": parent.info.run_id, "stage": stage,
                                                  "eval.fingerprint": "aaaaaaaaaaaaaaaa", "data.fingerprint": "d1",
                                                  f"{metric.split('.')[0]}.seeds": ",".join(map(str, seeds)), **tags})
        for seed, value in zip(seeds, values):
            client.log_metric(run.info.run_id, f"seed{seed}/{metric}", value)
        client.set_terminated(run.info.run_id, status)
        train_id = train_id or run.info.run_id
    client.set_terminated(parent.info.run_id, status)
    return train_id


def test_a_failed_seed_or_a_zero_spread_gives_no_verdict_and_no_noise_to_the_others():
    """A NaN or inf seed makes its row `failed seed S` (its own, or base's for every ablation) and stays out of the
    pooled spread, where it would have made every paired interval NaN, `within noise`; a spread of exactly 0
    gives no verdict, where it gave a zero-width interval and a verdict on any difference."""
    from core.stats import ZERO_SPREAD, difference
    from pipelines.ablations import Ablation

    def ablation(name, values):
        return Ablation(name, "", bpb={"": values}, seeds=list(range(len(values))))

    base = ablation("base", [2.0, 2.1, 1.9])
    shifted = ablation("shifted", [2.3, 2.4, 2.2])  # +0.3 on every seed: a spread of 0
    diverged = ablation("diverged", [2.0, float("nan"), 1.9])
    noisy = ablation("noisy", [2.31, 2.38, 2.21])
    _, _, found = compare.verdicts([base, shifted, diverged, noisy])
    assert compare.verdict(found["diverged"][""]) == "failed seed 1 (diverged)"
    assert compare.verdict(found["noisy"][""]) == "worse"  # the NaN reached no one else's interval
    assert np.isfinite(found["noisy"][""].half)
    _, _, found = compare.verdicts([ablation("base", [2.0, float("inf"), 1.9]), noisy])
    assert compare.verdict(found["noisy"][""]) == "failed seed 1 (base)"
    assert difference([2.0, 2.5, 1.5], [2.25, 2.75, 1.75], 0.05, paired=True).side == ZERO_SPREAD  # +0.25 on every seed
    assert difference([2.0, 2.0, 2.0], [2.3, 2.3, 2.3], 0.05, paired=False).side == ZERO_SPREAD  # Welch's: both groups without spread
    assert "failed seed 1 (diverged)" in compare.bpb_table([base, diverged])


def test_compare_refuses_a_missing_or_failed_reference(tmp_path, capsys):
    """Only finished runs count: a base whose only pipeline run failed is missing, and compare says so (exit 2)
    rather than measuring the others against the next ablation; a finished base without a training run, while
    others have one, is refused too."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    pipeline_run(client, experiment, "base", {}, [1.5, 1.51], status="FAILED")
    pipeline_run(client, experiment, "drop-x", {}, [1.6, 1.62])
    pipeline_run(client, experiment, "drop-y", {}, [1.4, 1.41])
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]

    def error() -> str:
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        return line

    assert compare.main(args) == 2
    assert "no finished pipeline run tagged ablation='base'" in error()
    pipeline_run(client, experiment, "base", {}, None)  # finished, but only up to dedup (`--only dedup`)
    assert compare.main(args) == 2
    assert "base, the reference, has no finished training run" in error()
    assert compare.main([*args, "drop-y", "drop-x"]) == 0  # a reference named: measured against it
    assert "vs drop-y: drop-x" in capsys.readouterr().out


def test_compare_refuses_runs_evaluated_on_different_sets(tmp_path, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    for name, fingerprint in (("base", "aaaaaaaaaaaaaaaa"), ("other-eval", "bbbbbbbbbbbbbbbb")):
        pipeline_run(client, experiment, name, {"eval.fingerprint": fingerprint}, [1.5, 1.51])
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]
    assert compare.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]  # (MLflow logs too)
    assert len(err) == 1 and "eval.fingerprint=aaaaaaaaaaaaaaaa" in err[0] and "eval.fingerprint=bbbbbbbbbbbbbbbb" in err[0]
    assert compare.main([*args, "base"]) == 0  # one set: compared
    out = capsys.readouterr().out
    assert "all" in out and "1.5050" in out and "eval.fingerprint=aaaaaaaaaaaaaaaa" in out


def test_an_ablation_run_again_pools_its_seeds_on_the_same_data_and_is_refused_on_other_data(tmp_path, capsys):
    """Seeds 0-2, then the same ablation again on seeds 3-4 (`--set train.seed=3 --set train.seeds=2`): five seeds,
    each once (a cache hit of the first run adds nothing twice); and the downstream table beside bits per byte.
    The same name on other training data (its `data.fingerprint`) cannot be pooled: refused, naming both."""
    from mlflow import MlflowClient

    from pipelines.ablations import read

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    pipeline_run(client, experiment, "base", {}, [1.50, 1.52, 1.49, 1.51, 1.50], downstream=[0.30, 0.31, 0.29, 0.30, 0.31])
    first = pipeline_run(client, experiment, "more", {}, [1.60, 1.62, 1.59], downstream=[0.25, 0.27, 0.24])
    pipeline_run(client, experiment, "more", {"cache_hit": "true", "cached_from_run": first}, [9.0, 9.0, 9.0])
    pipeline_run(client, experiment, "more", {}, [1.62, 1.60], seeds=[3, 4], downstream=[0.25, 0.26])
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    base, more = read(None, config=str(cfg), tracking_uri=uri, experiment="ablations")
    assert more.seeds == [0, 1, 2, 3, 4] and more.bpb[""] == [1.60, 1.62, 1.59, 1.62, 1.60]
    assert more.downstream_seeds == [0, 1, 2, 3, 4] and more.downstream["cloze"] == [0.25, 0.27, 0.24, 0.25, 0.26]
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]
    assert compare.main(args) == 0
    out = capsys.readouterr().out
    bpb, downstream = out.split("\nbits per byte")[1].split("\ndownstream accuracy")
    assert "worse" in bpb.splitlines()[2] and "more: seeds 0,1,2,3,4" in bpb
    assert "cloze" in downstream and "worse" in downstream.splitlines()[2]  # lower accuracy: worse
    (logged,) = comparisons(client, experiment)
    assert logged.data.tags["verdict.bpb.more.all"] == "worse" and logged.data.tags["verdict.accuracy.more.cloze"] == "worse"
    pipeline_run(client, experiment, "more", {"data.fingerprint": "d2"}, [1.7, 1.7, 1.71], seeds=[5, 6, 7])
    assert compare.main(args) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "ablation 'more' has runs of two data.fingerprints, d2" in err and "and d1 (run" in err
    (after,) = comparisons(client, experiment)  # a refused comparison logs nothing
    assert after.data.tags == logged.data.tags and after.info.end_time == logged.info.end_time


def comparisons(client, experiment: str) -> list:
    return client.search_runs([experiment], "tags.kind = 'comparison'")


def test_compare_logs_its_tables_verdicts_and_chart_as_one_run_updated_when_asked_again(tmp_path, capsys, monkeypatch):
    """compare.py's output in MLflow: one run per comparison, holding the tables (as MLflow tables, Markdown in its
    description and the printed text), a searchable verdict per ablation and row, the chart, links to the runs
    compared (model-training view) and the evaluation fingerprint. Asked again after a new seed it updates that run:
    the tables replaced, not appended to, and a verdict that no longer holds gone."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # MlflowClient.load_table searches the default store, not its own
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    pipeline_run(client, experiment, "base", {}, [1.50, 1.52, 1.49])
    worse = pipeline_run(client, experiment, "worse", {}, [1.60, 1.63, 1.59])
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]
    assert compare.main(args) == 0
    printed = capsys.readouterr().out
    (run,) = comparisons(client, experiment)
    rid, tags = run.info.run_id, run.data.tags
    assert f"comparison run {rid}" in printed and f"#/experiments/{experiment}/runs/{rid}?workflowType=machine_learning" in printed
    assert tags["comparison"] == "base | worse" and tags["eval.fingerprint"] == "aaaaaaaaaaaaaaaa"
    assert tags["verdict.bpb.worse.all"] == "worse" and run.data.metrics["bpb.worse.worse"] == 1
    worse_parent = client.get_run(worse).data.tags["mlflow.parentRunId"]
    assert tags["compared.worse"] == worse_parent
    note = tags["mlflow.note.content"]
    assert f"(#/experiments/{experiment}/runs/{worse_parent}?workflowType=machine_learning)" in note
    assert "| bits per byte | base | worse | vs base: worse | verdict |" in note and "| worse |" in note
    table = client.load_table(experiment, "bits_per_byte.json", run_ids=[rid])
    assert list(table.columns) == ["bits per byte", "vs base: worse", "verdict", "base", "worse"]  # the verdict in view
    assert list(table["bits per byte"]) == ["all"] and list(table["verdict"]) == ["worse"]
    assert table["vs base: worse"][0].startswith("+0.10")
    stages = client.load_table(experiment, "stages.json", run_ids=[rid])
    assert "train final loss (own data: not comparable)" not in set(stages["stages"])  # no such metric logged here
    text = (tmp_path / "dl" / "tables.txt")
    client.download_artifacts(rid, "tables.txt", str(tmp_path / "dl"))
    assert text.read_text() in printed and "bits per byte" in text.read_text()
    client.download_artifacts(rid, "ablations.png", str(tmp_path / "dl"))
    assert (tmp_path / "dl" / "ablations.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    # Asked again after two more seeds of `worse` that say the opposite: the same run, its verdict now `within
    # noise`, each table once.
    pipeline_run(client, experiment, "worse", {}, [1.30, 1.80], seeds=[3, 4])
    pipeline_run(client, experiment, "base", {}, [1.55, 1.50], seeds=[3, 4])
    assert compare.main(args) == 0
    (again,) = comparisons(client, experiment)
    assert again.info.run_id == rid and again.data.tags["verdict.bpb.worse.all"] == "within noise"
    assert again.data.metrics["bpb.worse.worse"] == 0 and again.data.metrics["bpb.worse.within noise"] == 1
    assert len(client.load_table(experiment, "bits_per_byte.json", run_ids=[rid])) == 1
    assert "worse: seeds 0,1,2,3,4" in again.data.tags["mlflow.note.content"]
    # Another set of ablations is another comparison; with two ablations, each verdict column is named for its own.
    pipeline_run(client, experiment, "other", {}, [1.50, 1.52, 1.49])
    assert compare.main(args) == 0
    assert sorted(r.data.tags["comparison"] for r in comparisons(client, experiment)) == ["base | other | worse", "base | worse"]
    (three,) = [r for r in comparisons(client, experiment) if r.data.tags["comparison"] == "base | other | worse"]
    assert list(client.load_table(experiment, "bits_per_byte.json", run_ids=[three.info.run_id]).columns)[:5] == [
        "bits per byte", "vs base: other", "verdict (vs base: other)", "vs base: worse", "verdict (vs base: worse)"]


def test_a_comparison_run_loses_the_verdicts_of_rows_no_longer_compared(tmp_path):
    from mlflow import MlflowClient

    from pipelines.ablation_runs import log_comparison
    from pipelines.ablations import Ablation, Store

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    where = Store(client, f"sqlite:///{tmp_path}/mlflow.db", "x", client.create_experiment("x", str(tmp_path / "a")))
    ablations = [Ablation("base", "", ["r1"]), Ablation("b", "k: 1 -> 2", ["r2"])]
    table = compare.Table("bits per byte", "bpb", ["bits per byte", "base", "b"], [["all", "1", "2"], ["web", "1", "2"]], [],
                          {("b", "all"): "worse", ("b", "web"): "better"})
    rid = log_comparison(where, ablations, [table], "text", None, "pipelines/compare.py")
    assert client.get_run(rid).data.tags["verdict.bpb.b.web"] == "better"
    table = compare.Table("bits per byte", "bpb", ["bits per byte", "base", "b"], [["all", "1", "2"]], [], {("b", "all"): "worse"})
    assert log_comparison(where, ablations, [table], "text", None, "pipelines/compare.py") == rid
    tags = client.get_run(rid).data.tags
    assert "verdict.bpb.b.web" not in tags and tags["verdict.bpb.b.all"] == "worse"


def test_a_pipeline_runs_headline_figures_are_the_means_over_its_seeds():
    from core.stats import mean_interval
    from pipelines.ablations import Ablation
    from pipelines.compare import headline

    run = Ablation("base", "", seeds=[0, 1, 2], bpb={"": [2.0, 2.2, 2.1], "web": [2.5, 2.4, 2.6], "books": [1.9, 1.8, 2.0]},
                   downstream_seeds=[0, 1], downstream={"cloze": [0.30, 0.34]})
    found = headline(run)
    assert found["bpb.all"] == pytest.approx(2.1) and found["bpb.all.seeds"] == 3
    assert found["bpb.all.ci95"] == pytest.approx(mean_interval([2.0, 2.2, 2.1], 0.05))
    assert found["bpb.macro"] == pytest.approx((2.5 + 2.4 + 2.6 + 1.9 + 1.8 + 2.0) / 6)  # the domains weigh the same
    assert found["bpb.web"] == pytest.approx(2.5) and found["accuracy.cloze"] == pytest.approx(0.32)
    assert found["accuracy.cloze.seeds"] == 2 and "accuracy.cloze.ci95" in found
    assert headline(Ablation("base", "", seeds=[0], bpb={"": [2.0]})) == {"bpb.all": 2.0, "bpb.all.seeds": 1}
    # The comparison run's verdict tags name the rows as the headline figures do: `all`, `macro`, the sources.
    other = Ablation("other", "", seeds=[0, 1, 2], bpb={row: [v + 0.5 for v in values] for row, values in run.bpb.items()})
    assert set(compare.score_table([run, other]).verdicts) == {("other", row) for row in ("all", "macro", "web", "books")}


def test_the_saved_view_shows_every_pipeline_runs_headline_figures_and_grows_with_new_rows(tmp_path):
    """The experiment's saved view `ablations` (the runs table's "Views" menu; full.py prints its link): the pipeline
    runs only, with the whole set's bits per byte and its interval first, then the macro average, the tasks'
    accuracy, then each row; a later run with another source adds its column and keeps the others."""
    import json

    from mlflow import MlflowClient

    from core.tracking import ui_link
    from pipelines.ablation_runs import SAVED_VIEW, VIEW, save_view

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("x", str(tmp_path / "a"))
    assert save_view(client, experiment, {}) is None and SAVED_VIEW + VIEW not in client.get_experiment(experiment).tags
    figures = {"bpb.all": 2.0, "bpb.all.ci95": 0.1, "bpb.all.seeds": 3, "bpb.macro": 2.1, "bpb.macro.ci95": 0.1,
               "bpb.web": 2.2, "bpb.web.ci95": 0.1, "bpb.pile.Gutenberg (PG-19)": 1.9, "accuracy.cloze": 0.3,
               "accuracy.cloze.ci95": 0.01}
    assert save_view(client, experiment, figures) == VIEW
    saved = json.loads(client.get_experiment(experiment).tags[SAVED_VIEW + VIEW])
    state = json.loads(saved["state"])
    assert saved["name"] == VIEW and state["searchFilter"] == "tags.kind = 'pipeline'"
    assert state["selectedColumns"] == ["metrics.`bpb.all`", "metrics.`bpb.all.ci95`", "metrics.`bpb.macro`",
                                        "metrics.`accuracy.cloze`", "metrics.`accuracy.cloze.ci95`",
                                        "metrics.`bpb.pile.Gutenberg _PG-19_`", "metrics.`bpb.web`", "tags.`ablation`"]
    assert state["columnOrder"] == state["selectedColumns"]
    save_view(client, experiment, {"bpb.all": 2.0, "bpb.books": 1.8})
    again = json.loads(client.get_experiment(experiment).tags[SAVED_VIEW + VIEW])
    assert json.loads(again["state"])["selectedColumns"] == [*state["selectedColumns"][:5], "metrics.`bpb.books`",
                                                             *state["selectedColumns"][5:]]
    assert again["createdAt"] == saved["createdAt"] and again["updatedAt"] >= saved["updatedAt"]
    assert ui_link("sqlite:///x", experiment, view=VIEW) == (f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?"
                                                             f"viewStateShareKey={VIEW}&workflowType=machine_learning")

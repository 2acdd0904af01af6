"""Data ablations: `--ablation NAME` tags the runs, the cache reuses what the ablation does not change,
and pipelines/compare.py puts the ablations side by side (on sample_run's workdir, restored after)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import manifest

from pipelines import compare
from pipelines.full import main


def test_a_screen_ablation_reruns_the_screen_and_downstream_only(sample_run, tmp_path, capsys, monkeypatch):
    from mlflow import MlflowClient

    _, _, wd = sample_run
    cfg = str(wd.parent / "sample.yaml")
    base = {stage: manifest(wd, stage) for stage in ("ingest", "normalize", "dedup", "screen", "tokenize", "train",
                                                     "downstream")}
    capsys.readouterr()
    try:
        assert main(["--config", cfg, "--set", "screen.enabled=false", "--ablation", "no-screen"]) == 0
        out = capsys.readouterr().out
        status = {line.split()[0]: line.split()[1] for line in out.split("finished; workdir")[1].splitlines()[1:]
                  if line.startswith("  ") and len(line.split()) > 1 and line.split()[0] in base}
        assert status == {"ingest": "cached", "normalize": "cached", "dedup": "cached", "screen": "ran", "tokenize": "ran",
                          "train": "ran", "downstream": "ran"}
        off = {stage: manifest(wd, stage) for stage in base}
        assert off["dedup"]["fingerprint"] == base["dedup"]["fingerprint"]
        # One tokenizer for both (trained on normalize's output, which the screen does not change): a loss per token
        # means the same thing in each column.
        base_tok, off_tok = (Path(m["tokenize"]["output"]) / "tokenizer.json" for m in (base, off))
        assert base_tok != off_tok and base_tok.read_bytes() == off_tok.read_bytes()
        assert off["screen"]["counts"]["rows_out"] == off["screen"]["counts"]["rows_in"] == base["screen"]["counts"]["rows_in"]
        assert base["screen"]["counts"]["dropped"] > 0 and off["screen"]["proxy_runs"] == []
        # One evaluation set for both (drawn at normalize): the same documents as the same windows, HackerNews's
        # among them though base's screen dropped it from training.
        base_index, off_index = (json.loads((Path(m["tokenize"]["output"]) / "index.json").read_text()) for m in (base, off))
        assert base_index["eval"] == off_index["eval"] and any(u["subset"] == "HackerNews" for u in base_index["eval"]["units"])
        for unit in base_index["eval"]["units"]:
            name = unit["shards"][0]["file"]
            assert (Path(base["tokenize"]["output"]) / name).read_bytes() == (Path(off["tokenize"]["output"]) / name).read_bytes()

        client = MlflowClient(f"sqlite:///{wd}/mlflow.db")
        for stage in ("screen", "train"):
            run = client.get_run(off[stage]["mlflow_run_id"])
            assert run.data.tags["ablation"] == "no-screen"
            assert run.data.tags["ablation.diff"] == "screen.enabled: True -> False"
        fingerprint = base["normalize"]["eval"]["fingerprint"]
        trained = [client.get_run(m["train"]["mlflow_run_id"]).data for m in (base, off)]
        assert [t.tags["eval.fingerprint"] for t in trained] == [fingerprint, fingerprint]
        assert client.get_run(base["screen"]["proxy_runs"][0]["mlflow_run_id"]).data.tags["eval.fingerprint"] == fingerprint
        assert all({"eval.bpb", "eval.bpb.pile", "eval.bpb.pile.HackerNews", "seed1/eval.bpb"} <= set(t.metrics) for t in trained)
        assert client.get_run(base["train"]["mlflow_run_id"]).data.tags["ablation"] == "base"
        assert client.get_run(base["screen"]["proxy_runs"][0]["mlflow_run_id"]).data.tags["ablation"] == "base"

        chart = tmp_path / "ablations.png"
        assert compare.main(["--config", cfg, "--out", str(chart), "base", "no-screen"]) == 0
        table = capsys.readouterr().out
        first, scores = table.split("\nbits per byte")
        header, _, *lines = first.splitlines()
        assert header.split() == ["base", "no-screen"]
        cells = {line[: line.index("  ")].strip(): line.split()[-2:] for line in lines if "  " in line}
        assert cells["screen dropped"] == [f"{base['screen']['counts']['dropped']:,}", "0"]
        assert cells["dedup duplicate"][0] == cells["dedup duplicate"][1]  # a cache hit: the same run's counts
        assert cells["screen dropped subsets"] == ["HackerNews", "none"]
        base_pile, off_pile = (int(c.replace(",", "")) for c in cells["tokens pile"])
        assert base_pile < off_pile  # HackerNews's tokens are back
        assert cells[compare.TRAIN_LOSS_ROW] == [f"{m['final_loss']:.4f}" for m in (base["train"], off["train"])]
        assert "tokens ccnews" in cells and "eval loss per token (whole set)" in cells and "grad-norm spikes" in cells
        assert "no-screen: screen.enabled: True -> False" in table
        # Bits per byte per row, its size, the means with intervals over the three seeds, and a verdict per row.
        bpb = {r[0]: r[1:] for r in (re.split(r"\s{2,}", line.strip()) for line in scores.split("\ndownstream")[0].splitlines()[2:])
               if len(r) == 8}
        assert {"all", compare.MACRO, "pile", "pile.HackerNews", "reddit", "ccnews"} <= set(bpb)
        assert all(verdict in ("worse", "better", "within noise") for *_, verdict in bpb.values())
        metrics = [client.get_run(m["train"]["mlflow_run_id"]).data.metrics for m in (base, off)]
        means = [np.mean([m[f"seed{s}/eval.bpb.pile.HackerNews"] for s in (0, 1, 2)]) for m in metrics]
        assert [float(c.split("±")[0]) for c in bpb["pile.HackerNews"][3:5]] == pytest.approx(means, abs=1e-4)
        # each row's size: documents, bytes and tokens scored, the sources' adding up to the whole set's
        sizes = {row: [int(c.replace(",", "")) for c in bpb[row][:3]] for row in bpb if row != compare.MACRO}
        assert sizes["all"][0] == sum(sizes[s][0] for s in ("bookcorpus", "ccnews", "pile", "reddit", "stories") if s in sizes)
        assert f"eval.fingerprint={fingerprint}" in scores and "5% family-wise error rate" in scores
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # What it printed is in MLflow too: one comparison run, its verdicts searchable as tags, its tables and chart
        # as artifacts (read back through MLflow's client), and the pipeline runs' headline figures side by side.
        experiment = client.get_run(base["train"]["mlflow_run_id"]).info.experiment_id
        (logged,) = client.search_runs([experiment], "tags.kind = 'comparison' and tags.comparison = 'base | no-screen'")
        assert f"comparison run {logged.info.run_id}" in table
        assert {row: logged.data.tags[f"verdict.bpb.no-screen.{row}"] for row in ("all", "pile.HackerNews")} == {
            row: bpb[row][-1] for row in ("all", "pile.HackerNews")}
        assert logged.data.tags["verdict.bpb.no-screen.macro"] == bpb[compare.MACRO][-1]  # named as bpb.macro is
        assert logged.data.tags["eval.fingerprint"] == fingerprint
        found = {a.path for a in client.list_artifacts(logged.info.run_id)}
        assert {"bits_per_byte.json", "downstream_accuracy.json", "stages.json", "tables.txt", "ablations.png"} <= found
        with monkeypatch.context() as env:  # MlflowClient.load_table searches the default store, not its own
            env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd}/mlflow.db")
            bpb_logged = client.load_table(experiment, "bits_per_byte.json", run_ids=[logged.info.run_id])
        assert dict(zip(bpb_logged["bits per byte"], bpb_logged["verdict"])) == {row: cells[-1] for row, cells in bpb.items()}
        pipelines = {r.data.tags["ablation"]: r.data.metrics for r in client.search_runs(
            [experiment], "tags.kind = 'pipeline'", order_by=["attributes.start_time DESC"]) if "bpb.all" in r.data.metrics}
        assert {"base", "no-screen"} <= set(pipelines)
        assert [f"{pipelines[n]['bpb.all']:.4f}" for n in ("base", "no-screen")] == [c.split("±")[0] for c in bpb["all"][3:5]]
        assert compare.main(["--config", cfg, "--out", str(chart), "nope"]) == 2
        assert "no pipeline run tagged ablation='nope'" in capsys.readouterr().err
    finally:
        assert main(["--config", cfg]) == 0  # back to base: every stage a cache hit
    assert all(manifest(wd, s)["fingerprint"] == m["fingerprint"] for s, m in base.items())
    # The cache hit's train run carries the tags and every metric of the run it reuses (its workers' step metrics
    # included, as they ended): a user filtering runs by eval.fingerprint finds it too.
    hit = client.search_runs([client.get_run(base["train"]["mlflow_run_id"]).info.experiment_id],
                             "tags.stage = 'train' and tags.cache_hit = 'true'", order_by=["attributes.start_time DESC"])[0]
    reused = client.get_run(base["train"]["mlflow_run_id"]).data
    assert hit.data.tags["cached_from_run"] == base["train"]["mlflow_run_id"]
    assert all(hit.data.tags[k] == reused.tags[k] for k in ("eval.fingerprint", "eval.seeds", "data.fingerprint"))
    assert set(hit.data.metrics) >= set(reused.metrics) and hit.data.metrics["eval.bpb"] == reused.metrics["eval.bpb"]
    assert "running" not in capsys.readouterr().out
    assert Path(manifest(wd, "train")["output"]).is_dir()

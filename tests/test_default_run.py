"""The README's first command, `python pipelines/full.py` with no arguments, run once from a fresh
directory (and once more for the cache; conftest's default_run): what it builds, what its console
shows a person, what it leaves in MLflow, and its workdir moved elsewhere. The last test makes a stage
fail there."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mlflow import MlflowClient

from conftest import SPIKY, STAGES, manifest

# What must not reach the terminal when nothing failed: error-level lines (Python's, and Ray's C++
# "[date time E pid tid]" lines), and Ray's internals that a newcomer reads as failures or noise.
NOISE = [r"\bERROR\b", r"\[\d{4}-\d\d-\d\d [\d:,.]+ E \d+ \d+\]", r"TrainController", r"RayTrainWorker",
         r"PreemptionWatcher", r"core_worker\.cc", r"worker processes have been started", r"\(raylet\)",
         r"\(pid=", r"Progress bars disabled", r"Token authentication", r"Traceback"]


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(re.search(p, line) for p in NOISE)]


def test_the_default_command_generates_the_sample_and_reruns_from_cache(default_run):
    where, first, second, made = default_run.where, default_run.first, default_run.second, default_run.manifests
    assert f"generating the sample corpus in {where}/data/sample ({SPIKY} planted spiky, for the screen to find)" in first.stdout
    assert "mlflow ui --backend-store-uri sqlite:///" in first.stdout
    # the commands it prints run as printed from where it ran: mlflow and python of its own environment, not on PATH
    mlflow = re.search(r"look at it with: (\S+) ui ", first.stdout)[1]
    python = re.search(r"compare ablations with: (\S+) pipelines/compare.py", first.stdout)[1]
    assert all((where / program).is_file() for program in (mlflow, python)), (mlflow, python)
    planted = json.loads((where / "data" / "sample" / "PLANTED.json").read_text())
    assert list(planted["spiky"]) == [SPIKY] and (where / "work" / "mlflow.db").is_file()
    assert made["screen"]["dropped_subsets"] == [SPIKY]  # and only it: every stage has something to catch
    assert "generating" not in second.stdout and "running" not in second.stdout
    assert all(f"[{s}] cache hit" in second.stdout for s in STAGES), second.stdout
    assert (Path(made["train"]["output"]) / "model" / "config.json").is_file()


def test_the_console_has_a_line_per_stage_and_the_problems_but_none_of_rays_output(default_run):
    first, second, made = default_run.first, default_run.second, default_run.manifests
    for run in (first, second):
        assert noise(run.stdout + run.stderr) == []
    for stage in STAGES:  # one line when it starts, one when it ends with its rows and time
        assert re.search(rf"^\[{stage}\] running \(", first.stdout, re.M), stage
        assert re.search(rf"^\[{stage}\] done in [\d.]+s: rows_in=\d+ rows_out=\d+", first.stdout, re.M), stage
    rejected = made["ingest"]["counts"]["rejected"]
    assert rejected > 0  # the sample plants malformed lines, a non-UTF-8 file and a truncated .zst
    assert f"[ingest] {rejected} input records rejected as unreadable" in first.stderr
    # Ray's own output went to the stage logs instead (its start-up lines, Ray Data's execution plans).
    logs = {s: (Path(made[s]["output"]).parent / "stage.log").read_text() for s in STAGES}
    assert "Started a local Ray instance" in logs["ingest"] and "Execution plan of Dataset" in logs["dedup"]
    run_dir = Path(made["train"]["run_dir"])
    assert re.search(r"step 100/100 loss", (run_dir / "train.log").read_text())  # rank 0's log, in the run folder


def test_mlflow_opens_on_training_runs_and_the_parent_run_has_the_summary(default_run, tmp_path):
    where, first, made = default_run.where, default_run.first, default_run.manifests
    client = MlflowClient(f"sqlite:///{where}/work/mlflow.db")
    experiment = client.get_experiment_by_name("local")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    parent_id = re.search(r"MLflow: experiment 'local', run (\w+)", first.stdout).group(1)
    assert {a.path for a in client.list_artifacts(parent_id)} >= {"stages.md", "funnel.png"}
    table = Path(client.download_artifacts(parent_id, "stages.md", str(tmp_path))).read_text()
    for stage in STAGES:
        counts = made[stage]["counts"]
        row = next(line for line in table.splitlines() if line.startswith(f"| {stage} |"))
        assert f"| ran | {counts['rows_in']:,} | {counts['rows_out']:,} |" in row, row
    assert "rejected 15" in next(line for line in table.splitlines() if line.startswith("| ingest |"))
    parent = client.get_run(parent_id)
    assert parent.data.tags["mlflow.note.content"] == table  # the run's description too
    assert parent.data.metrics["ingest.rejected"] == 15 and parent.data.metrics["train.rows_out"] > 0
    # The link that opens the experiment on its runs (the MLflow 3 UI's model-training view).
    assert f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}?workflowType=machine_learning" in first.stdout
    assert f"this run: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs/{parent_id}?workflowType=" in first.stdout
    # Its headline figures: each row's bits per byte and each task's accuracy, the mean over the training seeds, with
    # its interval and seed count, beside the stage counts; and the saved view that puts every pipeline run's side
    # by side in the runs table, whose link it prints.
    trained = client.get_run(made["train"]["mlflow_run_id"]).data.metrics
    seeds = [int(s) for s in client.get_run(made["train"]["mlflow_run_id"]).data.tags["eval.seeds"].split(",")]
    figures = parent.data.metrics
    assert figures["bpb.all"] == pytest.approx(np.mean([trained[f"seed{s}/eval.bpb"] for s in seeds]), rel=1e-12)
    assert figures["bpb.pile.HackerNews"] == pytest.approx(np.mean([trained[f"seed{s}/eval.bpb.pile.HackerNews"] for s in seeds]))
    assert figures["bpb.all.seeds"] == len(seeds) == 3 and figures["bpb.all.ci95"] > 0 and "bpb.macro" in figures
    downstream = client.get_run(made["downstream"]["mlflow_run_id"]).data
    (task,) = downstream.tags["downstream.tasks"].split(",")
    scored = downstream.tags["downstream.seeds"].split(",")
    assert figures[f"accuracy.{task}"] == pytest.approx(np.mean([downstream.metrics[f"seed{s}/downstream.{task}"] for s in scored]))
    view = json.loads(json.loads(experiment.tags["mlflow.sharedViewState.ablations"])["state"])
    assert view["selectedColumns"][:3] == ["metrics.`bpb.all`", "metrics.`bpb.all.ci95`", "metrics.`bpb.macro`"]
    assert f"metrics.`accuracy.{task}`" in view["selectedColumns"]
    assert (f"side by side: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs?viewStateShareKey="
            "ablations&workflowType=machine_learning") in first.stdout
    png = Path(client.download_artifacts(parent_id, "funnel.png", str(tmp_path))).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert all(f"| {stage} | cached | " in default_run.summary for stage in STAGES)  # the rerun's, beside the stages


def test_a_moved_workdir_runs_from_cache_and_its_check_names_each_damaged_file(default_run, tmp_path, monkeypatch,
                                                                              capsys):
    """The README run's workdir copied and moved (`mv`), then the README command on it: every stage a cache hit
    on the outputs where they now are, with the same final loss. Then a part of dedup's output truncated and a
    tokenize shard rewritten without its last rows: `--check` names both files and exits 1."""
    from pipelines.full import main

    moved = tmp_path / "moved"
    shutil.copytree(default_run.where / "work", tmp_path / "copy", ignore=shutil.ignore_patterns("mlartifacts"))
    (tmp_path / "copy").rename(moved)
    monkeypatch.chdir(default_run.where)  # the README command's relative paths (its sample corpus)
    capsys.readouterr()
    assert main(["--workdir", str(moved)]) == 0
    out = capsys.readouterr().out
    assert all(f"[{s}] cache hit" in out for s in STAGES) and "running" not in out, out
    assert all(manifest(moved, s)["output"].startswith(f"{moved}/{s}/") for s in STAGES)
    final_loss = default_run.manifests["train"]["metrics"]["final_loss"]
    assert manifest(moved, "train")["metrics"]["final_loss"] == final_loss
    part = sorted(Path(manifest(moved, "dedup")["output"]).glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    shard = sorted(Path(manifest(moved, "tokenize")["output"]).rglob("*.arrow"))[0]
    with pa.OSFile(str(shard)) as source:  # read into memory: the file is rewritten next
        table = pa.ipc.open_file(source).read_all()
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table.slice(0, table.num_rows - 1))  # one packed sequence fewer
    assert main(["--workdir", str(moved), "--check"]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED: {part}: " in out and f"DAMAGED: {shard}: " in out, out


def test_a_failing_stage_still_prints_its_error_and_where_its_log_is(default_run, ray_session, capsys, monkeypatch):
    """In this process (on the session's Ray), in the same directory: a stage that fails says so, with its log."""
    from pipelines.full import main

    where = default_run.where
    monkeypatch.chdir(where)
    capsys.readouterr()
    assert main(["--only", "train", "--set", "train.global_batch_tokens=4096000"]) == 1
    err = capsys.readouterr().err
    assert "error: stage 'train' failed: " in err and "fewer than one global batch" in err
    log = re.search(r"log: (\S+stage\.log)", err).group(1)
    assert "Traceback" in Path(log).read_text()
    assert json.loads((where / "work" / "train" / "manifest.json").read_text())["counts"]  # the good output stays


def test_the_printed_programs_survive_a_working_directory_that_is_gone(tmp_path, monkeypatch):
    """Under `ray job submit` the job's working directory can be removed before the run prints its hints: the
    programs are then named by their absolute paths, not lost to an error after the run's work is done."""
    import sys

    from core.tracking import program

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert program("python") == sys.executable and Path(program("mlflow")).is_file()

"""The DAG runner on a real small Ray Data pipeline: caching, reruns, failures, accounting, MLflow."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import ROOT, write_config
from minipipeline import mini_stages, write_inputs
from pipelines.config import load_config
from core.dag import Stage, StageResult, code_version, fingerprints
from pipelines.full import main
from pipelines.stages import raw_files_identity

STAGES = ["ingest", "normalize", "dedup", "report"]


@pytest.fixture
def project(tmp_path, ray_session):
    expected = write_inputs(tmp_path / "raw")
    cfg = write_config(tmp_path, f"""
sources:
  - {{name: mini, format: jsonl, paths: ["{tmp_path}/raw/*.jsonl"]}}
workdir: {tmp_path}/work
""")

    def run(*args: str, stages=None) -> int:
        return main(["--config", str(cfg), *args], stages=stages or mini_stages())

    run.workdir = tmp_path / "work"
    run.expected = expected
    run.config = cfg
    return run


def manifest(workdir: Path, stage: str) -> dict:
    return json.loads((workdir / stage / "manifest.json").read_text())


def manifest_bytes(workdir: Path) -> dict[str, bytes]:
    return {s: (workdir / s / "manifest.json").read_bytes() for s in STAGES}


def rows(path: str | Path) -> list[dict]:
    files = sorted(Path(path).glob("*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def stage_runs(workdir: Path) -> list:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("test")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_first_run_writes_complete_accounted_outputs_and_mlflow_runs(project, capsys, monkeypatch):
    import core.imports

    parse, parsed = core.imports._imports_of, []  # each stage's code is read from source once a run (core/dag.py)
    monkeypatch.setattr(core.imports, "_imports_of", lambda *key: parsed.append(key) or parse(*key))
    assert project() == 0
    assert parsed and len(parsed) == len(set(parsed)), [k for k in set(parsed) if parsed.count(k) > 1][:3]
    wd, exp = project.workdir, project.expected
    counts = {s: manifest(wd, s)["counts"] for s in STAGES}
    assert counts["ingest"] == {"rows_in": exp["lines"], "rows_out": exp["lines"] - exp["rejected"], "rejected": exp["rejected"]}
    assert counts["normalize"]["dropped"] == exp["dropped"]
    assert counts["dedup"] == {"rows_in": exp["lines"] - exp["rejected"] - exp["dropped"], "rows_out": exp["kept"],
                               "duplicate": exp["duplicate"]}
    for stage in STAGES:
        m = manifest(wd, stage)
        assert set(m) >= {"stage", "fingerprint", "inputs", "config", "output", "counts", "started", "finished", "mlflow_run_id"}
        assert os.path.isabs(m["output"]) and Path(m["output"]).is_dir()
        assert Path(m["output"]).parent.name == m["fingerprint"][:16]
    # The counts are the rows on disk, not just numbers: outputs and set-aside rows add up.
    ingest_dir = Path(manifest(wd, "ingest")["output"]).parent
    assert len(rows(ingest_dir / "output")) == counts["ingest"]["rows_out"]
    assert sorted(r["reason"] for r in rows(ingest_dir / "rejects"))[0].startswith("malformed line")
    dedup_dir = Path(manifest(wd, "dedup")["output"]).parent
    kept = rows(dedup_dir / "output")
    assert len(kept) == exp["kept"]
    assert 'backslash \\ "quote"' in {r["text"] for r in kept}  # byte-exact through every stage
    assert {r["kept_id"] for r in rows(dedup_dir / "duplicates")} <= {r["id"] for r in kept}
    assert manifest(wd, "dedup")["inputs"] == {"normalize": manifest(wd, "normalize")["fingerprint"]}

    runs = stage_runs(wd)
    parent = [r for r in runs if r.data.tags.get("kind") == "pipeline"]
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    assert sorted(r.data.tags["stage"] for r in nested) == sorted(STAGES)
    dedup_run = next(r for r in nested if r.data.tags["stage"] == "dedup")
    assert dedup_run.info.run_id == manifest(wd, "dedup")["mlflow_run_id"]
    assert dedup_run.data.tags["cache_hit"] == "false"
    assert dedup_run.data.tags["fingerprint"] == manifest(wd, "dedup")["fingerprint"]
    assert dedup_run.data.params["threshold"] == "0.95"
    assert dedup_run.data.metrics["duplicate"] == exp["duplicate"] and dedup_run.data.metrics["seconds"] > 0
    assert "mlflow ui --backend-store-uri" in capsys.readouterr().out


def test_second_run_is_all_cache_hits(project, capsys):
    assert project() == 0
    completed = {s: (Path(manifest(project.workdir, s)["output"]).parent / "manifest.json").stat().st_mtime_ns for s in STAGES}
    capsys.readouterr()
    assert project() == 0
    out = capsys.readouterr().out
    assert all(f"[{s}] cache hit" in out for s in STAGES), out
    assert "running" not in out
    after = {s: (Path(manifest(project.workdir, s)["output"]).parent / "manifest.json").stat().st_mtime_ns for s in STAGES}
    assert after == completed
    second = [r for r in stage_runs(project.workdir) if r.data.tags.get("cache_hit") == "true"]
    assert sorted(r.data.tags["stage"] for r in second) == sorted(STAGES)
    assert all(r.data.metrics["rows_out"] >= 0 for r in second)


def test_only_dedup_force_reruns_dedup_alone(project, capsys):
    assert project() == 0
    before = manifest_bytes(project.workdir)
    capsys.readouterr()
    assert project("--only", "dedup", "--force") == 0
    out = capsys.readouterr().out
    after = manifest_bytes(project.workdir)
    assert "[dedup] running" in out and "[normalize]" not in out and "[report]" not in out
    assert {s for s in STAGES if before[s] != after[s]} == {"dedup"}
    old, new = json.loads(before["dedup"]), json.loads(after["dedup"])
    assert old["fingerprint"] == new["fingerprint"] and old["mlflow_run_id"] != new["mlflow_run_id"]
    assert len(rows(new["output"])) == new["counts"]["rows_out"]  # the replaced output is complete


def test_dedup_config_change_reruns_dedup_and_downstream_only(project, capsys):
    assert project() == 0
    before = {s: manifest(project.workdir, s)["fingerprint"] for s in STAGES}
    capsys.readouterr()
    assert project("--set", "dedup.threshold=0.9") == 0
    out = capsys.readouterr().out
    after = {s: manifest(project.workdir, s)["fingerprint"] for s in STAGES}
    assert "[ingest] cache hit" in out and "[normalize] cache hit" in out
    assert "[dedup] running" in out and "[report] running" in out
    assert {s for s in STAGES if before[s] != after[s]} == {"dedup", "report"}
    assert manifest(project.workdir, "dedup")["config"]["threshold"] == 0.9
    # Switching the ablation back is a cache hit: completed outputs are kept per fingerprint.
    capsys.readouterr()
    assert project() == 0
    out = capsys.readouterr().out
    assert "running" not in out
    assert {s: manifest(project.workdir, s)["fingerprint"] for s in STAGES} == before


def test_from_reruns_that_stage_and_everything_after(project, capsys):
    assert project() == 0
    before = manifest_bytes(project.workdir)
    capsys.readouterr()
    assert project("--from", "normalize", "--force") == 0
    after = manifest_bytes(project.workdir)
    assert {s for s in STAGES if before[s] != after[s]} == {"normalize", "dedup", "report"}


def test_only_without_built_inputs_is_a_usage_error(project, capsys):
    assert project("--only", "dedup") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "needs the output of 'normalize'" in err and "--from normalize" in err
    assert not (project.workdir / "dedup").exists()


def test_failing_stage_keeps_previous_output_and_exits_1(project, capsys):
    assert project() == 0
    before = manifest_bytes(project.workdir)
    capsys.readouterr()
    assert project("--set", "normalize.min_chars=99999") == 1
    err = capsys.readouterr().err
    assert "stage 'normalize' failed: RuntimeError: planted failure" in err
    assert manifest_bytes(project.workdir) == before  # nothing downstream ran, nothing switched
    partial = next((project.workdir / "normalize").glob(".partial-*"))
    assert str(partial) in err
    assert "Traceback" in (partial / "stage.log").read_text()
    failed = [r for r in stage_runs(project.workdir) if r.info.status == "FAILED"]
    assert {r.data.tags.get("stage", r.data.tags.get("kind")) for r in failed} == {"normalize", "pipeline"}


def test_a_copied_workdir_runs_from_its_own_outputs_after_the_original_moved_away(project, capsys):
    """`cp -r work work2`, `mv work work_old`, an ablation in work2: ingest's and normalize's cache hits are work2's
    own outputs (not the absolute paths recorded when they were made), so dedup reads every row normalize
    committed; before, it read the moved-away folder as empty and committed zero rows."""
    assert project() == 0
    work2, old = project.workdir.parent / "work2", project.workdir.parent / "work_old"
    shutil.copytree(project.workdir, work2)
    project.workdir.rename(old)
    capsys.readouterr()
    assert project("--workdir", str(work2), "--set", "dedup.threshold=0.9") == 0
    out = capsys.readouterr().out
    assert "[ingest] cache hit" in out and "[normalize] cache hit" in out and "[dedup] running" in out, out
    assert all(manifest(work2, s)["output"].startswith(f"{work2}/{s}/") for s in STAGES)
    dedup = manifest(work2, "dedup")
    assert dedup["counts"]["rows_in"] == manifest(work2, "normalize")["counts"]["rows_out"] > 0
    assert dedup["counts"]["rows_out"] == len(rows(dedup["output"])) == project.expected["kept"]
    # Only MLflow's artifact folder is back where the workdir was: the store keeps an experiment's artifact
    # root as an absolute path (README, "The workdir").
    assert sorted(os.listdir(project.workdir)) == ["mlartifacts"]
    assert project("--workdir", str(work2), "--check") == 0
    assert "every output found is intact" in capsys.readouterr().out


def test_a_damaged_cache_is_named_rebuilt_when_selected_and_stops_a_run_that_needs_it_unselected(project, capsys):
    """A part of dedup's output truncated, normalize's output deleted to free disk, and a stage that reads
    nothing from an input that committed rows: each named by file, never taken as an empty input."""
    assert project() == 0
    before = manifest_bytes(project.workdir)
    stages = list(mini_stages())
    stages[2] = Stage("dedup", ("normalize",), "dedup", lambda ctx: StageResult(0, 0, {"duplicate": 0}),
                      code=("minipipeline",))  # what dedup did with a missing input: zero rows, exit 0
    capsys.readouterr()
    assert project("--only", "dedup", "--force", stages=tuple(stages)) == 1
    err = capsys.readouterr().err
    assert "read 0 rows, but normalize committed 6" in err and manifest_bytes(project.workdir) == before
    dedup_dir = Path(manifest(project.workdir, "dedup")["output"]).parent
    normalize_dir = Path(manifest(project.workdir, "normalize")["output"]).parent
    part = sorted((dedup_dir / "output").glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:-40])
    shutil.rmtree(normalize_dir / "output")
    assert project("--check") == 1
    out = capsys.readouterr().out
    assert f"{part}: {part.stat().st_size} bytes" in out and "(truncated or replaced)" in out, out
    assert f"DAMAGED: {normalize_dir / 'output'}/" in out and ": missing (" in out
    assert project("--only", "dedup") == 1  # normalize is needed but not selected: stop, naming it
    err = capsys.readouterr().err
    assert "needs the output of 'normalize', which is damaged: " in err and str(normalize_dir / "output") in err
    assert "rebuild it with --from normalize" in err and manifest_bytes(project.workdir) == before
    assert project() == 0  # a whole run rebuilds both, saying why, to the same rows
    out = capsys.readouterr().out
    assert "[normalize] its cached output is damaged, rebuilding it: " in out and "[normalize] running" in out
    assert "[dedup] its cached output is damaged, rebuilding it: " in out and "[report] cache hit" in out
    assert len(rows(manifest(project.workdir, "dedup")["output"])) == project.expected["kept"]
    assert project("--check", "--verify") == 0


def test_counts_that_do_not_add_up_fail_the_stage(project, capsys):
    def leaky(ctx):
        return StageResult(rows_in=10, rows_out=7, set_aside={"dropped": 2})

    stages = list(mini_stages())
    stages[1] = Stage("normalize", ("ingest",), "normalize", leaky, code=("minipipeline",))
    assert project(stages=tuple(stages)) == 1
    assert "counts do not add up: rows_in=10 but rows_out + set aside = 9" in capsys.readouterr().err
    assert not (project.workdir / "normalize" / "manifest.json").exists()


def test_code_change_changes_fingerprint_of_the_stage_and_downstream(tmp_path, monkeypatch):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.jsonl").write_text('{"text": "x"}\n')
    cfg = load_config(write_config(tmp_path, f'sources: [{{name: a, format: jsonl, paths: ["{tmp_path}/raw/*.jsonl"]}}]'))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "norm_code.py").write_text("VERSION = 1\n")
    stages = [
        Stage("ingest", (), "sources", None, external=raw_files_identity),
        Stage("normalize", ("ingest",), "normalize", None, code=("norm_code",)),
        Stage("dedup", ("normalize",), "dedup", None),
    ]
    before = fingerprints(cfg, stages)
    v1 = code_version(stages[1])
    (tmp_path / "norm_code.py").write_text("VERSION = 2\n")
    assert code_version(stages[1]) != v1
    after = fingerprints(cfg, stages)
    assert before["ingest"] == after["ingest"]
    assert before["normalize"] != after["normalize"] and before["dedup"] != after["dedup"]
    # A new raw file changes ingest's fingerprint (and so everything's).
    (tmp_path / "raw" / "b.jsonl").write_text('{"text": "y"}\n')
    assert fingerprints(cfg, stages)["ingest"] != after["ingest"]


def test_a_stages_code_is_what_its_run_imports_so_a_new_module_reruns_it_and_an_unused_one_does_not(tmp_path,
                                                                                                 monkeypatch):
    """The code version follows imports (core/imports.py): one inside a function, a package's __init__ on the way,
    a module named in `from package import module`. A hand-kept list of modules would miss the new one."""
    import importlib

    from core.dag import code_modules

    pkg = tmp_path / "proj"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "stage.py": "def run(ctx):\n    from proj import helper\n    return helper.go(ctx)\n",
                       "helper.py": "def go(ctx):\n    return ctx\n", "orphan.py": "X = 1\n",
                       "sub/__init__.py": "", "sub/deep.py": "Y = 1\n"}.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = Stage("dedup", (), "dedup", importlib.import_module("proj.stage").run)
    assert list(code_modules(stage)) == ["proj", "proj.helper", "proj.stage"]
    v1 = code_version(stage)

    (pkg / "orphan.py").write_text("X = 2\n")  # imported by nobody
    assert code_version(stage) == v1
    (pkg / "helper.py").write_text("from proj.sub import deep\n\ndef go(ctx):\n    return deep.Y\n")
    assert list(code_modules(stage)) == ["proj", "proj.helper", "proj.stage", "proj.sub", "proj.sub.deep"]
    v2 = code_version(stage)
    assert v2 != v1
    (pkg / "sub" / "deep.py").write_text("Y = 2\n")  # the new module's edits rerun the stage too
    assert code_version(stage) != v2


def test_the_pipelines_stages_hash_every_module_they_import():
    """The train stage's hand-kept list once left out five modules train/stage.py imports: with the imports read,
    each is part of its code version, and the screen's (which trains proxies) too."""
    from core.dag import code_modules
    from pipelines.stages import STAGES

    code = {stage.name: set(code_modules(stage)) for stage in STAGES}
    missed = {"train.goodput", "train.health", "train.failures", "train.follow", "train.loop.trainer"}
    assert missed <= code["train"] and missed <= code["screen"], (missed - code["train"], missed - code["screen"])
    assert {"dedup.stage", "dedup.lsh", "dedup.minhash", "corpus.evalset"} <= code["dedup"]
    assert not any(m.startswith(("train.", "screen.", "dedup.")) for m in code["ingest"] | code["normalize"])


def test_killed_mid_stage_leaves_no_half_output_taken_as_complete(project, tmp_path, capsys):
    assert project() == 0
    before = manifest_bytes(project.workdir)
    script = tmp_path / "slow.py"
    script.write_text(f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
import ray.cloudpickle, minipipeline
ray.cloudpickle.register_pickle_by_value(minipipeline)
from pipelines.full import main
from pipelines.stages import raw_files_identity
sys.exit(main(sys.argv[1:], stages=minipipeline.mini_stages(normalize_run=minipipeline.slow_normalize)))
""")
    proc = subprocess.Popen([sys.executable, str(script), "--config", str(project.config), "--from", "normalize",
                             "--force", "--set", "ray.num_cpus=1"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = project.workdir / "normalize-started"
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "the slow pipeline exited early"
            assert time.time() < deadline, "the slow stage never started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray it started
        proc.wait()
    partial = Path(marker.read_text())
    assert (partial / "output" / "part-0.parquet").exists()  # the half output is there...
    assert manifest_bytes(project.workdir) == before  # ...and nothing points at it
    assert not (project.workdir / "normalize" / partial.name.split("-")[1]).exists() or \
        json.loads(before["normalize"])["fingerprint"].startswith(partial.name.split("-")[1])
    capsys.readouterr()
    assert project("--from", "normalize", "--force") == 0
    now = manifest(project.workdir, "normalize")
    assert not partial.exists()  # the stale partial is cleared when the stage runs again
    assert all(f.read_bytes()[:4] == b"PAR1" for f in Path(now["output"]).glob("*.parquet"))
    assert len(rows(now["output"])) == now["counts"]["rows_out"]


def test_a_manifests_temp_file_is_made_new_never_written_through_a_planted_link(tmp_path, monkeypatch):
    from core import dag

    target = tmp_path / "auth_token"
    target.write_text("secret")
    monkeypatch.setattr(dag.secrets, "token_hex", lambda n: "beef")  # the name a planted link would have to guess
    link = tmp_path / f".manifest.json.{os.getpid()}.beef.tmp"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        dag._write_json_atomic(tmp_path / "manifest.json", {"stage": "ingest"})
    assert target.read_text() == "secret" and not (tmp_path / "manifest.json").exists()
    link.unlink()
    dag._write_json_atomic(tmp_path / "manifest.json", {"stage": "ingest"})
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"stage": "ingest"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auth_token", "manifest.json"]

"""The console's pieces without a pipeline: progress off a terminal, following a run folder, and
Ray's loggers routed to the stage's log file instead of the terminal."""

from __future__ import annotations

import io
import json
import logging

from core import console
from core.console import Bar, route_ray_logging, stage_log
from train.follow import Follower


def test_a_bar_off_a_terminal_is_a_line_now_and_then(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(console, "LOG_EVERY", 3600.0)
    with Bar("train", "steps", 300, stream=out) as bar:
        bar.update_to(10, "loss 6.1")
    assert out.getvalue() == ""  # a short stage says nothing between its start and end lines
    monkeypatch.setattr(console, "LOG_EVERY", 0.0)
    with Bar("train", "steps", 300, stream=out) as bar:
        bar.update_to(150, "loss 5.9")
        bar.update()
    assert out.getvalue().splitlines() == ["[train] 150/300 steps, loss 5.9", "[train] 151/300 steps, loss 5.9"]


def test_the_follower_counts_steps_and_reports_incidents_as_they_come(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "incidents.jsonl").write_text(json.dumps({"step": 3, "what": "an earlier attempt's"}) + "\n")
    bar = Bar("screen", "proxy steps", 120, stream=io.StringIO())
    follower = Follower("screen", {"HackerNews seed 0": run, "baseline seed 0": tmp_path / "not-yet"}, bar)
    with open(run / "metrics.jsonl", "a") as metrics:
        for step in (1, 2, 3):
            metrics.write(json.dumps({"step": step, "loss": 7.0 - step / 10}) + "\n")
        metrics.write('{"step": 4, "lo')  # a line being written: not read until it is complete
        metrics.flush()
        follower.poll()
        assert bar.n == 3 and follower.loss == 6.7
        metrics.write('ss": 6.6}\n')
    with open(run / "incidents.jsonl", "a") as incidents:
        incidents.write(json.dumps({"step": 4, "what": "injected kill on rank 1"}) + "\n")
    (tmp_path / "not-yet").mkdir()
    (tmp_path / "not-yet" / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 7.1}) + "\n")
    follower.poll()
    assert bar.n == 4 + 2 and bar.postfix.startswith("loss ")
    err = capsys.readouterr().err
    assert err.splitlines() == ["[screen] HackerNews seed 0: step 4: injected kill on rank 1"]  # not the earlier one


def test_the_follower_sends_each_tracked_runs_metric_records_to_mlflow_at_their_steps(tmp_path, monkeypatch, capsys):
    """The driver, not a worker, sends a run's metrics.jsonl to its MLflow run: every complete line, at its step and
    time, in one batch a run every FLUSH_SECONDS and the rest when the runs end; NaN and non-numbers left out; an
    untracked run (a later seed) sends nothing. A send that fails is said, and the run goes on."""
    from mlflow import MlflowClient

    from core.tracking import StageRun
    from train import follow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("e")).info.run_id
    stage_run = StageRun(uri, parent)
    child = stage_run.child("screen baseline seed 0", tags={}, params={})
    tracked, other = tmp_path / "tracked", tmp_path / "other"
    tracked.mkdir(), other.mkdir()
    monkeypatch.setattr(follow, "FLUSH_SECONDS", 3600.0)
    follower = Follower("screen", {"baseline seed 0": tracked, "seed 1": other}, Bar("screen", "steps", 10, stream=io.StringIO()),
                        stage_run=stage_run, tracked={"baseline seed 0": child})
    with follower:
        with open(tracked / "metrics.jsonl", "a") as metrics, open(other / "metrics.jsonl", "a") as untracked:
            for step in (1, 2, 3):
                metrics.write(json.dumps({"step": step, "loss": 7.0 - step / 10, "grad_norm": float("nan") if step == 2 else 1.5,
                                          "time": 1_700_000_000.0 + step}) + "\n")
                untracked.write(json.dumps({"step": step, "loss": 9.0, "time": 1_700_000_000.0}) + "\n")
            metrics.write(json.dumps({"step": 3, "eval.bpb": 2.5, "note": "text", "time": 1_700_000_004.0}) + "\n")
            metrics.write('{"step": 4, "lo')  # a line being written
            metrics.flush()
        follower.poll()
        assert client.get_metric_history(child, "loss") == []  # not yet: one batch every FLUSH_SECONDS
        monkeypatch.setattr(follow, "FLUSH_SECONDS", 0.0)
        follower.poll()
        assert [(m.step, m.value, m.timestamp) for m in client.get_metric_history(child, "loss")] == [
            (1, 6.9, 1_700_000_001_000), (2, 6.8, 1_700_000_002_000), (3, 6.7, 1_700_000_003_000)]
        monkeypatch.setattr(follow, "FLUSH_SECONDS", 3600.0)
        with open(tracked / "metrics.jsonl", "a") as metrics:
            metrics.write('ss": 6.6, "time": 1700000005.0}\n')
    assert [m.step for m in client.get_metric_history(child, "loss")] == [1, 2, 3, 4]  # the rest, at the end
    assert [m.step for m in client.get_metric_history(child, "grad_norm")] == [1, 3]  # NaN left out
    assert [(m.step, m.value) for m in client.get_metric_history(child, "eval.bpb")] == [(3, 2.5)]
    assert "note" not in client.get_run(child).data.metrics and client.get_run(parent).data.metrics == {}

    client.delete_run(child)  # a store that refuses: said, and the follower goes on
    capsys.readouterr()
    with open(tracked / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": 5, "loss": 6.5}) + "\n")
    follower.poll(last=True)
    assert "baseline seed 0: 1 metric records not sent to MLflow" in capsys.readouterr().err


def terminal_handlers() -> list[logging.Handler]:
    """The handlers of the driver's Ray loggers that write to the terminal (not to a file)."""
    return [h for name in console.RAY_LOGGERS for h in logging.getLogger(name).handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def test_rays_loggers_write_to_the_stage_log_and_only_errors_to_the_terminal(tmp_path):
    route_ray_logging(verbose=False)
    # Ray's terminal handlers write to the stderr of the moment Ray was imported, which no capture sees in a
    # whole test session: what they let through is their level. tests/test_default_run.py reads a real terminal.
    assert terminal_handlers() and all(h.level == logging.ERROR for h in terminal_handlers())
    with stage_log(tmp_path / "stage.log"):
        logging.getLogger("ray.data._internal.execution").info("Execution plan of Dataset x")
        logging.getLogger("ray").warning("Token authentication is enabled")
        logging.getLogger("pipelines.stage.dedup").info("the stage's own line")
    logging.getLogger("ray").warning("after the stage: nowhere")
    text = (tmp_path / "stage.log").read_text()
    assert "Execution plan of Dataset x" in text and "Token authentication" in text and "the stage's own line" in text
    assert "after the stage" not in text
    route_ray_logging(verbose=True)
    try:
        assert all(h.level == logging.INFO for h in terminal_handlers())
    finally:
        route_ray_logging(verbose=False)

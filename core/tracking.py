"""MLflow tracking: one experiment per config, a parent run per invocation, a nested run per stage.

Runs are addressed by id through `MlflowClient` rather than MLflow's fluent "active run" stack,
so that code on Ray workers (training, proxy runs) can log to a stage's run given only the
tracking URI and the run id from its StageContext.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from core.config import ConfigError, no_credentials, uri_secret

if TYPE_CHECKING:
    from mlflow import MlflowClient


@dataclass
class MlflowConfig:
    """Where runs are tracked. Loading a config imports no MLflow: this module imports it where a client is made."""

    tracking_uri: str | None = None
    """The MLflow tracking server or store. `null`: `$MLFLOW_TRACKING_URI` (the cluster's server) if set, else a
    SQLite file, WORKDIR/mlflow.db. No user or password in it: give credentials through the environment."""
    experiment: str | None = None
    """The MLflow experiment the runs go to, and the one compare.py reads. `null`: the run's `name` (the config
    file's name: `local`, `opt-175b`, ...)."""
    artifact_location: str | None = None
    """Where run artifacts go, given to MLflow when it creates the experiment: any URI MLflow writes to
    (`s3://bucket/mlflow`, `gs://...`, `file://...`) or a folder. `null`: WORKDIR/mlartifacts."""

    def validate(self, key: str) -> None:
        no_credentials(self, key, "tracking_uri", "artifact_location")


def environment_tracking_uri() -> str | None:
    """`$MLFLOW_TRACKING_URI`, the default of `mlflow.tracking_uri`, checked as a config's is (uri_secret): it is
    printed and copied into MLflow's params as the config's value."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and (problem := uri_secret(uri)):
        raise ConfigError("", f"$MLFLOW_TRACKING_URI is a URI with {problem}: give MLflow's user and password in "
                          "~/.mlflow/credentials (or $MLFLOW_TRACKING_USERNAME and $MLFLOW_TRACKING_PASSWORD), never "
                          "in the URI, which is printed and copied into MLflow's params")
    return uri


def admin_password() -> str:
    """The password MLflow's server creates its admin user with (cluster.yaml's head start-up): the one its clients
    read, from ~/.mlflow/credentials. Without one the head's start stops here with one line, rather than starting
    MLflow with whatever the missing value prints as ("None")."""
    from mlflow.utils.credentials import read_mlflow_creds

    password = read_mlflow_creds().password
    if not password:
        raise SystemExit("error: no MLflow password: write mlflow_tracking_password in ~/.mlflow/credentials (docs/"
                         "cluster.md, step 1) on the machine that runs `ray up`, then run it again")
    return password


MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
MAX_TAG_LENGTH = 8000  # and on a tag value
# The experiment's type, which the MLflow 3 UI reads to open an experiment on its training runs, not on
# the GenAI overview (traces, evaluations) it shows an experiment of unknown type.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
BATCH = 100  # MLflow's limit on params per log_batch call


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store


def program(name: str) -> str:
    """`name` (python, mlflow) of the environment this runs in, as a person types it here: after `make run` both are
    in .venv/bin, which is not on PATH, so a bare `mlflow` would not be found."""
    path = Path(sys.executable) if name == "python" else Path(sys.executable).with_name(name)
    if not path.is_absolute() or not path.exists():
        return name
    try:  # a job's working directory may be gone by the end of its run (Ray's runtime env)
        return str(path.relative_to(os.getcwd()))
    except (ValueError, OSError):
        return str(path)


def ui_link(tracking_uri: str, experiment_id: str, run_id: str | None = None, relative: bool = False,
            view: str | None = None) -> str:
    """The MLflow UI's page of an experiment, of one of its runs, or of its runs table in a saved `view`, in the
    model-training view: the MLflow 3 UI opens each on its GenAI view (traces, evaluations) unless the link asks
    for the other (`workflowType`, which takes precedence over the experiment's type tag). `relative`: the page
    alone, for a link inside the UI."""
    page = (f"#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "/runs" if view else "") + "?"
            + (f"viewStateShareKey={view}&" if view else "") + "workflowType=machine_learning")
    if relative:
        return page
    server = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI
    return f"{server}/{page}"


def ui_hint(tracking_uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """How to open that page: the link, after starting `mlflow ui` on a local store."""
    link = ui_link(tracking_uri, experiment_id, run_id)
    if tracking_uri.startswith(("http://", "https://")):
        return link
    return f"{program('mlflow')} ui --backend-store-uri {tracking_uri}, then {link}"


def metric_name(key: str) -> str:
    """MLflow allows letters, digits, '_', '-', '.', ' ', '/' and ':' in names: "Gutenberg (PG-19)" -> "Gutenberg _PG-19_"."""
    return re.sub(r"[^\w\-. /:]", "_", key)


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"}: how a stage's config becomes MLflow params."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        out = {}
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}.{i}"))
        return out
    text = "null" if data is None else str(data)
    return {prefix: text[:MAX_PARAM_LENGTH]}


def log_params(client: MlflowClient, run_id: str, params: dict) -> None:
    """A nested config as a run's params ("a.b.c": value), BATCH per call."""
    from mlflow.entities import Param

    _send(client, run_id, "params", [Param(k, v) for k, v in flatten(params).items()])


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Metrics of a run under MLflow's names (metric_name), None values left out, BATCH per call."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    _send(client, run_id, "metrics", [Metric(metric_name(k), float(v), now, step)
                                      for k, v in metrics.items() if v is not None])


def _send(client: MlflowClient, run_id: str, kind: str, items: list) -> None:
    """One run's MLflow Param or Metric items (`kind` "params" or "metrics"), BATCH per log_batch call."""
    for i in range(0, len(items), BATCH):
        client.log_batch(run_id, **{kind: items[i : i + BATCH]})


class MlflowTracker:
    def __init__(self, tracking_uri: str, experiment: str, artifact_location: str | None = None,
                 tags: dict[str, str] | None = None):
        for name in ("mlflow", "alembic"):  # "creating database tables..." on every new store
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.experiment_id = self._experiment(experiment, artifact_location)
        self.tags = dict(tags or {})  # on every run this tracker creates (the ablation's name and diff)
        self.parent_id: str | None = None
        self._run_id: str | None = None  # the run metrics go to: the stage's, else the parent's

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                found = self.client.get_experiment(self.client.create_experiment(name, artifact_location=artifact_location))
            except Exception:  # created meanwhile by a concurrent invocation
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.tags.get(EXPERIMENT_KIND) != MODEL_TRAINING:
            self.client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return found.experiment_id

    @contextlib.contextmanager
    def _run(self, name: str, params: dict, tags: dict, resume_run_id: str | None = None) -> Iterator[str]:
        if resume_run_id is not None:  # the same run continues: its params are already there
            run_id = resume_run_id
            self.client.update_run(run_id, status="RUNNING")
            resumes = int(self.client.get_run(run_id).data.tags.get("resumes", "0")) + 1
            self.client.set_tag(run_id, "resumes", str(resumes))
            if self.parent_id is not None:
                self.client.set_tag(run_id, f"resumed_by.{resumes}", self.parent_id)
        else:
            run_tags = {**self.tags, **tags}
            if self.parent_id is not None:
                run_tags["mlflow.parentRunId"] = self.parent_id
            run = self.client.create_run(self.experiment_id, run_name=name, tags=run_tags)
            run_id = run.info.run_id
            log_params(self.client, run_id, params)
        status = "FAILED"
        try:
            yield run_id
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.client.set_terminated(run_id, status)

    @contextlib.contextmanager
    def pipeline(self, name: str, params: dict, tags: dict) -> Iterator[str]:
        """The parent run of one invocation; stage runs opened inside it are nested under it."""
        with self._run(name, params, tags) as run_id:
            self.parent_id = self._run_id = run_id
            try:
                yield run_id
            finally:
                self.parent_id = self._run_id = None

    @contextlib.contextmanager
    def stage(self, name: str, params: dict, tags: dict, resume_run_id: str | None = None) -> Iterator[str]:
        with self._run(name, params, tags, resume_run_id) as run_id:
            outer, self._run_id = self._run_id, run_id
            try:
                yield run_id
            finally:
                self._run_id = outer

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        log_metrics(self.client, self._run_id, metrics, step)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self._run_id, key, value)

    def log_artifact(self, path) -> None:
        self.client.log_artifact(self._run_id, str(path))

    def final_metrics(self, run_id: str) -> dict[str, float]:
        """A run's metrics as they ended (each one's last value); {} when this store does not have it (a workdir
        tracked elsewhere before)."""
        from mlflow.exceptions import MlflowException

        try:
            return dict(self.client.get_run(run_id).data.metrics)
        except MlflowException:
            return {}


def log_rows(client: MlflowClient, run_id: str, rows: list[dict]) -> None:
    """A training run's metric records (metrics.jsonl's rows: a step, a time and numbers) as metrics at their step and
    time; what is not a finite number is left out, BATCH per call."""
    from mlflow.entities import Metric

    _send(client, run_id, "metrics", [
        Metric(metric_name(k), float(v), int(row.get("time", time.time()) * 1000), int(row.get("step", 0)))
        for row in rows for k, v in row.items()
        if k not in ("step", "time", "record") and isinstance(v, (int, float)) and math.isfinite(v)])


class StageRun:
    """A stage's MLflow run as the stage's own code reaches it, by tracking URI and run id (its StageContext's):
    tags, tables, figures and artifacts, and the nested runs it opens for its parts (the screen's proxy runs).
    MlflowTracker opens and closes the stage's run; this only writes to it."""

    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id

    def tags(self) -> dict[str, str]:
        return dict(self.client.get_run(self.run_id).data.tags)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_artifact(self, path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_figure(self, figure, name: str) -> None:
        self.client.log_figure(self.run_id, figure, name)

    def log_table(self, columns: dict[str, list], name: str) -> None:
        self.client.log_table(self.run_id, columns, name)

    def child(self, name: str, tags: dict[str, str], params: dict) -> str:
        """A run nested under this one, in its experiment, with `params` flattened (log_params); its id."""
        experiment = self.client.get_run(self.run_id).info.experiment_id
        run = self.client.create_run(experiment, run_name=name, tags={"mlflow.parentRunId": self.run_id, **tags})
        log_params(self.client, run.info.run_id, params)
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Metrics of this run or of one of its children."""
        log_metrics(self.client, run_id, metrics, step)

    def log_rows(self, run_id: str, rows: list[dict]) -> None:
        """A training run's metric records (log_rows), of this run or of one of its children."""
        log_rows(self.client, run_id, rows)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        """A child run ended: FINISHED, or FAILED."""
        self.client.set_terminated(run_id, status)

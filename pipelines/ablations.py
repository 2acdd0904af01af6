"""The data ablations as MLflow holds them: the one reader of pipeline and stage runs for compare.py and
benchmarks/ablation_noise.py.

An ablation is every finished pipeline run tagged with its name (`full.py --ablation NAME`; "base" for the config
file as it is): a run that failed or is still running does not count. For each ablation and stage, the newest stage
run among its pipeline runs counts (ran or cache hit: a
cache hit logs the counts of the output it reuses), so an ablation built over several invocations (`--only
dedup`, then the rest) is still one. Its training run gives the loss curve, the seeds and each seed's bits per
byte on the held-out evaluation set, and that set's fingerprint: ablations evaluated on different sets are
refused."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config import ConfigError
from pipelines.config import CHECKS, load_config
from pipelines.stages import STAGES


class Unreadable(ValueError):
    """Ablations that cannot be read or compared: a bad config, no such experiment or ablation, none at all, or
    ablations evaluated on different held-out sets. The message is the command line's one line."""


@dataclass
class Ablation:
    name: str
    diff: str
    pipeline_runs: list[str] = field(default_factory=list)
    stages: dict[str, object] = field(default_factory=dict)  # stage -> its newest MLflow run
    loss: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss)
    fingerprint: str | None = None  # the evaluation set's (the train run's `eval.fingerprint` tag)
    bpb: dict[str, list[float]] = field(default_factory=dict)  # row ("" for the whole set) -> one value per seed
    seeds: list[int] = field(default_factory=list)


def read(names: list[str] | None = None, *, config: str | None = None, workdir: str | None = None,
         experiment: str | None = None, tracking_uri: str | None = None) -> list[Ablation]:
    """The ablations named (all when none, base first) of the config's experiment (or `experiment`), from its
    MLflow store (or `tracking_uri`), checked to be evaluated on one held-out set; Unreadable otherwise."""
    from mlflow import MlflowClient

    try:
        cfg = load_config(config, [], workdir, checks=CHECKS)
    except ConfigError as exc:
        raise Unreadable(str(exc)) from exc
    uri, name = tracking_uri or cfg.mlflow.tracking_uri, experiment or cfg.mlflow.experiment
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(name)
    if found is None:
        raise Unreadable(f"no MLflow experiment {name!r} in {uri}")
    ablations = collect(client, found.experiment_id, names)
    if not ablations:
        raise Unreadable(f"no finished pipeline runs in experiment {name!r}")
    check_reference(ablations, named=bool(names))
    check_comparable(ablations)
    return ablations


def check_reference(ablations: list[Ablation], named: bool) -> None:
    """The first ablation is the one every other is measured against: base unless others are named, and with an
    evaluation when any other has one. Otherwise Unreadable, naming it: without the check the next ablation
    would silently become the reference."""
    first = ablations[0]
    if not named and first.name != "base":
        raise Unreadable(f"no finished pipeline run tagged ablation='base' (the reference; there are: "
                         f"{', '.join(a.name for a in ablations)}): run the config as it is, or name the reference first")
    if not first.bpb and any(a.bpb for a in ablations[1:]):
        raise Unreadable(f"{first.name}, the reference, has no finished training run with an evaluation on the "
                         "held-out set: its newest training run failed, or did not run")


def collect(client, experiment_id: str, names: list[str] | None) -> list[Ablation]:
    """The ablations of an experiment (all, or those named, in that order), newest stage runs first."""
    parents = client.search_runs([experiment_id], "tags.kind = 'pipeline' and attributes.status = 'FINISHED'",
                                 order_by=["attributes.start_time DESC"], max_results=5000)
    found: dict[str, Ablation] = {}
    for run in parents:
        name = run.data.tags.get("ablation")
        if name is None:
            continue
        ablation = found.setdefault(name, Ablation(name, run.data.tags.get("ablation.diff", "")))
        ablation.pipeline_runs.append(run.info.run_id)
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise Unreadable(f"no pipeline run tagged ablation={missing[0]!r}; there are: {', '.join(sorted(found)) or 'none'}")
        chosen = [found[n] for n in names]
    else:
        chosen = sorted(found.values(), key=lambda a: (a.name != "base", a.name))
    for ablation in chosen:
        for parent in ablation.pipeline_runs:  # newest first: the first run of a stage found is the one shown
            for run in client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent}' and "
                                          "attributes.status = 'FINISHED'", max_results=1000):
                stage = run.data.tags.get("stage")
                if stage in {s.name for s in STAGES} and stage not in ablation.stages:
                    ablation.stages[stage] = run
        train = ablation.stages.get("train")
        if train is not None:
            source = train.data.tags.get("cached_from_run") if train.data.tags.get("cache_hit") == "true" else train.info.run_id
            history = client.get_metric_history(source, "loss")
            by_step = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # a redone step: its last value
            ablation.loss = sorted(by_step.items())
            tags = client.get_run(source).data.tags
            ablation.fingerprint = tags.get("eval.fingerprint")
            ablation.seeds = [int(s) for s in tags.get("eval.seeds", "").split(",") if s]
            ablation.bpb = seed_values(train.data.metrics, ablation.seeds)
    return chosen


def seed_values(metrics: dict[str, float], seeds: list[int]) -> dict[str, list[float]]:
    """`seed<s>/eval.bpb[.<row>]` metrics -> {row: [value for each seed]} (rows every seed has)."""
    out: dict[str, list[float]] = {}
    for seed in seeds:
        prefix = f"seed{seed}/eval.bpb"
        for key, value in metrics.items():
            if key == prefix or key.startswith(prefix + "."):
                out.setdefault(key[len(prefix) + 1:], []).append(value)
    return {row: values for row, values in out.items() if len(values) == len(seeds)}


def check_comparable(ablations: list[Ablation]) -> None:
    """One evaluation set for every ablation with a training run, or Unreadable naming two that differ."""
    trained = [a for a in ablations if a.stages.get("train") is not None]
    for a in trained[1:]:
        if a.fingerprint != trained[0].fingerprint:
            raise Unreadable(f"{trained[0].name} was evaluated on eval.fingerprint={trained[0].fingerprint} and {a.name} on "
                             f"eval.fingerprint={a.fingerprint}: different held-out sets (eval.* or normalize settings), "
                             "so their bits per byte do not compare")

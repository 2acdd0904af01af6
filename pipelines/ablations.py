"""The data ablations as MLflow holds them: the one reader of pipeline and stage runs for compare.py and
benchmarks/ablation_noise.py.

An ablation is every finished pipeline run tagged with its name (`full.py --ablation NAME`; "base" for the config
file as it is): a run that failed or is still running does not count. For each ablation and stage, the newest stage
run among its pipeline runs counts (ran or cache hit: a cache hit carries the tags and metrics of the run it reuses),
so an ablation built over several invocations (`--only dedup`, then the rest) is still one. Its training runs give
the loss curve (the newest's), the seeds and each seed's bits per byte on the held-out evaluation set, pooled over
every training run of the ablation on the same data (an ablation run again on more seeds adds them), and that set's
fingerprint: ablations evaluated on different sets are refused, and so are an ablation's runs on different data."""

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
    downstream: dict[str, list[float]] = field(default_factory=dict)  # task -> its accuracy, one per seed ...
    downstream_seeds: list[int] = field(default_factory=list)  # ... of these (the downstream stage's runs)


@dataclass
class Store:
    """The MLflow experiment the ablations are in, and a client of its store."""

    client: object  # MlflowClient
    uri: str
    experiment: str
    experiment_id: str


def store(*, config: str | None = None, workdir: str | None = None, experiment: str | None = None,
          tracking_uri: str | None = None) -> Store:
    """The config's experiment (or `experiment`) in its MLflow store (or `tracking_uri`); Unreadable when the config
    is bad or the experiment does not exist."""
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
    return Store(client, uri, name, found.experiment_id)


def read(names: list[str] | None = None, *, config: str | None = None, workdir: str | None = None,
         experiment: str | None = None, tracking_uri: str | None = None, where: Store | None = None) -> list[Ablation]:
    """The ablations named (all when none, base first) of the config's experiment (or `experiment`), from its
    MLflow store (or `tracking_uri`), or of `where`, checked to be evaluated on one held-out set; Unreadable
    otherwise."""
    where = where or store(config=config, workdir=workdir, experiment=experiment, tracking_uri=tracking_uri)
    ablations = collect(where.client, where.experiment_id, names)
    if not ablations:
        raise Unreadable(f"no finished pipeline runs in experiment {where.experiment!r}")
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
        fill(client, experiment_id, ablation)
    return chosen


def of_pipeline_run(client, experiment_id: str, run_id: str) -> Ablation:
    """One pipeline run as an ablation of its own (its stage runs that finished, its seeds only): what its headline
    figures are computed from while it is still open."""
    tags = client.get_run(run_id).data.tags
    ablation = Ablation(tags.get("ablation", ""), tags.get("ablation.diff", ""), pipeline_runs=[run_id])
    fill(client, experiment_id, ablation)
    return ablation


def fill(client, experiment_id: str, ablation: Ablation) -> None:
    """An ablation's stage runs, seeds, scores, evaluation fingerprint and loss curve, from its pipeline runs."""
    scored: dict[str, list] = {"train": [], "downstream": []}  # every run of the stages with scores per seed
    for parent in ablation.pipeline_runs:  # newest first: the first run of a stage found is the one shown
        for run in client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent}' and "
                                      "attributes.status = 'FINISHED'", max_results=1000):
            stage = run.data.tags.get("stage")
            if stage in {s.name for s in STAGES} and stage not in ablation.stages:
                ablation.stages[stage] = run
            scored.get(stage, []).append(run)
    if scored["downstream"]:
        ablation.downstream_seeds, ablation.downstream = pooled(ablation.name, reused_runs(client, scored["downstream"]),
                                                                "downstream.seeds", "downstream")
    if scored["train"]:
        sources = reused_runs(client, scored["train"])
        ablation.seeds, ablation.bpb = pooled(ablation.name, sources, "eval.seeds", "eval.bpb")
        ablation.fingerprint = sources[0].data.tags.get("eval.fingerprint")
        history = client.get_metric_history(sources[0].info.run_id, "loss")
        by_step = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # a redone step: its last value
        ablation.loss = sorted(by_step.items())


def reused_runs(client, runs: list) -> list:
    """Stage runs, newest first -> the runs that did the work (a cache hit's `cached_from_run`), each once."""
    out, seen = [], set()
    for run in runs:
        tags = run.data.tags
        source = tags.get("cached_from_run") if tags.get("cache_hit") == "true" else run.info.run_id
        if source not in seen:
            seen.add(source)
            out.append(run if source == run.info.run_id else client.get_run(source))
    return out


def pooled(name: str, runs: list, seeds_tag: str, metric: str) -> tuple[list[int], dict[str, list[float]]]:
    """The seeds of an ablation's runs (newest first) and {row: one value per seed} of `seed<s>/<metric>[.<row>]`,
    pooled over the runs: an ablation run again with more seeds (`--set train.seed=5`) adds them; a seed run twice
    counts once, its newest run. Runs of other training data (the `data.fingerprint` tag: tokenize's shards, by
    content) or another evaluation set cannot be pooled: Unreadable, naming both."""
    newest = runs[0].data.tags
    by_seed: dict[int, dict[str, float]] = {}
    for run in runs:
        tags = run.data.tags
        for key in ("data.fingerprint", "eval.fingerprint"):
            if tags.get(key) != newest.get(key) or (len(runs) > 1 and key not in tags):  # not recorded: not known equal
                raise Unreadable(f"ablation {name!r} has runs of two {key}s, {newest.get(key)} (run "
                                 f"{runs[0].info.run_id}) and {tags.get(key)} (run {run.info.run_id}): its seeds cannot "
                                 "be pooled; name the new runs with another --ablation, or delete the old ones")
        for seed in (int(s) for s in tags.get(seeds_tag, "").split(",") if s):
            if seed not in by_seed:
                by_seed[seed] = seed_values(run.data.metrics, seed, metric)
    seeds = sorted(by_seed)
    rows = set.intersection(*(set(v) for v in by_seed.values())) if seeds else set()
    return seeds, {row: [by_seed[s][row] for s in seeds] for row in sorted(rows)}


def seed_values(metrics: dict[str, float], seed: int, metric: str) -> dict[str, float]:
    """`seed<s>/<metric>[.<row>]` metrics -> {row: value} ("" for `<metric>` itself)."""
    prefix = f"seed{seed}/{metric}"
    return {key[len(prefix) + 1:]: value for key, value in metrics.items() if key == prefix or key.startswith(prefix + ".")}


def check_comparable(ablations: list[Ablation]) -> None:
    """One evaluation set for every ablation with a training run, or Unreadable naming two that differ."""
    trained = [a for a in ablations if a.stages.get("train") is not None]
    for a in trained[1:]:
        if a.fingerprint != trained[0].fingerprint:
            raise Unreadable(f"{trained[0].name} was evaluated on eval.fingerprint={trained[0].fingerprint} and {a.name} on "
                             f"eval.fingerprint={a.fingerprint}: different held-out sets (eval.* or normalize settings), "
                             "so their bits per byte do not compare")

"""The train stage: Ray Train's TorchTrainer running `train.loop.train_loop` on every worker.

The run lives in a folder of its own, `<train.storage or WORKDIR/train/runs>/<config>-<fingerprint>/`,
outside the stage's attempt folder: checkpoints, metrics.jsonl, incidents.jsonl and Ray Train's
storage. The same command after a crash of the driver finds the same folder (same fingerprint),
and the workers resume from its newest checkpoint; the runner resumes the same MLflow run
(the stage is `resumable`). A dead or hung worker (a watchdog ends a step or a start-up
that runs too long) is restarted by Ray Train (`FailureConfig(max_failures)`, no limit by default)
from the newest checkpoint that verifies, until the same checkpoint has been restarted from
`max_stalled_restarts` times in a row, or the same error has ended two attempts in a row
(train/failures.py: each attempt's start and each failure, with its node, rank, step and class, are recorded in
attempts.jsonl, and `give_up` reads it as each attempt starts).

With `train.seeds: K`, K - 1 more runs of the same data and settings, seeds seed + 1 ..., follow the run on
the same workers (`seeds_loop`), each in `seed-<s>/` of the run folder, with an export of its own (for the
downstream stage) but no MLflow metrics of their own. Every run's final evaluation goes to the stage's MLflow run
as `seed<s>/eval.*`, the seeds as the tag `eval.seeds`, the evaluation set's fingerprint as `eval.fingerprint`
and the training shards' as `data.fingerprint`: what pipelines/compare.py reads to tell a difference between
ablations from the noise between seeds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from train.config import EngineConfig, TrainConfig
from core.console import Bar, note
from core.dag import StageContext, StageResult
from train import goodput, health, records
from train.follow import Follower
from train.loader import read_index
from train.loop.config import LoopConfig, loop_config
from train.plot import plot_run
from train.spikes import read_grad_norms, spike_score


def run_dir(ctx: StageContext) -> Path:
    storage = Path(ctx.section.storage) if ctx.section.storage else Path(ctx.config.workdir) / "train" / "runs"
    return storage / f"{ctx.config.name}-{ctx.fingerprint[:16]}"


def fit(cfg: EngineConfig, config, folder: Path, loop=None):
    """One Ray Train job: `loop(config)` (train_loop with a LoopConfig by default; the screen's proxy jobs and
    the placement probe pass their own loop and its typed config) on cfg.num_workers workers, restarted up to max_failures times (-1: always); Ray Train's own records go to
    `folder`/ray. Returns Ray Train's Result. The trainer is train/ray_trainer.py's: Ray Train's, less the actors
    it would start for nothing."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from train.failures import FailureRecorder, RestartHealthCheck
    from train.loop import train_loop
    from train.loop.drill import NodeFaults
    from train.ray_trainer import LeanTorchTrainer

    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.gpus_per_worker:
        resources["GPU"] = cfg.gpus_per_worker
    trainer = LeanTorchTrainer(
        loop or train_loop, train_loop_config=config,
        timeout_s=int(cfg.collective_timeout_seconds),
        scaling_config=ScalingConfig(num_workers=workers(cfg), use_gpu=cfg.gpus_per_worker > 0,
                                     resources_per_worker=resources, elastic_resize_monitor_interval_s=NEVER),
        run_config=RunConfig(name="ray", storage_path=str(folder), failure_config=FailureConfig(max_failures=cfg.max_failures),
                             worker_runtime_env={"env_vars": WORKER_ENV},
                             callbacks=[FailureRecorder(str(folder)),
                                        *([RestartHealthCheck(str(folder), cfg.health,
                                                              worker=(cfg.cpus_per_worker, cfg.gpus_per_worker),
                                                              drill=NodeFaults.for_run(folder, cfg.inject))]
                                          if checks_health(cfg) else [])]),
    )
    if isinstance(cfg, TrainConfig) and cfg.elastic.enabled:
        trainer.replica_workers = cfg.parallel.model_parallel  # its group sized in whole replicas
    return trainer.fit()


# Each training worker's process environment, beside the job's. Ray Train runs the training function in a thread of
# its own, not the process's main thread, and glibc gives such a thread a malloc arena of its own, made of heaps of
# at most 64 MB that it hands back to the kernel as they empty: every step's activations and gradients on CPU were
# then page faults again. A 125M step took 1.14x as long in a thread as in the main thread, a third of its CPU time
# in the kernel; with one arena (the main one, which keeps what it had), the same as in the main thread
# (docs/benchmarks.md, "125M on CPU, in one process and in a Ray Train worker"). Other threads allocate little: one arena costs them nothing.
# Read by glibc as the process starts; other C libraries ignore it.
WORKER_ENV = {"MALLOC_ARENA_MAX": "1"}

NEVER = 10.0 ** 9  # Ray Train's own resize of a running group: off (train/loop/elastic.py grows at a checkpoint)


def workers(cfg: EngineConfig) -> int | tuple[int, int]:
    """Ray Train's `num_workers`: the configured count, or with `train.elastic` the range it may start in, from
    `min_replicas` replicas up. Ray Train then starts (and restarts) the group with what the cluster can host. It
    would also resize a running group when nodes join, at any step: our loop grows at its next checkpoint instead,
    so nothing is lost (train/loop/elastic.py), and Ray's monitor is set to never."""
    if not (isinstance(cfg, TrainConfig) and cfg.elastic.enabled):  # the screen's proxies: a fixed group
        return cfg.num_workers
    return cfg.elastic.min_replicas * cfg.parallel.model_parallel, cfg.num_workers


def export_dir(output: Path, seed: int, first: int) -> Path:
    """Where a seed's Hugging Face export is in the stage's output: `model/` for the first seed (the run's own),
    `seed-<s>/model/` for each other one (what the downstream stage evaluates, a model per seed)."""
    return output / "model" if seed == first else output / f"seed-{seed}" / "model"


def seed_runs(cfg: TrainConfig, shards: str, folder: Path, output: Path) -> dict[int, LoopConfig]:
    """{seed: its run's config} for the seeds after the first: the same data and settings, no faults injected,
    metrics in their own folder only, the model exported into the stage's `output` (export_dir). An export per
    seed costs little at the laptop's size and is what lets downstream tasks see the noise between seeds; at
    175B one trains one seed (`train.seeds: 1`), and so exports one model."""
    out = {}
    for seed in range(cfg.seed + 1, cfg.seed + cfg.seeds):
        (folder / f"seed-{seed}").mkdir(exist_ok=True)
        out[seed] = loop_config(dataclasses.replace(cfg, seed=seed, seeds=1, inject=[]), shards, folder / f"seed-{seed}",
                                export_dir=str(export_dir(output, seed, cfg.seed)))
    return out


def run(ctx: StageContext) -> StageResult:
    cfg: TrainConfig = ctx.section
    folder = run_dir(ctx)
    folder.mkdir(parents=True, exist_ok=True)
    shards = str(ctx.input_output("tokenize"))
    config = loop_config(cfg, shards, folder, export_dir=str(export_dir(ctx.output, cfg.seed, cfg.seed)))
    config.write(folder / records.LOOP_CONFIG)
    others = seed_runs(cfg, shards, folder, ctx.output)
    ctx.log.info("run folder %s: %d steps of %d sequences x %d tokens on %d workers", folder, config.last_step,
                 config.global_batch, config.seq_len, cfg.num_workers)
    if cut := config.cut_short():
        note("train", cut)
    goodput.mark(folder, "launch")
    from train.loop.drill import before_launch

    before_launch(folder, cfg.inject)
    if checks_health(cfg):
        check_nodes(ctx, cfg, folder)
    from train.loop import seeds_loop

    followed = {"": folder, **{f"seed {seed}": Path(c.run_dir) for seed, c in others.items()}}
    from core.tracking import StageRun

    # the first seed's curves go to the stage's MLflow run (the other seeds' are in their folders: track_seeds)
    stage_run = StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id) if ctx.mlflow_run_id else None
    with Bar("train", "steps", config.last_step * cfg.seeds) as bar, \
            Follower("train", followed, bar, stage_run=stage_run, tracked={"": ctx.mlflow_run_id}):
        fit(cfg, [config, *others.values()], folder, loop=seeds_loop)
    goodput.mark(folder, "finish")
    time_spent = goodput.account(folder)
    summary = records.read_summary(folder)
    for name in records.COPIED:
        if (folder / name).exists():
            (ctx.output / name).write_bytes((folder / name).read_bytes())
    logbook = records.read(folder, records.ENTRY)
    with open(ctx.output / records.LOGBOOK_MD, "a") as f:
        f.write(("\n" if f.tell() else "# Logbook\n\n") + goodput.summary(time_spent))
    steps = records.read(folder, records.STEP)
    charts = [plot_run(steps, logbook, ctx.output / "training.png")] if steps else []
    charts.append(goodput.plot(time_spent, ctx.output / "goodput.png"))
    track_logbook(ctx, logbook, charts + [ctx.output / n for n in (records.LOGBOOK_MD, records.LOGBOOK, records.ATTEMPTS)
                                          if (ctx.output / n).exists()])
    if summary.get("stopped"):
        raise RuntimeError(f"{summary['stopped']} (logbook: {folder / records.LOGBOOK_MD})")
    index = read_index(config.shards)
    evaluations, tags = track_seeds(cfg, index, {cfg.seed: folder, **{s: Path(c.run_dir) for s, c in others.items()}})
    sequences = summary["steps"] * config.global_batch
    incidents = records.read(folder, records.INCIDENT)
    metrics = {"steps": summary["steps"], "final_loss": summary["final_loss"], "sequences_trained": sequences,
               "tokens_trained": sequences * config.seq_len, "incidents": len(incidents),
               "interventions": len(interventions(logbook)), "stragglers": len(records.read(folder, records.STRAGGLER)),
               "resizes": len(records.read(folder, records.RESIZE)), **curve_summary(folder),
               **{f"goodput.{k}": v for k, v in time_spent.items() if k != "spans"}, **checkpoint_times(folder),
               **evaluations}
    return StageResult(index["sequences"], index["sequences"], {}, metrics, tags=tags,
                       fields={"steps": summary["steps"], "final_loss": summary["final_loss"], "run_dir": str(folder),
                               "eval_fingerprint": index["eval"].get("fingerprint"), "seeds": list(range(cfg.seed, cfg.seed + cfg.seeds)),
                               "interventions": [{k: e[k] for k in ("step", "kind", "actions")} for e in interventions(logbook)]})


def curve_summary(folder: Path) -> dict[str, float]:
    """The grad-norm spikes of the run as trained (train/spikes.py: steps > 25% above their
    neighbourhood's median, and the mean excess in percent; not its growth term, which a whole run's warmup and
    plateau would dominate): what `pipelines/compare.py` puts side by side."""
    found = spike_score(read_grad_norms(folder))
    return {"spikes": found.spikes, "spike_excess": 100.0 * found.excess / max(1, found.scored_steps)}


def last_evaluation(folder: Path) -> dict[str, float]:
    """A run's last evaluation: its `eval.*` metrics ({} when it had none)."""
    rows = records.read(folder, records.EVALUATION)
    return {k: v for k, v in rows[-1].items() if k.startswith("eval.")} if rows else {}


def track_seeds(cfg: TrainConfig, index: dict, folders: dict[int, Path]) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) of the stage's run: each seed's final evaluation as `seed<s>/eval.*`, the first seed's `eval.*`
    (the run's own, which MLflow has step by step), and the set's sizes once, not per seed (`eval.size.*`: each
    row's documents, bytes and tokens scored, corpus/evalset.py); the tags `eval.seeds`, `eval.fingerprint` and
    `data.fingerprint` (the training shards by content: pipelines/ablations.py pools seeds of one data)."""
    from corpus import evalset

    out: dict[str, float] = {**evalset.sizes(index["eval"].get("units", []))}
    for seed, folder in folders.items():
        found = last_evaluation(folder)
        if seed == cfg.seed:
            out.update(found)
        out.update({f"seed{seed}/{k}": v for k, v in found.items()})
    tags = {"eval.seeds": ",".join(map(str, folders)), "eval.fingerprint": index["eval"].get("fingerprint"),
            "data.fingerprint": index.get("data_fingerprint")}
    return out, {k: v for k, v in tags.items() if v}


def checks_health(cfg: TrainConfig) -> bool:
    import ray

    if cfg.health.enabled is not None:
        return cfg.health.enabled
    return ray.is_initialized() and len(health.trainable_nodes(cfg.cpus_per_worker, cfg.gpus_per_worker)) > 1


def check_nodes(ctx: StageContext, cfg: TrainConfig, folder: Path) -> None:
    """Every node that can host a training worker probed before the first start; the ones that fail drained,
    unless so many fail that the cause looks systemic: then none is, and the run stops here saying so."""
    nodes = health.trainable_nodes(cfg.cpus_per_worker, cfg.gpus_per_worker)
    from train.loop.drill import NodeFaults

    checked = health.check(folder, nodes, cfg.health, population=len(nodes), drill=NodeFaults.for_run(folder, cfg.inject))
    ctx.log.info("health check: %d nodes probed, %d excluded", len(nodes), len(checked.excluded))
    if checked.systemic:
        raise RuntimeError(f"health check: {checked.systemic}\n{checked.table()}\n(see {folder / records.HEALTH})")
    if len(checked.excluded) == len(nodes):
        raise RuntimeError(f"every node failed its health check (see {folder / records.HEALTH})")


def interventions(logbook: list[dict]) -> list[dict]:
    """The logbook's entries that changed the run (a straggler named, or its drain refused, is in the logbook, but
    changed nothing; a straggler's node drained and the run restarted did). An elastic run's change of size is the
    cluster's doing, not a decision of the run's: counted apart (`resizes`)."""
    return [e for e in logbook if e["kind"] not in ("straggler", "straggler_kept", "resized")]


def checkpoint_times(folder: Path) -> dict[str, float]:
    """The saves' blocked and write seconds, summed over the run (each save's are in metrics.jsonl and MLflow)."""
    rows = records.read(folder, records.CHECKPOINT)
    return {key: round(sum(r[key] for r in rows), 3)
            for key in ("checkpoint.blocked_seconds", "checkpoint.write_seconds")}


def track_logbook(ctx: StageContext, logbook: list[dict], files: list[Path]) -> None:
    """The interventions as tags of the stage's MLflow run (autopilot.N = "step S: kind -> actions"),
    the logbook and the chart as its artifacts."""
    from core.tracking import StageRun

    stage_run = StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id)
    probes = [records.without_record(p) for p in records.read(ctx.output, records.PROBE)]
    if probes:  # the health checks as a table in MLflow's artifact view, a row per node probed
        stage_run.log_table({k: [p.get(k) for p in probes] for k in probes[0]}, "health_checks.json")
    for straggler in records.read(ctx.output, records.STRAGGLER, records.DRAIN):  # named, then (stragglers.exclude) drained
        if straggler["record"] == records.DRAIN.name:
            stage_run.set_tag(f"straggler.rank{straggler['rank']}.drain", f"step {straggler['step']}: " + (
                "drained" if straggler["drained"] else f"not drained: {straggler['refused'] or 'Ray refused'}"))
        else:
            stage_run.set_tag(f"straggler.rank{straggler['rank']}",
                              f"step {straggler['step']}: {straggler['host']} (node {straggler['node']})")
    for i, resize in enumerate(records.read(ctx.output, records.RESIZE), 1):  # train.elastic: when and why
        stage_run.set_tag(f"resize.{i}", f"step {resize['step']}: {resize['from']} -> {resize['to']} replicas: {resize['why']}")
    logbook = interventions(logbook)
    stage_run.set_tag("autopilot.interventions", str(len(logbook)))
    for i, entry in enumerate(logbook, 1):
        stage_run.set_tag(f"autopilot.{i}", f"step {entry['step']}: {entry['kind']} -> {', '.join(entry['actions'])}")
    for path in files:
        stage_run.log_artifact(path)

"""The screen stage: which subsets make a proxy model's gradient norms spike, measured and dropped.

1. Census and sample (screen/mixture.py): documents and bytes per subset of dedup's output, then
   a seeded sample of what is not screened (the baseline) and of each screened subset.
2. A proxy tokenizer (the tokenize stage's code, on the sample, or GPT-2's files) and one token
   mixture per candidate: the baseline with the subset up-weighted to `upweight` of the tokens,
   plus the baseline mix alone.
3. Proxy runs, in rounds (screen/score.py `adaptive`): for a mixture and seed, the training loop
   (train/loop/, DeepSpeed, the same loader) with the same hyperparameters, `steps` steps, no
   checkpoints and no autopilot. Round one runs `seeds` seeds of every mixture; each later round
   more seeds of the baseline and of the subsets still inconclusive (one each, or as many as fill
   the `concurrent_runs` jobs that would otherwise idle), up to `max_seeds`. `concurrent_runs` Ray
   Train jobs at a time take the runs from one queue across the rounds (screen/proxies.py), up to
   `runs_per_job` each: 1, the default, is a job per run (a failure or a slow node touches one
   run); a laptop config lets a job run many, because starting one with DeepSpeed costs seconds of
   imports that a tiny proxy run does not. Each run is a nested MLflow run under the stage's (tags:
   subset, seed, role) with its loss and grad-norm curves and its roughness.
4. Decision (screen/score.py): each subset's roughness against the baseline mix's under the same
   seed; drop, keep or inconclusive at the error rate `alpha` against the line `ratio`. Dropped
   subsets' documents go to `dropped/` with the reason (and inconclusive ones' with
   `inconclusive: drop`), and so do the subsets named in `drop` (a data ablation, measured or not);
   every other document goes to the output, unchanged. screen.png shows
   the decision: each subset's paired effects and bounds against the line, and the grad-norm
   curves of each subset not kept beside the baseline's.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path


from corpus.parts import DOCUMENT_SCHEMA, DROPPED_SCHEMA, Parts, check_read, check_written, input_parts, iter_rows, \
    parquet_bytes, parquet_files, row_group_ranges, run_tasks, task_bytes
from corpus.tokenize import TokenizerTask, tokenizer_task
from corpus import tokenizer as tokenizers
from corpus.config import SourceConfig
from screen.config import ScreenConfig
from train.config import AutopilotConfig, EngineConfig, TrainConfig
from core.console import Bar
from core.dag import StageContext, StageResult
from screen import mixture, score
from screen.proxies import ProxyJobs
from train.follow import Follower
from train.spikes import read_run
from screen.score import BASELINE

TASK_BYTES = 64 << 20  # of dedup's documents per census/sample/filter task, at most


def proxy_train_config(cfg: ScreenConfig, seed: int) -> TrainConfig:
    """The training config of one proxy run: the proxy section plus what every proxy run shares."""
    p = cfg.proxy
    batch_tokens = p.batch_tokens
    engine = {f.name: getattr(p, f.name) for f in dataclasses.fields(EngineConfig)}
    return TrainConfig(**{**engine, "global_batch_tokens": batch_tokens}, warmup_tokens=p.warmup_steps * batch_tokens,
                       total_tokens=cfg.steps * batch_tokens, final_lr_ratio=1.0,  # constant LR after warmup: no decay to hide spikes
                       max_steps=cfg.steps, checkpoint_every=0, eval_every=0, max_failures=1, seed=seed,
                       autopilot=AutopilotConfig(enabled=False))


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "_"


def run(ctx: StageContext) -> StageResult:
    cfg: ScreenConfig = ctx.section
    parts = input_parts(ctx.inputs, "dedup")
    ranges = row_group_ranges(parts, task_bytes(parquet_bytes(parts), TASK_BYTES))
    census: dict[tuple[str, str], list[int]] = {}
    for result in run_tasks(mixture.census_task, [mixture.CensusTask(p, tuple(g)) for p, g in ranges]):
        for key, (docs, size) in result.items():
            entry = census.setdefault(tuple(key.split("\0")), [0, 0])
            entry[0] += docs
            entry[1] += size
    sources = screened_sources(ctx.config.screen, ctx.config.sources)
    screened = candidates(cfg, sources, census)
    ctx.log.info("screening %d subsets of %s: %s", len(screened), sources, screened)

    decisions: dict[str, score.Decision] = {}
    runs: list[dict] = []
    rounds: list[list] = []
    if cfg.enabled and screened:
        decisions, runs, rounds = measure(ctx, ranges, census, screened)
    leave = {score.DROP} | ({score.INCONCLUSIVE} if cfg.inconclusive == "drop" else set())
    dropped_subsets = {s: d.reason for s, d in decisions.items() if d.outcome in leave}
    present = {subset for _, subset in census}
    unknown = [name for name in cfg.drop if name not in present]
    if unknown:
        raise ValueError(f"screen.drop: no document of subset {unknown[0]!r} reaches the screen; there are: {', '.join(sorted(present))}")
    dropped_subsets.update({name: "dropped by screen.drop (a data ablation)" for name in cfg.drop})
    counts = filter_documents(ctx, ranges, dropped_subsets)
    check_read(counts["rows_in"], ctx.inputs, "dedup")
    check_written(ctx.output, counts["rows_out"], "rows_out")
    check_written(ctx.aside("dropped"), counts["dropped"], "dropped")

    by_mixture: dict[str, list[float]] = {}
    for record in runs:
        by_mixture.setdefault(record["subset"], []).append(record["score"])
    scores = {name: round(float(sum(v) / len(v)), 4) for name, v in by_mixture.items()}
    metrics = {f"score.{s}": v for s, v in scores.items()}
    for s, d in decisions.items():
        metrics.update({f"effect.{s}": round(d.effect, 4), f"seeds.{s}": d.seeds})
    inconclusive = [s for s in screened if s in decisions and decisions[s].outcome == score.INCONCLUSIVE]
    fixed = (len(screened) + 1) * cfg.max_seeds if decisions else 0
    metrics.update({"proxy_runs": len(runs), "proxy_runs_saved": fixed - len(runs), "rounds": len(rounds),
                    "inconclusive": len(inconclusive)})
    metrics.update({f"dropped.{k.removeprefix('subset:')}": n for k, n in counts.items() if k.startswith("subset:")})
    kept = [s for s in screened if s not in dropped_subsets]
    ctx.log.info("kept %s; dropped %s; inconclusive %s", kept, sorted(dropped_subsets), inconclusive)
    if decisions:
        track_decisions(ctx, decisions, runs)
    return StageResult(counts["rows_in"], counts["rows_out"], {"dropped": counts["dropped"]}, metrics, fields={
        "kept_subsets": kept, "dropped_subsets": sorted(dropped_subsets), "inconclusive_subsets": inconclusive,
        "decisions": {s: {**d.to_dict(), "reason": d.reason} for s, d in decisions.items()}, "scores": scores,
        "rule": (f"paired ln(roughness / baseline's) per seed, pooled-noise t bounds at alpha={cfg.alpha} "
                 f"(/{cfg.max_seeds - cfg.seeds + 1} looks) against ratio={cfg.ratio}; seeds={cfg.seeds}..{cfg.max_seeds}, "
                 f"upweight={cfg.upweight}, inconclusive: {cfg.inconclusive}"),
        "screened": bool(cfg.enabled and screened), "proxy_runs": runs, "proxy_runs_fixed": fixed,
        "rounds": [len(r) for r in rounds]})


def screened_sources(screen: ScreenConfig, sources: list[SourceConfig]) -> list[str]:
    return screen.sources if screen.sources is not None else [s.name for s in sources if s.format == "pile"]


def candidates(cfg: ScreenConfig, sources: list[str], census: dict[tuple[str, str], list[int]]) -> list[str]:
    """The subsets to screen: `subsets` if given (each must reach the screen), else every subset of `sources`."""
    present = sorted({subset for source, subset in census if source in sources})  # a subset is named by its name
    if BASELINE in present:
        raise ValueError(f"a subset is called {BASELINE!r}, the name of the baseline mix; rename it in ingest")
    if cfg.subsets is None:
        return present
    missing = [s for s in cfg.subsets if s not in present]
    if missing:
        raise ValueError(f"screen.subsets: {missing} are not subsets of {sources} in dedup's output "
                         f"(those are: {present})")
    return list(cfg.subsets)


def measure(ctx: StageContext, ranges, census, screened: list[str]) -> tuple[dict[str, score.Decision], list[dict], list]:
    """Sample, tokenize, run the proxies round by round until every subset is decided or at max_seeds:
    the decisions, a record of every proxy run, and the rounds' (mixture, seed) runs."""
    cfg: ScreenConfig = ctx.section
    probe = proxy_train_config(cfg, cfg.seed)
    seq_len = cfg.proxy.seq_len
    global_batch = probe.global_batch_tokens // seq_len
    mixture_tokens = cfg.steps * global_batch * (seq_len + 1)
    base_rate, sub_rates = mixture.rates(census, screened, mixture_tokens * mixture.BYTES_PER_TOKEN, cfg.upweight)
    sample = ctx.folder / "sample"
    t0 = time.perf_counter()
    everything = mixture.baseline_is_everything(census, screened)
    run_tasks(mixture.sample_task, [mixture.SampleTask(p, tuple(g), f"{Path(p).stem}-{g[0]:05d}", str(sample), cfg.seed,
                                                       base_rate, sub_rates, everything) for p, g in ranges])
    tok_dir = ctx.folder / "tokenizer"
    run_tasks(tokenizer_task, [TokenizerTask(cfg.tokenizer, cfg.seed, tuple(parquet_files(sample)), str(tok_dir))])
    names = [BASELINE] + screened
    mixtures = {name: ctx.folder / "mixtures" / slug(name) for name in names}
    built = run_tasks(mixture.mixture_task, [mixture.MixtureTask(name, str(sample), mixture_tokens, seq_len, cfg.upweight,
                                                                 str(mixtures[name]), str(tok_dir / tokenizers.FILE))
                                             for name in names])
    info = dict(zip(names, built))
    for name, found in info.items():
        ctx.log.info("mixture %s: %s", name, found)
        if found["sequences"] < global_batch:
            raise ValueError(f"mixture {name!r}: {found['sequences']} sequences, fewer than one proxy batch of {global_batch}")
    t1 = time.perf_counter()
    records: list[dict] = []

    def run_round(todo: list[tuple[str, int]]) -> dict[tuple[str, int], float]:
        jobs = [{"subset": name, "seed": seed, "folder": ctx.folder / "proxy" / f"{slug(name)}-seed{seed}",
                 "shards": str(mixtures[name]), "info": info[name], "global_batch": global_batch} for name, seed in todo]
        ctx.log.info("a round of %d proxy runs: %s", len(jobs), todo)
        run_proxies(ctx, pool, jobs)
        for job in jobs:
            records.append({"subset": job["subset"], "seed": job["seed"], "mlflow_run_id": job["run_id"],
                            "run_dir": str(job["folder"].relative_to(ctx.folder)), **job["score"].to_dict()})
        return {(job["subset"], job["seed"]): job["score"].score for job in jobs}

    with ProxyJobs(probe, concurrent=cfg.concurrent_runs, runs_per_job=cfg.runs_per_job,
                   folder=ctx.folder / "proxy") as pool:
        decisions, rounds = score.adaptive(screened, run_round, seeds=cfg.seeds, max_seeds=cfg.max_seeds,
                                           ratio=cfg.ratio, alpha=cfg.alpha, first_seed=cfg.seed, slots=cfg.concurrent_runs)
    t2 = time.perf_counter()
    for d in decisions.values():
        ctx.log.info("%s: %s", d.subset, d.reason)
    ctx.log.info("sample+mixtures %.1fs, %d proxy runs in %d rounds %.1fs", t1 - t0, len(records), len(rounds), t2 - t1)
    return decisions, records, rounds


def run_proxies(ctx: StageContext, pool: ProxyJobs, jobs: list[dict]) -> None:
    """A round's proxy runs on the screen's jobs (screen/proxies.py); every proxy run gets a nested MLflow
    run under the stage's, and its score when it is done."""
    from core.tracking import StageRun
    from train.loop.config import loop_config

    cfg: ScreenConfig = ctx.section
    stage_run = StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id)
    inherited = {k: v for k, v in stage_run.tags().items() if k == "ablation" or k.startswith("ablation.")}
    held_out = ctx.inputs["dedup"].get("eval") or {}
    if held_out.get("fingerprint"):  # the evaluation set its corpus was drawn beside (normalize's, via dedup)
        inherited["eval.fingerprint"] = held_out["fingerprint"]
    items = []
    for job in jobs:
        role = "baseline" if job["subset"] == BASELINE else "candidate"
        job["run_id"] = stage_run.child(f"screen {job['subset']} seed {job['seed']}", tags={
            "stage": "screen.proxy", "subset": job["subset"], "seed": str(job["seed"]), "role": role, **inherited},
            params={"proxy": dataclasses.asdict(cfg.proxy), "steps": cfg.steps, "seed": job["seed"],
                    "upweight": cfg.upweight, "mixture": job["info"]})
        job["folder"].mkdir(parents=True, exist_ok=True)
        items.append({"key": f"{job['subset']} seed {job['seed']}", "config": loop_config(
            proxy_train_config(cfg, job["seed"]), job["shards"], job["folder"], export_dir=None)})

    runs = {item["key"]: job["folder"] for item, job in zip(items, jobs)}
    tracked = {item["key"]: job["run_id"] for item, job in zip(items, jobs)}
    with Bar("screen", "proxy steps", len(jobs) * cfg.steps) as bar, \
            Follower("screen", runs, bar, stage_run=stage_run, tracked=tracked):
        try:
            pool.run(items)
        except Exception:
            for job in jobs:
                stage_run.finish(job["run_id"], "FAILED")
            raise
    for job in jobs:
        batches, grad_norms = read_run(job["folder"])
        shares = None if job["subset"] == BASELINE else \
            mixture.subset_shares(job["shards"], batches, job["global_batch"], job["seed"])
        job["score"] = score.roughness(batches, grad_norms, shares, burn_in=cfg.burn_in, spike_ratio=cfg.spike_ratio)
        ctx.log.info("proxy %s seed %d: %s", job["subset"], job["seed"], job["score"])
        stage_run.log_metrics(job["run_id"], {f"spike.{key}": value for key, value in job["score"].to_dict().items()})
        stage_run.finish(job["run_id"])


def track_decisions(ctx: StageContext, decisions: dict[str, score.Decision], runs: list[dict]) -> None:
    """Each subset's outcome as a tag of the stage's MLflow run (decision.<subset>), and screen.png."""
    from core.tracking import StageRun, metric_name
    from screen.chart import decision_chart

    stage_run = StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id)
    for subset, d in decisions.items():
        stage_run.set_tag(metric_name(f"decision.{subset}"), d.outcome)
    stage_run.log_artifact(decision_chart(decisions, runs, ctx.folder, ctx.folder / "screen.png"))


@dataclasses.dataclass(frozen=True)
class FilterTask:
    """A run of row groups of one of dedup's parts, split by `filter_task` into kept and dropped documents."""
    path: str
    row_groups: tuple[int, ...]
    stem: str  # of the part files it writes
    drop: dict[str, str]  # subset -> why its documents are dropped
    output: str
    dropped: str


def filter_task(task: FilterTask) -> dict:
    """One run of row groups of dedup's documents: kept ones to the output, dropped subsets' to dropped/."""
    docs = Parts(task.output, task.stem, DOCUMENT_SCHEMA)
    dropped = Parts(task.dropped, task.stem, DROPPED_SCHEMA)
    counts = {"rows_in": 0, "rows_out": 0, "dropped": 0}
    for row in iter_rows(task.path, row_groups=list(task.row_groups)):
        counts["rows_in"] += 1
        reason = task.drop.get(row["subset"])
        if reason is None:
            docs.add(row, len(row["text"]))
            counts["rows_out"] += 1
        else:
            dropped.add({**row, "reason": reason}, len(row["text"]))
            counts["dropped"] += 1
            key = f"subset:{row['subset']}"
            counts[key] = counts.get(key, 0) + 1
    docs.close()
    dropped.close()
    return counts


def filter_documents(ctx: StageContext, ranges, drop: dict[str, str]) -> dict[str, int]:
    tasks = [FilterTask(p, tuple(g), f"{Path(p).stem}-{g[0]:05d}", drop, str(ctx.output), str(ctx.aside("dropped")))
             for p, g in ranges]
    counts: dict[str, int] = {"rows_in": 0, "rows_out": 0, "dropped": 0}
    for result in run_tasks(filter_task, tasks):
        for key, value in result.items():
            counts[key] = counts.get(key, 0) + value
    return counts

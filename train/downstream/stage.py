"""The downstream stage: each seed's trained model through lm-evaluation-harness on `eval.downstream.tasks`.

A stage of its own after train, not a step of training: its fingerprint is the train stage's output, the evaluation
set (normalize's, for `heldout_continuation`), its config, lm-eval's version and our task files, so a new task list
or limit (or a new lm-eval) reruns it alone, in seconds on the laptop, and never retrains a model (its section,
`eval.downstream`, is keyed apart from the `eval` that normalize and dedup key on: core/config.py KEYED_APART).
Its failure (a dataset that cannot be downloaded, say) leaves the trained models committed and cached. And it runs
where its config puts it (`eval.downstream.gpus`), not on the training workers.

One Ray task (on `eval.downstream.gpus` GPUs) runs `python -P -m train.downstream.harness`, a process of its own that
puts each seed's model (`train.seeds`; the train stage exports every seed's: train/stage.py export_dir) through
lm-eval's Hugging Face backend in turn: one start-up (torch, transformers and lm-eval take seconds to import) and one
index of the tasks for all of them. Its output (lm-eval's and transformers' logs, each seed's results table) is
written into this stage's log; the console has a bar of the seeds done. Our tasks' data
are made first, from the held-out evaluation set (train/downstream/heldout.py), into `output/tasks/` beside a copy
of each one's YAML; a run whose tasks are all ours needs no network (Hugging Face's offline modes on).

The workdir is shared (/fsx on a cluster: anyone who can write there), so nothing in it becomes code. Run from a
folder, `python -m` would import a `json.py` planted there, and lm-eval runs the Python a task file's `!function`
names. So the harness runs in a private folder on local disk (mode 0700, removed after), with `-P` (our code found
at ROOT, never in the folder it runs in), its request on stdin, and copies of our task files: each YAML refused
unless it is the one we ship (evaluate, copy_tasks).

In MLflow, in the stage's run: `seed<s>/downstream.<task>` (the task's accuracy, lm-eval's `acc`, in [0, 1]; `em`
where a task has no `acc`, as ReCoRD; the tag `downstream.<task>.metric` says which), `downstream.<task>.examples`,
and the tags `downstream.seeds` and `downstream.tasks`; the train run's `eval.fingerprint` and `data.fingerprint`
tags are copied, so that seeds of runs on other data or another evaluation set are not pooled (pipelines/ablations.py).
Each seed's results as lm-eval gives them (every metric, its standard error) are in `output/seed-<s>/results.json`
and the run's artifacts. The stage's rows are the seeds' models, one each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from core.console import Bar
from core.dag import StageContext, StageResult
from corpus import evalset
from corpus.config import DownstreamConfig
from corpus.parts import aside_parts, iter_rows
from corpus import lm_eval_names as names
from train.downstream import heldout
from train.stage import export_dir

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds train/: the harness runs this very code
BUILDERS = {heldout.NAME: heldout.write}  # our tasks' data, made from the evaluation set's documents
METRICS = ("acc", "em", "exact_match")  # a task's accuracy: the first of these it reports
COPIED_TAGS = ("eval.fingerprint", "data.fingerprint")  # from the train run: what pools seeds (pipelines/ablations.py)


def identity(config) -> dict:
    """What the stage reads besides its inputs and config: lm-eval's version (its tasks and scoring) and our task files."""
    return {"lm_eval": names.lm_eval_version(),
            **{name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in sorted(names.ours().items())}}


@dataclasses.dataclass(frozen=True)
class Request:
    """The seeds' evaluations, as the harness reads them (train/downstream/harness.py)."""

    models: tuple[tuple[int, str], ...]  # (seed, its export), in order
    tasks: tuple[str, ...]
    include_path: str  # our tasks' YAML files and data (the harness runs on copies of them: copy_tasks)
    include_defaults: bool  # lm-eval's own tasks too (indexing them costs seconds)
    offline: bool  # every task ours: Hugging Face's hub and datasets offline
    limit: int | None
    num_fewshot: int
    batch_size: int
    dtype: str
    device: str
    parallelize: bool
    threads: int
    seed: int
    out: str  # each seed's results go to <out>/seed-<s>/results.json


def results_file(out: str | Path, seed: int) -> Path:
    return Path(out) / f"seed-{seed}" / "results.json"


# torch.distributed's variables: the harness is one process, and with these inherited (a Ray worker started from a
# process that was a rank: under torchrun, SLURM, or a test's gloo group) accelerate would wait for a process group.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def evaluate(request: Request) -> tuple[int, str]:
    """Runs in a Ray task: the harness in a process of its own; (its exit code, everything it printed). It runs in a
    private folder, with `-P` and its request on stdin: nothing of the workdir is imported or read as its request
    (the module's docstring says why). request.json in the output is a record of the request, not read."""
    (Path(request.out) / "request.json").write_text(json.dumps(dataclasses.asdict(request), indent=2))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]  # "", ".": cwd
    env = {**{k: v for k, v in os.environ.items() if k not in RANK_VARIABLES},
           "PYTHONPATH": os.pathsep.join([str(ROOT), *inherited]), "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="downstream-") as private:  # mkdtemp's: mode 0700, in the node's temp folder
        tasks = Path(private) / "tasks"
        copy_tasks(request, tasks)
        if request.offline:  # nothing to fetch, and nothing of datasets' cache left behind
            env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(Path(private) / "datasets"))
        sent = json.dumps(dataclasses.asdict(dataclasses.replace(request, include_path=str(tasks))))
        done = subprocess.run([sys.executable, "-P", "-m", "train.downstream.harness"], input=sent, env=env, cwd=tasks,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout


def copy_tasks(request: Request, folder: Path) -> None:
    """Our tasks among request.tasks, copied from the workdir's tasks/ into `folder`, where the harness runs (their
    data_files are relative to it): each one's YAML, refused unless it is the one we ship (a `!function` in a task
    file runs the Python it names; none of ours has one), and the data files it names. lm-eval's own tasks are read
    from its installed package."""
    folder.mkdir()
    ours = names.ours()
    for shipped in sorted({ours[name] for name in request.tasks if name in ours}):
        copy_file(Path(request.include_path) / shipped.name, folder / shipped.name)
        if (folder / shipped.name).read_bytes() != shipped.read_bytes():
            raise ValueError(f"{Path(request.include_path) / shipped.name} is not our task file {shipped}: refused, "
                             "for a changed task file could run code (lm-eval runs what a `!function` in it names)")
        for data in yaml.safe_load(shipped.read_text())["dataset_kwargs"]["data_files"].values():
            copy_file(Path(request.include_path) / data, folder / data)


def copy_file(source: Path, to: Path) -> None:
    """A copy of the file at `source` itself: a link there is refused (OSError), not followed out of the workdir."""
    with open(os.open(source, os.O_RDONLY | os.O_NOFOLLOW), "rb") as read, open(to, "wb") as write:
        shutil.copyfileobj(read, write)


def run(ctx: StageContext) -> StageResult:
    cfg: DownstreamConfig = ctx.config.eval.downstream
    train = ctx.inputs["train"]
    seeds = list(train.get("seeds") or [ctx.config.train.seed])
    exports = {seed: export_dir(Path(train["output"]), seed, seeds[0]) for seed in seeds}
    missing = [str(p) for p in exports.values() if not (p / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"the train stage's output has no Hugging Face export at {', '.join(missing)}")
    tags = {key: train.get("tags", {})[key] for key in COPIED_TAGS if key in train.get("tags", {})}
    if "eval.fingerprint" not in tags and train.get("eval_fingerprint"):
        tags["eval.fingerprint"] = train["eval_fingerprint"]
    if not cfg.tasks:
        ctx.log.info("eval.downstream.tasks is empty: nothing to evaluate")
        return StageResult(len(seeds), len(seeds), tags=tags)
    include = ctx.output / "tasks"
    made = make_our_tasks(ctx, cfg, include)
    results = run_seeds(ctx, cfg, request(cfg, exports, include, made, ctx.output))
    metrics, reported = read_results(ctx, results)
    tags.update({"downstream.seeds": ",".join(map(str, seeds)), "downstream.tasks": ",".join(reported),
                 "downstream.lm_eval": names.lm_eval_version() or "",
                 **{f"downstream.{task}.metric": metric for task, metric in reported.items()}})
    track_results(ctx, [results_file(ctx.output, seed) for seed in seeds])
    return StageResult(len(seeds), len(seeds), {}, metrics, tags=tags)


def make_our_tasks(ctx: StageContext, cfg: DownstreamConfig, folder: Path) -> list[str]:
    """Our tasks among cfg.tasks, made into `folder`: each one's data from the evaluation set beside a copy of its
    YAML, which names the data relative to the folder (the harness runs in a copy of it: copy_tasks), so the output
    stays a task lm-eval runs wherever the workdir is moved. Returns their names."""
    folder.mkdir(parents=True, exist_ok=True)
    ours = names.ours()
    made = [name for name in cfg.tasks if name in ours]
    for name in made:
        data = folder / f"{name}.jsonl"
        count = BUILDERS[name](evaluation_documents(ctx), cfg.seed, data)
        if yaml.safe_load(ours[name].read_text())["dataset_kwargs"]["data_files"] != {"test": data.name}:
            raise ValueError(f"{ours[name]}: its data_files must be {{test: {data.name}}}, the file this stage writes")
        shutil.copyfile(ours[name], folder / ours[name].name)
        ctx.log.info("%s: %d examples from the evaluation set in %s", name, count, data)
    return made


def evaluation_documents(ctx: StageContext):
    """(source, id, text) of every document of the held-out evaluation set (normalize's `eval/`)."""
    for part in aside_parts(ctx.inputs, "normalize", evalset.REASON):
        for row in iter_rows(part, columns=["source", "id", "text"]):
            yield row["source"], row["id"], row["text"]


def request(cfg: DownstreamConfig, exports: dict[int, Path], include: Path, ours: list[str], out: Path) -> Request:
    return Request(models=tuple((seed, str(path)) for seed, path in exports.items()), tasks=tuple(cfg.tasks),
                   include_path=str(include),
                   include_defaults=len(ours) < len(cfg.tasks), offline=len(ours) == len(cfg.tasks), limit=cfg.limit,
                   num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, dtype=cfg.dtype,
                   device="cuda" if cfg.gpus > 0 else "cpu", parallelize=cfg.gpus > 1, threads=max(1, int(cfg.cpus)),
                   seed=cfg.seed, out=str(out))


def run_seeds(ctx: StageContext, cfg: DownstreamConfig, request: Request) -> dict[int, dict]:
    """The harness in a Ray task; {seed: lm-eval's results}. Its output goes into the stage's log; its failure fails
    the stage, with its last lines."""
    import ray

    ref = ray.remote(num_cpus=cfg.cpus, num_gpus=cfg.gpus)(evaluate).remote(request)
    files = {seed: results_file(request.out, seed) for seed, _ in request.models}
    with Bar("downstream", "models", len(files)) as bar:
        while not ray.wait([ref], timeout=2.0)[0]:  # a seed is done when its results are written
            bar.update_to(sum(f.is_file() for f in files.values()))
        code, output = ray.get(ref)
        bar.update_to(sum(f.is_file() for f in files.values()))
    for line in output.splitlines():
        ctx.log.info("lm-eval: %s", line)
    if code != 0:
        tail = "\n".join(output.splitlines()[-5:])
        raise RuntimeError(f"lm-eval exited {code} (its output is in the stage's log):\n{tail}")
    return {seed: json.loads(path.read_text()) for seed, path in files.items()}


def accuracy(scores: dict) -> tuple[str, float] | None:
    """(metric, value) of a task's accuracy in lm-eval's results ("acc,none": 0.25, ...), or None."""
    for metric in METRICS:
        for key, value in scores.items():
            if key.split(",")[0] == metric and isinstance(value, (int, float)):
                return metric, float(value)
    return None


def read_results(ctx: StageContext, results: dict[int, dict]) -> tuple[dict[str, float], dict[str, str]]:
    """The metrics (`seed<s>/downstream.<task>`, `downstream.<task>.examples`) and {task: the metric it reports}."""
    metrics: dict[str, float] = {}
    reported: dict[str, str] = {}
    for seed, result in results.items():
        for task, scores in sorted(result["results"].items()):
            found = accuracy(scores)
            if found is None:
                ctx.log.warning("%s reports none of %s: left out of MLflow (results.json has what it reports)",
                                task, ", ".join(METRICS))
                continue
            metric, value = found
            reported[task], metrics[f"seed{seed}/downstream.{task}"] = metric, value
            if "effective" in result.get("n-samples", {}).get(task, {}):
                metrics[f"downstream.{task}.examples"] = result["n-samples"][task]["effective"]
    return metrics, reported


def track_results(ctx: StageContext, files: list[Path]) -> None:
    """Each seed's results.json as an artifact of the stage's run, under its seed's folder."""
    from core.tracking import StageRun

    stage_run = StageRun(ctx.config.mlflow.tracking_uri, ctx.mlflow_run_id)
    for path in files:
        stage_run.client.log_artifact(ctx.mlflow_run_id, str(path), artifact_path=path.parent.name)

"""Shared fixtures: one Ray session for the whole test run (ray.init costs seconds), started as the
pipeline starts it, and the long runs that tests read (the whole pipeline on the sample corpus, the GPU check's dry
run, a two-node cluster), made in the background while the other tests run (BackgroundRuns)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]  # tests/test_any_cpu.py runs conftest's console summary in a pytest of its own
sys.path.insert(0, str(Path(__file__).parent))


PIPELINE = ("default_run", "sample_run", "comments_run")  # the pipeline's runs: once per worker that asks
CLUSTER = "cluster_run"  # tests/test_job_submit.py's two-node cluster (tests/cluster_run.py)
BACKGROUND = (*PIPELINE, "gpu_check_run", CLUSTER)  # every run BackgroundRuns makes, in the order it makes them


def modules_reading(root: Path, fixtures: tuple[str, ...] = BACKGROUND) -> set[str]:
    """The test modules (as node ids start: tests/test_x.py) whose source names one of `fixtures`: theirs or a
    fixture of theirs that asks for it (test_train.py's `baseline`)."""
    return {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py") if any(f in p.read_text() for f in fixtures)}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Where `make test WORKERS=2`'s pytest-xdist workers run what: a module's tests all on one worker, in file
    order (its module fixtures made once; a test may read what an earlier one left), and every module that reads a
    background run (BACKGROUND) on the same one, first, so that each runs once. The other worker takes the other
    modules meanwhile, on the core that the runs' single-threaded parts leave idle. (xdist's own `loadgroup` marks
    no longer reach its scheduler under pytest 9: it renames node ids, which pytest 9 derives.)"""
    from xdist.scheduler import LoadScopeScheduling

    background = modules_reading(config.rootpath)

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "background" if module in background else module

    return ByModule(config, log)


@pytest.fixture(scope="session")
def ray_session():
    import ray
    import ray.cloudpickle

    import minipipeline

    from core.ray_session import init_ray

    # Test-only stage code lives in tests/, which Ray workers cannot import: ship it by value.
    ray.cloudpickle.register_pickle_by_value(minipipeline)
    init_ray(num_cpus=2)  # as pipelines/full.py starts it
    yield ray
    ray.shutdown()


# The start of the reason of every skip for a feature this CPU lacks, counted at the end of the run (below).
CPU_FEATURE = "CPU feature"


def pytest_terminal_summary(terminalreporter):
    """A skip for a feature this CPU lacks is never silent: counted and named at the end, with the CPU."""
    from core.cpu import this_cpu

    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if CPU_FEATURE in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} skipped for a feature this CPU lacks ({this_cpu().describe()}): "
                                    + ", ".join(r.nodeid for r in skipped), yellow=True, bold=True)


@pytest.fixture(scope="module")
def deepspeed_rank():
    """This process as rank 0 of 1 of a gloo process group, as a CPU Ray Train worker is: DeepSpeed
    engines in the test process itself (checkpoints, the loss scaler, ZeRO-3's partitioned build), fp16 ones
    included on any CPU (train/cpu_fp16.py; tests/test_parallel.py's spawned ranks do the same).
    The group is made once and kept: DeepSpeed holds on to the first group it saw, process-wide."""
    import socket

    import deepspeed
    import torch.distributed as dist

    from train.cpu_fp16 import allow_deepspeed_fp16

    allow_deepspeed_fp16()

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}.items():
            mp.setenv(key, value)
        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.setenv("MASTER_ADDR", "127.0.0.1")
            mp.setenv("MASTER_PORT", str(port))
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no g++ build of a shared-memory op
            deepspeed.init_distributed(dist_backend="gloo")
        yield


@pytest.fixture(scope="session")
def torch_fp16():
    """Skips a test of DeepSpeed's fp16 where torch's own fp16 kernels fail on this CPU, naming it."""
    from train.cpu_fp16 import torch_fp16_error

    if error := torch_fp16_error():
        pytest.skip(f"{CPU_FEATURE}: {error}")


@pytest.fixture(scope="session")
def sample(tmp_path_factory):
    """(folder, what it planted): the clean sample corpus, written once; tests only read it."""
    from corpus.sample import write_sample

    out = tmp_path_factory.mktemp("clean") / "sample"
    return out, write_sample(out)


def write_config(folder: Path, text: str, name: str = "test") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def _no_outside_tracking_server(monkeypatch):
    """Tests track into their own sqlite store, never a server named by the environment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# The tests' own tokenize and train (smaller than local.yaml's: 30 steps of 16 sequences of 64 tokens), written
# after local.yaml's corpus stages and screen to make sample.yaml (sample_config).
SAMPLE_TOKENIZE_TRAIN = """
tokenize: {seq_len: 64, tokenizer: {kind: train, vocab_size: 1024}}
train: {model: tiny, num_workers: 2, cpus_per_worker: 0.5, zero_stage: 2, precision: fp32, micro_batch_size: 4,
        global_batch_tokens: 1024, lr: 3.0e-3, warmup_tokens: 5120, total_tokens: 100000, max_steps: 30,
        checkpoint_every: 10, eval_every: 10, seeds: 3}
"""


SPIKY = "HackerNews"  # the subset the default sample plants spiky (configs/local.yaml)
STAGES = ("ingest", "normalize", "dedup", "screen", "tokenize", "train", "downstream")


def manifest(workdir: Path, stage: str) -> dict:
    return json.loads((workdir / stage / "manifest.json").read_text())


def rows(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def stage_folder(workdir: Path, stage: str) -> Path:
    return Path(manifest(workdir, stage)["output"]).parent


@dataclass
class DefaultRun:
    where: Path  # the fresh directory it ran in
    first: subprocess.CompletedProcess
    second: subprocess.CompletedProcess  # the same command again: every stage a cache hit
    manifests: dict[str, dict]  # each stage's manifest right after the first run
    summary: str  # work/stages.md right after the second run


def made_once_per_suite(tmp_path_factory, what: str) -> None:
    """Under pytest-xdist's workers, fails when a second worker starts making `what`: a module that reads it is
    outside the scheduler's pipeline group (pytest_xdist_make_scheduler), and the suite would pay for it twice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    mark = tmp_path_factory.getbasetemp().parent / f"{what}.worker"  # the run's, above each worker's own
    try:
        with mark.open("x") as out:  # created here, or it exists: another worker made it first
            out.write(worker)
    except FileExistsError:
        pytest.fail(f"{what} made again, on {worker} (first on {mark.read_text()}): the scheduler in "
                    f"tests/conftest.py should put every module that reads it on one worker")


def pytest_collection_modifyitems(config, items):
    """In one process (`make test`), the modules that read the background runs go last, each whole and in file
    order, and the cluster's after the pipeline's: the pipeline's runs are made in the background from the first
    test on (background_runs), while the other modules run, and the cluster's once the tests read them, beside the
    modules that read them. (pytest-xdist's workers keep the collected order: its scheduler gives these modules to
    one worker, first.)"""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    background, cluster = modules_reading(config.rootpath), modules_reading(config.rootpath, (CLUSTER,))
    module = lambda item: item.nodeid.split("::", 1)[0]  # noqa: E731
    items.sort(key=lambda item: (module(item) in background, module(item) in cluster))  # stable: file order within


class RunFailed(Exception):
    """A background run's step that exited non-zero, with what it printed."""


class BackgroundRuns:
    """The runs that the tests read (BACKGROUND), each when a collected test reads it, made one after the other in a
    thread, each step a subprocess, as a user runs them:
    - the pipeline's, each with its own Ray: the README run (`python pipelines/full.py` from a fresh directory, then
      again), the tests' sample run (`--config sample.yaml` in its workdir) and the Reddit-comments screen
      (`--config comments.yaml`). In one process the thread starts with the session's first test: the README run
      keeps about 1.6 of the 2 cores busy and the other tests about 1.2, so the runs take what the tests before the
      modules that read them leave idle. The tests read a pipeline run only once all have ended: nothing else
      writes in the README run's workdir meanwhile;
    - `benchmarks/gpu_check.py --dry-run`, as the docs give it, right after them;
    - the two-node cluster's (tests/cluster_run.py), once a test first reads a run: it waits on processes most of
      its minute, and the modules that read the runs, last in the session, leave a core idle for a third of theirs.
    Each run's own folder: none writes where another does."""

    def __init__(self, tmp_path_factory, wanted: set[str]):
        self.tmp_path_factory = tmp_path_factory
        self.wanted = wanted  # the BACKGROUND fixtures a collected test reads
        self.env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()  # a step starts, or the session stops them: never both at once
        self.current: subprocess.Popen | None = None
        self.stopped = False
        self.ended = {name: threading.Event() for name in BACKGROUND}  # made, failed, or not wanted
        self.reading = threading.Event()  # a test has asked for a run: the cluster's may start
        self.made: dict[str, object] = {}  # BACKGROUND fixture -> what its run left (a DefaultRun, a folder, ...)
        self.failed: dict[str, str] = {}  # BACKGROUND fixture -> why its run did not pass

    def start(self) -> None:
        """In the test process's thread (the folders), before any test changes the environment (copied above). The
        runs take the cores at the tests' priority: the tests beside them run longer (test_dag's first run 5.5 s
        alone, 17.2 beside them), and the suite keeps about half of what the overlap saves. Running them at nice 10
        (their session's, which Linux weighs against the tests' session as a whole) saved no more
        (docs/benchmarks.md)."""
        if self.thread is None:
            self.folders = {name: self.tmp_path_factory.mktemp(name.removesuffix("_run")) for name in BACKGROUND}
            self.where = self.folders["default_run"]
            self.thread = threading.Thread(target=self._make, name="background-runs", daemon=True)
            self.thread.start()

    def result(self, name: str):
        """What the run behind fixture `name` left, once it has ended (a pipeline run: once all of them have);
        its failure fails the test."""
        self.start()
        self.reading.set()
        for run in PIPELINE if name in PIPELINE else (name,):
            self.ended[run].wait()
        if name not in self.made:
            pytest.fail(self.failed.get(name, f"{name} was not made"), pytrace=False)
        return self.made[name]

    def stop(self) -> None:
        """The session ended with a run still going (a failure and -x, Ctrl-C): it and its Ray end too."""
        with self.lock:
            self.stopped = True
            if self.current is not None and self.current.poll() is None:
                os.killpg(self.current.pid, signal.SIGKILL)
        self.reading.set()  # a cluster run still waiting to start sees `stopped` and does not
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _run(self, cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """One step, in a session of its own (so that stop() ends it and what it started); exits non-zero:
        RunFailed with what it printed."""
        with self.lock:
            if self.stopped:
                raise RunFailed("the session ended before this run started")
            self.current = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True, start_new_session=True)
        with self.current as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
        if proc.returncode != 0:
            raise RunFailed(f"`{' '.join(cmd[1:])}` in {cwd} exited {proc.returncode}"
                            f"{' (stopped)' if self.stopped else ''}:\n{out[-3000:]}{err[-3000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _call(self, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        return self._run([sys.executable, str(ROOT / "pipelines" / "full.py"), *args], cwd, self.env, timeout)

    def _default_run(self) -> DefaultRun:
        first = self._call([], self.where, timeout=900)
        manifests = {s: manifest(self.where / "work", s) for s in STAGES}
        second = self._call([], self.where, timeout=600)
        return DefaultRun(self.where, first, second, manifests, (self.where / "work" / "stages.md").read_text())

    def _sample_run(self) -> Path:
        self._call(["--config", str(sample_config(self.where))], self.where, timeout=900)
        return self.where / "work"

    def _comments_run(self) -> Path:
        folder = self.folders["comments_run"]
        self._call(["--config", str(comments_config(self.where, folder)), "--only", "ingest,normalize,dedup,screen"],
                   folder, timeout=900)
        return folder / "work"

    def _gpu_check_run(self) -> Path:
        out = self.folders["gpu_check_run"] / "check"
        self._run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)], ROOT,
                  self.env, timeout=900)
        return out

    def _cluster_run(self):
        import cluster_run

        return cluster_run.make(self.folders[CLUSTER], self._run)

    def _make(self) -> None:
        """Each wanted run, in BACKGROUND's order: the README run whenever a pipeline run is wanted (the others
        read its sample), and the cluster's once a test has read a run (beside the modules that read them)."""
        for name in BACKGROUND:
            try:
                if name == CLUSTER and name in self.wanted:
                    self.reading.wait()
                if name in self.wanted or (name == "default_run" and self.wanted & set(PIPELINE)):
                    self._make_one(name)
            finally:
                self.ended[name].set()

    def _make_one(self, name: str) -> None:
        if self.stopped:
            self.failed[name] = "the session ended before this run started"
        elif name in PIPELINE and "default_run" in self.failed:
            self.failed[name] = f"the README run failed first: {self.failed['default_run']}"
        else:
            try:
                self.made[name] = getattr(self, f"_{name}")()
            except Exception as exc:  # said by the fixture that reads it, not lost in the thread
                self.failed[name] = str(exc) if isinstance(exc, RunFailed) else traceback.format_exc()


def sample_config(where: Path) -> Path:
    """sample.yaml beside the README run: local.yaml's corpus stages and screen, whose outputs are the README
    run's (cache hits), and the tests' smaller tokenize and train (SAMPLE_TOKENIZE_TRAIN)."""
    local = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    for source in local["sources"]:
        source["paths"] = [str(where / p) for p in source["paths"]]
    corpus = {k: local[k] for k in ("sources", "normalize", "eval", "dedup", "screen")}
    return write_config(where, yaml.safe_dump({"workdir": str(where / "work"), **corpus}) + SAMPLE_TOKENIZE_TRAIN,
                        name="sample")


def comments_config(where: Path, folder: Path) -> Path:
    """comments.yaml in `folder`: local.yaml on the README run's sample with Reddit's RC_* comment dumps only (no
    RS_* submissions), screened on three subsets with 3 seeds in the first round (tests/test_screen.py says why)."""
    local = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    local.pop("sample_corpus")
    local.pop("sample_spiky_subset")
    for source in local["sources"]:
        source["paths"] = [str(where / p) for p in source["paths"] if "/RS_" not in p]
    local["workdir"] = str(folder / "work")
    local["screen"].update(subsets=["DM Mathematics", SPIKY, "USPTO Backgrounds"], seeds=3)
    return write_config(folder, yaml.safe_dump(local), name="comments")


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory) -> BackgroundRuns:
    """Started here, with the session's first test, when a collected test reads a background run and the suite
    runs in one process; under pytest-xdist, by the first test that reads one, on the worker that runs them all."""
    wanted = {name for item in request.session.items for name in BACKGROUND if name in item.fixturenames}
    runs = BackgroundRuns(tmp_path_factory, wanted)
    if wanted and not os.environ.get("PYTEST_XDIST_WORKER"):
        runs.start()
    yield runs
    runs.stop()


@pytest.fixture(scope="session")
def default_run(background_runs, tmp_path_factory) -> DefaultRun:
    """The README's first command, `python pipelines/full.py` with no arguments, run from a fresh directory,
    then again. sample_run adds its own run to the same workdir, so what the tests of this run read of the
    workdir's state as this run left it is read right after it (manifests, summary)."""
    made_once_per_suite(tmp_path_factory, "default_run")
    return background_runs.result("default_run")


@pytest.fixture(scope="session")
def sample_run(default_run, background_runs, ray_session):
    """(sample folder, what the sample planted, workdir): the README command's run (its sample has HackerNews
    planted spiky, which the screen drops), then `full.py --config sample.yaml` in the same workdir (made by
    background_runs). The screen, the costliest stage, runs once for both. The tests that read it go on in this
    process's Ray (ray_session): a proxy run again, the ablation's rerun."""
    work = background_runs.result("sample_run")
    rerun = [s for s in STAGES[:4] if manifest(work, s)["fingerprint"] != default_run.manifests[s]["fingerprint"]]
    assert not rerun, f"sample.yaml's corpus stages and screen should be the README run's, but these ran again: {rerun}"
    sample = default_run.where / "data" / "sample"
    return sample, json.loads((sample / "PLANTED.json").read_text()), work


@pytest.fixture(scope="session")
def comments_run(background_runs) -> Path:
    """The workdir of `full.py --config comments.yaml --only ingest,normalize,dedup,screen` (comments_config), made
    by background_runs after the README run, whose sample it reads."""
    return background_runs.result("comments_run")


@pytest.fixture(scope="session")
def cluster_run(background_runs, tmp_path_factory):
    """What the two-node cluster's run left (tests/cluster_run.py's ClusterRun), made by background_runs once the
    tests first read a run."""
    made_once_per_suite(tmp_path_factory, CLUSTER)
    return background_runs.result(CLUSTER)


@pytest.fixture(scope="session")
def gpu_check_run(background_runs, tmp_path_factory) -> Path:
    """The folder of `benchmarks/gpu_check.py --dry-run --out <folder>`, run by background_runs."""
    made_once_per_suite(tmp_path_factory, "gpu_check_run")
    return background_runs.result("gpu_check_run")

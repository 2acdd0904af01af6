"""The two-node cluster run that tests/test_job_submit.py reads, made in the background by tests/conftest.py's
BackgroundRuns as the pipeline's runs are: it waits on processes most of its minute (`ray start`, job submits, the
MLflow server), so it runs beside the tests that leave a core idle, and the test checks what it left.

A head (1 CPU, resource `head_node`) and a second node (1 CPU, resource `worker_node`) started with `ray start`,
token authentication on (a token made for the run), the dashboard bound to 127.0.0.1 only. On it: `ray job submit`
of pipelines/full.py twice (ingest to dedup, then dedup alone, forced), with the working directory uploaded as Ray
does; the workdir a folder both nodes see (as a shared mount on a real cluster), given as a file:// URI; one source
read through pyarrow's filesystem by URI (as from a bucket). As cluster.yaml does, an `mlflow server` bound to
127.0.0.1 stands for the head's tracking server and its URI is exported to `ray start --head` only: the jobs must
inherit it. Then a driver on the cluster runs the placement probe (train/parallel/placement.py), and another a
restart's health check. The cluster is stopped by pid whatever happens: every process whose command line names its
temp dir; the MLflow server by its process group.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT, RunFailed, manifest

CORPUS_STAGES = ("ingest", "normalize", "dedup")

# A restart's health check on the cluster (train/failures.py's RestartHealthCheck, as Ray Train's controller calls
# it once the failed group is down): the second node turned unhealthy without failing (marked as the chaos drill
# marks one) while the attempt failed on the head. The two nodes share this machine's two cores with the tests that
# run meanwhile, so their probes' rates are not comparable: a node is judged slow only under a twentieth of the
# other's (`min_fraction`; the verdicts on rates: tests/test_health.py). It prints one JSON line: the nodes drained,
# the worker node's id, whether a task pinned to each node then ran, and the node (head or worker) of every task the
# stages ran, from the State API of the cluster's dashboard (corpus.parts.run_tasks names each Map after its task:
# Map(read_task)).
HEALTH_CHECK = """
import dataclasses, json, sys, ray
from pathlib import Path
from ray.util.state import list_nodes, list_tasks
from train import records
from train.config import HealthConfig, InjectConfig
from train.failures import Failure, RestartHealthCheck
from train.loop.drill import NodeFaults, mark_unhealthy

dashboard, run = sys.argv[1], Path(sys.argv[2])
names = {n.node_id: ('head' if 'head_node' in n.resources_total else 'worker') for n in list_nodes(address=dashboard)}
tasks = [t for t in list_tasks(address=dashboard, detail=True, limit=10000)
         if t.node_id and t.type == 'NORMAL_TASK' and '_task)' in t.name]
ran_on = [names[t.node_id] for t in tasks]
ray.init()
run.mkdir(parents=True)
worker = next(n['NodeID'] for n in ray.nodes() if 'worker_node' in n['Resources'])
head_id = next(n['NodeID'] for n in ray.nodes() if 'head_node' in n['Resources'])
mark_unhealthy(run, worker)
crash = Failure(attempt=1, rank=0, kind='hardware', type='ActorDiedError', message='died', step=3, node=head_id)
records.append(run, records.FAILURE, dataclasses.asdict(crash))
drill = NodeFaults.for_run(run, [InjectConfig(kind='unhealthy', step=3, node=worker)])
check = RestartHealthCheck(str(run), HealthConfig(min_fraction=0.05), worker=(1, 0), drill=drill)
check.before_worker_group_start(None)
rows = [json.loads(line) for line in (run / 'health.jsonl').read_text().splitlines()]
excluded = [r['node'] for r in rows if r['drained']]
pinned = ray.remote(num_cpus=0, resources={'worker_node': 0.01})(lambda: 1).remote()
head = ray.remote(num_cpus=0, resources={'head_node': 0.01})(lambda: 1).remote()
ready, _ = ray.wait([pinned, head], num_returns=2, timeout=5)
print(json.dumps({'excluded': excluded, 'worker': worker, 'ran': [r == head for r in ready], 'ran_on': ran_on}))
"""


@dataclass
class ClusterRun:
    where: Path  # its folder: the sample, cluster.yaml, the shared workdir, the health check's run
    shared: Path  # the workdir both nodes see
    first: str  # what `ray job submit ... --only ingest,normalize,dedup` printed
    before: dict[str, dict]  # the corpus stages' manifests after it
    second: str  # what `ray job submit ... --only dedup --force` printed
    after: dict[str, dict]  # the manifests after that
    experiment_id: str | None  # the `cluster` experiment's id on the head's tracking server
    tracked: dict[str, dict]  # every manifest's MLflow run as that server has it: experiment_id, status, metrics
    placed: str  # what the placement probe printed
    checked: dict  # the health check's line (HEALTH_CHECK)
    health_run: Path  # the health check's run folder
    leftover: list[int]  # the cluster's processes still there after it was stopped


Call = Callable[..., subprocess.CompletedProcess]  # BackgroundRuns._run: (cmd, cwd, env, timeout), raises RunFailed


def free_ports(count: int) -> list[int]:
    """Ports free now, below the kernel's range for outgoing connections and above Ray's worker ports (10002-19999
    by default): a port the kernel hands out (bind to 0) can be taken by any connection before `ray start` binds it,
    which made the GCS fail to start once in a full suite ("Address already in use")."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports: list[int] = []
    for port in random.sample(range(20000, first_ephemeral), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"fewer than {count} free ports between 20000 and {first_ephemeral}")


def up(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def cluster_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def stop(marker: str) -> None:
    """SIGKILL, and up to 15 s for the processes to go: nothing is read from the cluster after (a SIGTERM first
    waited out its grace, some of Ray's processes never take it)."""
    for pid in cluster_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 15
    while cluster_pids(marker) and time.time() < deadline:
        time.sleep(0.2)


def make(where: Path, call: Call) -> ClusterRun:
    """Starts the cluster, runs on it what ClusterRun holds, and stops it; a step that exits non-zero raises
    RunFailed with what it printed (and the job server's log, for a submit)."""
    from corpus.sample import write_sample

    bin_dir = str(Path(sys.executable).parent)
    # Every process of the cluster names its temp dir: how it is stopped. Short: Unix socket paths end under it.
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    token = where / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token)}
    for key in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    gcs, dashboard, head_agent, node_agent, tracking = free_ports(5)
    write_sample(where / "sample")
    shared = where / "shared"
    cfg = where / "cluster.yaml"
    cfg.write_text(f"""workdir: {shared.as_uri()}
sources:
  - {{name: pile,   format: pile,  paths: ["{(where / 'sample').as_uri()}/pile/*.jsonl.zst"]}}
  - {{name: ccnews, format: jsonl, paths: ["{where}/sample/ccnews/*.jsonl"], text_field: text, id_field: id}}
""")
    on_cluster = {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}  # a driver on the cluster, as `ray job submit` starts

    def ray(*args: str, extra_env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return call([f"{bin_dir}/ray", *args], ROOT, {**env, **(extra_env or {})}, timeout)

    def submit(*args: str) -> str:
        deadline = time.time() + 120
        while True:
            try:
                return ray("job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", str(ROOT), "--",
                           "python", "pipelines/full.py", "--config", str(cfg), *args, timeout=900).stdout
            except RunFailed as failed:
                # The head's dashboard agent registers a few seconds after `ray start` returns; until then the job
                # server refuses (nothing is submitted), so asking again is safe.
                if "No available agent to submit job" not in str(failed) or time.time() > deadline:
                    raise RunFailed(f"{failed}{head_log('dashboard_JobHead.log')}") from None
            time.sleep(2)

    def head_log(name: str) -> str:
        path = temp / "session_latest" / "logs" / name
        return f"\n--- {name}:\n" + path.read_text(errors="replace")[-3000:] if path.is_file() else ""

    server_log = where / "mlflow-server.log"
    with open(server_log, "wb") as log:  # a file, not a pipe nobody reads (a full pipe would stall the server)
        server = subprocess.Popen([f"{bin_dir}/mlflow", "server", "--backend-store-uri", f"sqlite:///{where}/server.db",
                                   "--artifacts-destination", str(where / "server-artifacts"), "--host", "127.0.0.1",
                                   "--port", str(tracking), "--workers", "1"],
                                  env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    tracking_uri = f"http://127.0.0.1:{tracking}"
    try:
        ray("start", "--head", f"--port={gcs}", "--num-cpus=1", '--resources={"head_node": 1}', f"--temp-dir={temp}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={head_agent}", "--disable-usage-stats",
            extra_env={"MLFLOW_TRACKING_URI": tracking_uri})
        # Two nodes on one machine: each node's dashboard agent needs a port of its own (Ray's default is one
        # fixed port; the node whose agent binds it second loses its agent, and the head's is the job server's).
        ray("start", f"--address=127.0.0.1:{gcs}", "--num-cpus=1", '--resources={"worker_node": 1}',
            f"--dashboard-agent-listen-port={node_agent}", "--disable-usage-stats")
        deadline = time.time() + 120  # the MLflow server has been starting meanwhile
        while not up(f"{tracking_uri}/health"):
            if server.poll() is not None or time.time() > deadline:
                raise RunFailed("the MLflow server did not come up:\n" + server_log.read_text(errors="replace")[-3000:])
            time.sleep(0.5)

        first = submit("--only", ",".join(CORPUS_STAGES))
        before = {stage: manifest(shared, stage) for stage in CORPUS_STAGES}
        second = submit("--only", "dedup", "--force")
        after = {stage: manifest(shared, stage) for stage in CORPUS_STAGES}
        experiment_id, tracked = tracked_runs(tracking_uri, [*before.values(), *after.values()])
        # Where Ray Train puts a tensor group of 2 with one CPU a worker: tests/test_job_submit.py says what it finds.
        placed = call([sys.executable, "-m", "pipelines.placement", "--config", str(cfg), "--set", "train.num_workers=2",
                       "--set", "train.cpus_per_worker=1", "--set", "train.parallel.tensor=2"], ROOT, on_cluster, 600).stdout
        health_run = where / "health-run"
        checked = call([sys.executable, "-c", HEALTH_CHECK, f"http://127.0.0.1:{dashboard}", str(health_run)], ROOT,
                       on_cluster, 300).stdout
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # its store is the run's own, read above
        server.wait(timeout=30)
        stop(str(temp))
        leftover = cluster_pids(str(temp))
        shutil.rmtree(temp, ignore_errors=True)
    return ClusterRun(where, shared, first, before, second, after, experiment_id, tracked, placed,
                      json.loads(checked.splitlines()[-1]), health_run, leftover)


def tracked_runs(uri: str, manifests: list[dict]) -> tuple[str | None, dict[str, dict]]:
    """The `cluster` experiment's id and each manifest's MLflow run, as the tracking server at `uri` has them."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("cluster")
    runs = {}
    for m in manifests:
        run = client.get_run(m["mlflow_run_id"])
        runs[run.info.run_id] = {"experiment_id": run.info.experiment_id, "status": run.info.status,
                                 "metrics": dict(run.data.metrics)}
    return experiment.experiment_id if experiment else None, runs

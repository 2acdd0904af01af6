"""The cluster path: `ray job submit` of pipelines/full.py to a real two-node Ray cluster on this machine,
and of the placement probe (train/parallel/placement.py) for a tensor-parallel layout over both nodes.

A head (1 CPU, resource `head_node`) and a second node (1 CPU, resource `worker_node`) started
with `ray start`, token authentication on (a token made for the test), the dashboard bound to
127.0.0.1 only. The job's working directory is uploaded as Ray does; the workdir is a folder both
nodes see (as a shared mount on a real cluster), given as a file:// URI, and one source is read
through pyarrow's filesystem by URI (as from a bucket). As cluster.yaml does, an `mlflow server`
bound to 127.0.0.1 stands for the head's tracking server and its URI is exported to `ray start
--head` only: the jobs must inherit it. The cluster is stopped by pid whatever happens: every
process whose command line names its temp dir; the MLflow server by its process group.
"""

from __future__ import annotations

import collections
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
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import ROOT, manifest

pytestmark = pytest.mark.slow


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


def test_ray_job_submit_runs_the_pipeline_on_both_nodes_and_reruns_one_stage(tmp_path):
    from corpus.sample import write_sample

    bin_dir = str(Path(sys.executable).parent)
    # Every process of the cluster names its temp dir: how it is stopped. Short: Unix socket paths end under it.
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard, head_agent, node_agent, tracking = free_ports(5)
    write_sample(tmp_path / "sample")
    shared = tmp_path / "shared"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""workdir: {shared.as_uri()}
sources:
  - {{name: pile,   format: pile,  paths: ["{(tmp_path / 'sample').as_uri()}/pile/*.jsonl.zst"]}}
  - {{name: ccnews, format: jsonl, paths: ["{tmp_path}/sample/ccnews/*.jsonl"], text_field: text, id_field: id}}
""")

    def ray(*args: str, timeout: float = 300, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([f"{bin_dir}/ray", *args], env={**env, **(extra_env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def submit(*args: str) -> str:
        deadline = time.time() + 120
        while True:
            proc = ray("job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", str(ROOT), "--",
                       "python", "pipelines/full.py", "--config", str(cfg), *args, timeout=900)
            # The head's dashboard agent registers a few seconds after `ray start` returns; until then the job
            # server refuses (nothing is submitted), so asking again is safe.
            if "No available agent to submit job" not in proc.stderr or time.time() > deadline:
                break
            time.sleep(2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + head_log("dashboard_JobHead.log")
        return proc.stdout

    def head_log(name: str) -> str:
        path = temp / "session_latest" / "logs" / name
        return f"\n--- {name}:\n" + path.read_text(errors="replace")[-3000:] if path.is_file() else ""

    server_log = tmp_path / "mlflow-server.log"
    with open(server_log, "wb") as log:  # a file, not a pipe nobody reads (a full pipe would stall the server)
        server = subprocess.Popen([f"{bin_dir}/mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
                                   "--artifacts-destination", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1",
                                   "--port", str(tracking), "--workers", "1"],
                                  env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    tracking_uri = f"http://127.0.0.1:{tracking}"
    try:
        head = ray("start", "--head", f"--port={gcs}", "--num-cpus=1", '--resources={"head_node": 1}',
                   f"--temp-dir={temp}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                   f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={head_agent}", "--disable-usage-stats",
                   extra_env={"MLFLOW_TRACKING_URI": tracking_uri})
        assert head.returncode == 0, head.stderr[-3000:]
        # Two nodes on one machine: each node's dashboard agent needs a port of its own (Ray's default is one
        # fixed port; the node whose agent binds it second loses its agent, and the head's is the job server's).
        node = ray("start", f"--address=127.0.0.1:{gcs}", "--num-cpus=1", '--resources={"worker_node": 1}',
                   f"--dashboard-agent-listen-port={node_agent}", "--disable-usage-stats")
        assert node.returncode == 0, node.stderr[-3000:]
        deadline = time.time() + 120  # the MLflow server has been starting meanwhile
        while not up(f"{tracking_uri}/health"):
            assert server.poll() is None and time.time() < deadline, server_log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)

        out = submit("--only", "ingest,normalize,dedup")
        before = {stage: manifest(shared, stage) for stage in ("ingest", "normalize", "dedup")}
        # The driver joined the cluster (Ray's own lines are in the first stage's log, not on the job's console).
        joined = (Path(before["ingest"]["output"]).parent / "stage.log").read_text()
        assert "Connecting to existing Ray cluster" in joined or "Connected to Ray cluster" in joined
        assert "[ingest] done in" in out and "Connecting to existing Ray cluster" not in out
        for m in before.values():
            assert Path(m["output"]).is_relative_to(shared) and any(Path(m["output"]).glob("*.parquet"))
        # Tracked on the head's server (the URI the head was started with), not in a store of the job's own.
        assert not (shared / "mlflow.db").exists()
        client = MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name("cluster")
        for m in before.values():
            run = client.get_run(m["mlflow_run_id"])
            assert run.info.experiment_id == experiment.experiment_id and run.info.status == "FINISHED"
            assert run.data.metrics["rows_out"] > 0
        ingest = before["ingest"]["counts"]
        assert ingest["rejected"] > 0 and ingest["subset_not_kept"] > 0 and ingest["rows_out"] > 300
        ids = pq.read_table(before["ingest"]["output"], columns=["id"])
        assert any(i.startswith("pile/00.jsonl.zst:") for i in ids.column("id").to_pylist())  # ids as from a path

        out = submit("--only", "dedup", "--force")
        assert "[dedup] running" in out and "[ingest]" not in out and "[normalize]" not in out
        after = {stage: manifest(shared, stage) for stage in before}
        assert after["ingest"] == before["ingest"] and after["normalize"] == before["normalize"]
        assert after["dedup"]["mlflow_run_id"] != before["dedup"]["mlflow_run_id"]
        assert after["dedup"]["counts"] == before["dedup"]["counts"]
        assert client.get_run(after["dedup"]["mlflow_run_id"]).info.status == "FINISHED"

        # Where Ray Train puts a layout's workers (train/parallel/placement.py). One CPU per node: the two workers of a
        # tensor group of 2 land on the two Ray nodes as world ranks 0 and 1, node by node; Ray Train counts
        # local ranks per IP address, and both nodes are this machine, so they are local ranks 0 and 1 of 2,
        # one machine's group (which it is: no network between them), and the probe finds no split.
        placed = subprocess.run([sys.executable, "-m", "pipelines.placement", "--config", str(cfg), "--set",
                                 "train.num_workers=2", "--set", "train.cpus_per_worker=1", "--set", "train.parallel.tensor=2"],
                                cwd=ROOT, env={**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}, capture_output=True, text=True,
                                timeout=600)  # a driver on the cluster, as `ray job submit` would start
        assert placed.returncode == 0, placed.stdout[-3000:] + placed.stderr[-3000:]
        rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:8]]
                for line in placed.stdout.splitlines() if line.startswith(("| 0 |", "| 1 |"))}
        assert sorted(rows) == ["0", "1"], placed.stdout[-3000:]
        assert rows["0"][0].startswith("0 (") and rows["1"][0].startswith("1 ("), rows  # two Ray nodes
        assert rows["0"][1] == rows["1"][1]  # one machine
        assert [rows[r][2:] for r in "01"] == [["0 of 2", "0", "0", "0"], ["1 of 2", "0", "0", "1"]], rows
        assert "spans nodes" not in placed.stdout

        # A restart probes every node that can host a worker (train/failures.py's RestartHealthCheck, as Ray Train's
        # controller calls it once the failed group is down): the second node turned unhealthy without failing (marked
        # as the chaos drill marks one) while the attempt failed on the head, and is drained (train/health.py):
        # nothing new is scheduled on it. The probe runs on both nodes, pinned (matmul, memory, a gloo all-reduce
        # between two processes on the node and one between the nodes).
        runs = tmp_path / "health-run"
        checked = subprocess.run([sys.executable, "-c", (
            "import dataclasses, json, sys, ray\n"
            # Which node ran the stages' tasks (corpus.parts.run_tasks names each Map after its task: Map(read_task)):
            # the State API of the cluster's dashboard, before the drain below.
            "from ray.util.state import list_nodes, list_tasks\n"
            f"a = 'http://127.0.0.1:{dashboard}'\n"
            "names = {n.node_id: ('head' if 'head_node' in n.resources_total else 'worker') for n in list_nodes(address=a)}\n"
            "tasks = [t for t in list_tasks(address=a, detail=True, limit=10000) if t.node_id and t.type == 'NORMAL_TASK'\n"
            "         and '_task)' in t.name]\n"
            "ran_on = [names[t.node_id] for t in tasks]\n"
            "from pathlib import Path\n"
            "from train.config import HealthConfig\n"
            "from train.failures import Failure, RestartHealthCheck\n"
            "from train import records\n"
            "from train.config import InjectConfig\n"
            "from train.loop.drill import NodeFaults, mark_unhealthy\n"
            "ray.init()\n"
            f"run = Path({str(runs)!r})\n"
            "run.mkdir(parents=True)\n"
            "worker = next(n['NodeID'] for n in ray.nodes() if 'worker_node' in n['Resources'])\n"
            "head_id = next(n['NodeID'] for n in ray.nodes() if 'head_node' in n['Resources'])\n"
            "mark_unhealthy(run, worker)\n"
            "crash = Failure(attempt=1, rank=0, kind='hardware', type='ActorDiedError', message='died', step=3, node=head_id)\n"
            "records.append(run, records.FAILURE, dataclasses.asdict(crash))\n"
            "drill = NodeFaults.for_run(run, [InjectConfig(kind='unhealthy', step=3, node=worker)])\n"
            "RestartHealthCheck(str(run), HealthConfig(), worker=(1, 0), drill=drill).before_worker_group_start(None)\n"
            "rows = [json.loads(line) for line in (run / 'health.jsonl').read_text().splitlines()]\n"
            "excluded = [r['node'] for r in rows if r['drained']]\n"
            "pinned = ray.remote(num_cpus=0, resources={'worker_node': 0.01})(lambda: 1).remote()\n"
            "head = ray.remote(num_cpus=0, resources={'head_node': 0.01})(lambda: 1).remote()\n"
            "ready, _ = ray.wait([pinned, head], num_returns=2, timeout=5)\n"
            "print(json.dumps({'excluded': excluded, 'worker': worker, 'ran': [r == head for r in ready], 'ran_on': ran_on}))")],
            cwd=ROOT, env={**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}, capture_output=True, text=True, timeout=300)
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
        said = json.loads(checked.stdout.splitlines()[-1])
        by_node = collections.Counter(said["ran_on"])
        assert by_node["head"] > 0 and by_node["worker"] > 0, by_node  # the pipeline's tasks ran on both nodes
        assert said["excluded"] == [said["worker"]] and said["ran"] == [True]  # the drained node takes no task
        probes = [json.loads(line) for line in (runs / "health.jsonl").read_text().splitlines()]
        assert len(probes) == 2 and all(p["matmul_tflops"] > 0 and p["memory_ok"] and p["allreduce_gbps"] > 0
                                        and p["pair_gbps"] > 0 for p in probes)  # gloo between the two nodes too
        assert [p["failed"] for p in probes if p["node"] == said["worker"]] == ["marked unhealthy by a drill"]
        assert f"node {said['worker']}" in (runs / "incidents.jsonl").read_text()
        assert json.loads((runs / "logbook.jsonl").read_text())["kind"] == "node-excluded"
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # its store is the test's own, read above
        server.wait(timeout=30)
        stop(str(temp))
        leftover = cluster_pids(str(temp))
        shutil.rmtree(temp, ignore_errors=True)
    assert not leftover

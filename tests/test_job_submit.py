"""The cluster path: `ray job submit` of pipelines/full.py to a real two-node Ray cluster on this machine,
and of the placement probe (train/parallel/placement.py) for a tensor-parallel layout over both nodes, and a
restart's health check there. The cluster's run (tests/cluster_run.py says what it starts and runs) is made in the
background once the tests first read a run (tests/conftest.py's BackgroundRuns); this test checks what it left.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow


def test_ray_job_submit_runs_the_pipeline_on_both_nodes_and_reruns_one_stage(cluster_run):
    run = cluster_run
    before, after, tracked = run.before, run.after, run.tracked
    # The driver joined the cluster (Ray's own lines are in the first stage's log, not on the job's console).
    joined = (Path(before["ingest"]["output"]).parent / "stage.log").read_text()
    assert "Connecting to existing Ray cluster" in joined or "Connected to Ray cluster" in joined
    assert "[ingest] done in" in run.first and "Connecting to existing Ray cluster" not in run.first
    for m in before.values():
        assert Path(m["output"]).is_relative_to(run.shared) and any(Path(m["output"]).glob("*.parquet"))
    # Tracked on the head's server (the URI the head was started with), not in a store of the job's own.
    assert not (run.shared / "mlflow.db").exists()
    assert run.experiment_id is not None
    for m in before.values():
        tracked_run = tracked[m["mlflow_run_id"]]
        assert tracked_run["experiment_id"] == run.experiment_id and tracked_run["status"] == "FINISHED"
        assert tracked_run["metrics"]["rows_out"] > 0
    ingest = before["ingest"]["counts"]
    assert ingest["rejected"] > 0 and ingest["subset_not_kept"] > 0 and ingest["rows_out"] > 300
    ids = pq.read_table(before["ingest"]["output"], columns=["id"])
    assert any(i.startswith("pile/00.jsonl.zst:") for i in ids.column("id").to_pylist())  # ids as from a path

    # `--only dedup --force`: dedup alone ran again, with the same counts, as a new run on the server.
    assert "[dedup] running" in run.second and "[ingest]" not in run.second and "[normalize]" not in run.second
    assert after["ingest"] == before["ingest"] and after["normalize"] == before["normalize"]
    assert after["dedup"]["mlflow_run_id"] != before["dedup"]["mlflow_run_id"]
    assert after["dedup"]["counts"] == before["dedup"]["counts"]
    assert tracked[after["dedup"]["mlflow_run_id"]]["status"] == "FINISHED"

    # Where Ray Train puts a layout's workers (train/parallel/placement.py). One CPU per node: the two workers of a
    # tensor group of 2 land on the two Ray nodes as world ranks 0 and 1, node by node; Ray Train counts
    # local ranks per IP address, and both nodes are this machine, so they are local ranks 0 and 1 of 2,
    # one machine's group (which it is: no network between them), and the probe finds no split.
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:8]]
            for line in run.placed.splitlines() if line.startswith(("| 0 |", "| 1 |"))}
    assert sorted(rows) == ["0", "1"], run.placed[-3000:]
    assert rows["0"][0].startswith("0 (") and rows["1"][0].startswith("1 ("), rows  # two Ray nodes
    assert rows["0"][1] == rows["1"][1]  # one machine
    assert [rows[r][2:] for r in "01"] == [["0 of 2", "0", "0", "0"], ["1 of 2", "0", "0", "1"]], rows
    assert "spans nodes" not in run.placed

    # A restart probes every node that can host a worker (train/failures.py's RestartHealthCheck, as Ray Train's
    # controller calls it once the failed group is down): the second node turned unhealthy without failing (marked
    # as the chaos drill marks one) while the attempt failed on the head, and is drained (train/health.py):
    # nothing new is scheduled on it. The probe runs on both nodes, pinned (matmul, memory, a gloo all-reduce
    # between two processes on the node and one between the nodes).
    said = run.checked
    by_node = collections.Counter(said["ran_on"])
    assert by_node["head"] > 0 and by_node["worker"] > 0, by_node  # the pipeline's tasks ran on both nodes
    assert said["excluded"] == [said["worker"]] and said["ran"] == [True]  # the drained node takes no task
    probes = [json.loads(line) for line in (run.health_run / "health.jsonl").read_text().splitlines()]
    assert len(probes) == 2 and all(p["matmul_tflops"] > 0 and p["memory_ok"] and p["allreduce_gbps"] > 0
                                    and p["pair_gbps"] > 0 for p in probes)  # gloo between the two nodes too
    assert [p["failed"] for p in probes if p["node"] == said["worker"]] == ["marked unhealthy by a drill"]
    assert f"node {said['worker']}" in (run.health_run / "incidents.jsonl").read_text()
    assert json.loads((run.health_run / "logbook.jsonl").read_text())["kind"] == "node-excluded"
    assert not run.leftover  # every process of the cluster stopped

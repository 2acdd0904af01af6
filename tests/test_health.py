"""The health verdict (train/health.py) on probes written by hand: a GPU against its kind's measured rate, a CPU
and every node's all-reduce against the other nodes of its device, a memory error, a probe that could not run, a
drill's mark; the guard that refuses drains past `max_excluded_fraction`, on this session's real Ray node.
The probe itself on a real two-node cluster, and the drain: tests/test_job_submit.py."""

from __future__ import annotations

import json
import time

import pytest

from train.config import HealthConfig
from train.health import Probe, drains_allowed, ring_rounds, verdicts


def probe(node: str, device: str = "cpu", tflops: float = 0.1, gbps: float = 1.0, memory_ok: bool = True, **kw) -> Probe:
    return Probe(node=node, host="h", device=device, matmul_tflops=tflops, memory_ok=memory_ok, allreduce_gbps=gbps, **kw)


def test_each_node_is_judged_against_its_reference_and_the_reason_is_said():
    cpus = [probe("a"), probe("b", tflops=0.11), probe("c", tflops=0.04), probe("d", gbps=0.3),
            probe("e", memory_ok=False, bad_devices=[0]), probe("g", error="RayTaskError: lost")]
    found = verdicts(cpus, min_fraction=0.5)
    assert found["a"] is None and found["b"] is None
    assert found["c"].startswith("matmul 0.04 TFLOP/s on device 0, under 0.5 x 0.1")  # the median of the others' rates
    assert found["d"].startswith("all-reduce 0.3 GB/s, under 0.5 x the median 1")
    assert found["e"] == "memory test read back wrong values (device 0)"
    assert found["g"] == "the probe failed: RayTaskError: lost"
    # Between nodes: a node whose faster pair in the ring is slow has the slow link; with two nodes, no one can tell.
    ring = [probe("a", pair_gbps=10.0), probe("b", pair_gbps=11.0), probe("c", pair_gbps=2.0)]
    found = verdicts(ring, 0.5)
    assert found["a"] is None and found["b"] is None and found["c"].startswith("all-reduce with its neighbours 2 GB/s")
    assert verdicts(ring[1:], 0.5)["c"] is None
    # A GPU against the rate its kind reaches in the probe (an H100: 620 TFLOP/s measured, not the 989 peak), its
    # slowest device named; NVML's counters; a CPU (cluster.yaml's head, were it probed) never against a GPU.
    h100 = "NVIDIA H100 80GB HBM3"
    gpus = [probe("x", h100, tflops=450.0), probe("y", h100, tflops=250.0, device_tflops=[610.0, 250.0, 600.0]),
            probe("z", h100, tflops=600.0, nvml="GPU 3: row remapping failed"), probe("head", tflops=0.1)]
    found = verdicts(gpus, min_fraction=0.5)
    assert found["x"] is None  # a cold probe's rate (an H100's first 0.3 s read 408-451) is no fault
    assert found["y"] == "matmul 250 TFLOP/s on device 1, under 0.5 x 620"
    assert found["z"] == "NVML: GPU 3: row remapping failed" and found["head"] is None
    # One node probed after its failures is judged against the earlier probes of the others.
    assert verdicts([probe("c", tflops=0.04)], 0.5, reference=[probe("a"), probe("b")])["c"] is not None
    assert verdicts([probe("c", tflops=0.04)], 0.5)["c"] is None  # alone, a CPU has nothing to be slower than


def test_a_run_drains_at_most_a_quarter_of_the_nodes_training_can_use_and_always_one():
    assert [drains_allowed(n, 0.25) for n in (1, 2, 4, 7, 8, 124)] == [1, 1, 1, 1, 2, 31]


def test_past_the_guard_no_node_is_drained_and_each_refusal_is_written_down(ray_session, tmp_path):
    """This session's Ray (one node, 2 CPUs, no GPU), marked unhealthy by a drill, after another node was drained
    earlier in the run: with 2 nodes training can use and a quarter of them allowed, the guard holds. The node
    stays schedulable, and health.jsonl, the incidents and the logbook say why it was not drained."""
    from train import health

    node = ray_session.get_runtime_context().get_node_id()
    assert health.trainable_nodes(1, 0) == [node]
    assert health.trainable_nodes(3, 0) == [] and health.trainable_nodes(1, 1) == []  # more CPUs or a GPU: none
    from train.config import InjectConfig
    from train.loop.drill import NodeFaults, mark_unhealthy

    assert NodeFaults.for_run(tmp_path, [InjectConfig(kind="kill", step=3)]) is None  # no node fault: no hook
    drill = NodeFaults.for_run(tmp_path, [InjectConfig(kind="unhealthy", step=2, node=node)])
    mark_unhealthy(tmp_path, node)
    earlier = {"node": "f" * 56, "host": "gone", "device": "cpu", "matmul_tflops": 0.0, "memory_ok": False,
               "allreduce_gbps": 0.0, "failed": "memory test read back wrong values (device 0)", "drained": True}
    (tmp_path / "health.jsonl").write_text(json.dumps(earlier) + "\n")
    checked = health.check(tmp_path, [node], HealthConfig(min_fraction=0.5, collective=False, max_excluded_fraction=0.25),
                           population=2, drill=drill)
    assert checked.excluded == [] and checked.refused == [node]
    assert checked.systemic.startswith("1 of 1 nodes probed failed (1 drained before): more than the 1 of 2")
    row = json.loads((tmp_path / "health.jsonl").read_text().splitlines()[-1])
    assert row["failed"] == "marked unhealthy by a drill" and row["drained"] is False and row["matmul_tflops"] > 0
    assert checked.table().splitlines()[2] == f"| {node[:12]} | {row['host']} | cpu | {row['matmul_tflops']:.3g} | ok | 0 | " \
                                              "marked unhealthy by a drill | no |"
    assert "not drained" in (tmp_path / "incidents.jsonl").read_text()
    assert json.loads((tmp_path / "logbook.jsonl").read_text())["kind"] == "drain-refused"
    assert ray_session.get(ray_session.remote(lambda: 1).remote(), timeout=60) == 1  # still takes tasks


def test_a_planned_restart_implicates_no_node_and_a_stragglers_drain_counts_against_the_limit(tmp_path):
    """A straggler's node drained at a checkpoint ends the attempt on purpose (PlannedRestart): no failure of its
    node's to probe. Its drain counts in the one limit on the run's drains, beside the health checks'."""
    from train.failures import Failure, classify, implicated
    from train.health import drained

    assert classify("PlannedRestart", "straggler rank 1's node n2 drained") == "planned"
    failures = [Failure(attempt=1, rank=r, kind=kind, type="T", message="m", step=10, node="n1")
                for r, kind in ((0, "planned"), (1, "planned"), (0, "software"), (0, "hardware"))]
    assert implicated(failures[:3], 1, 3600.0, {}) == [] and implicated(failures, 1, 3600.0, {}) == ["n1"]
    # Counted within health.window_seconds: over a run of weeks the autoscaler replaces nodes one by one.
    now = time.time()
    (tmp_path / "health.jsonl").write_text(f'{{"node": "n1", "drained": true, "time": {now - 7200}}}\n'
                                           f'{{"node": "n3", "drained": false, "time": {now}}}\n')
    (tmp_path / "stragglers.jsonl").write_text(f'{{"node": "n2", "rank": 1, "step": 8, "time": {now}}}\n'
                                               f'{{"node": "n2", "rank": 1, "step": 10, "drained": true, "time": {now}}}\n')
    assert drained(tmp_path) == 2 and drained(tmp_path, within=3600.0) == 1


def test_a_restart_probes_every_node_that_can_host_a_worker_unless_told_to_probe_the_implicated_only():
    """A node that turned unhealthy without failing is found at the next restart, whichever node that restart was
    for: `restart_probe: all` probes every node training can use but the drained ones, once per restart (not at the
    first start, which the stage probes itself, nor twice for one failure). `implicated` keeps the old rule: only a
    node with `failures` failures of its own."""
    from train.failures import Failure, to_probe

    now = time.time()
    crash = [Failure(attempt=1, rank=0, kind="hardware", type="ActorDiedError", message="m", step=13, node="n2",
                     time=now - 60)]
    nodes, first_check = ["n1", "n2", "n3", "n4"], {n: now - 600 for n in ("n1", "n2", "n3", "n4")}
    every = HealthConfig()
    assert every.restart_probe == "all"
    assert to_probe(every, [], first_check, nodes, []) == []  # the first start: the stage has probed them
    assert to_probe(every, crash, first_check, nodes, drained=["n3"]) == ["n1", "n2", "n4"]  # n1 never failed
    after = {**first_check, "n1": now - 30}  # this restart's probe came after the crash: no second probe for it
    assert to_probe(every, crash, after, nodes, []) == []
    assert to_probe(HealthConfig(restart_probe="implicated"), crash, first_check, nodes, []) == []
    assert to_probe(HealthConfig(restart_probe="implicated", failures=1), crash, first_check, nodes, []) == ["n2"]


@pytest.mark.parametrize("count", [2, 3, 4, 7, 124])
def test_the_ring_is_measured_in_two_or_three_rounds_of_pairs_that_share_no_node(count):
    """A restart's probe of every node must not wait for 124 pairs one after another: each node and the next
    are measured, every pair once, in rounds where no node is in two pairs (its link would carry both)."""
    nodes = [f"n{i}" for i in range(count)]
    rounds = ring_rounds(nodes)
    pairs = [pair for r in rounds for pair in r]
    ring = list(zip(nodes, nodes[1:] + nodes[:1]))[:count if count > 2 else 1]
    assert sorted(pairs) == sorted(ring)
    for r in rounds:
        ends = [n for pair in r for n in pair]
        assert len(ends) == len(set(ends)), r
    assert len(rounds) == (1 if count == 2 else 2 if count % 2 == 0 else 3)

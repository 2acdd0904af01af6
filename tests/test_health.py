"""The health verdict (train/health.py) on probes written by hand: a GPU against its peak, a CPU and every
node's all-reduce against the other nodes, a memory error, a probe that could not run, a drill's mark.
The probe itself on a real two-node cluster, and the drain: tests/test_job_submit.py."""

from __future__ import annotations

from train.health import Probe, verdicts


def probe(node: str, device: str = "cpu", tflops: float = 0.1, gbps: float = 1.0, memory_ok: bool = True, **kw) -> Probe:
    return Probe(node=node, host="h", device=device, matmul_tflops=tflops, memory_ok=memory_ok, allreduce_gbps=gbps, **kw)


def test_each_node_is_judged_against_its_reference_and_the_reason_is_said():
    cpus = [probe("a"), probe("b", tflops=0.11), probe("c", tflops=0.04), probe("d", gbps=0.3),
            probe("e", memory_ok=False), probe("f", injected=True), probe("g", error="RayTaskError: lost")]
    found = verdicts(cpus, min_fraction=0.5)
    assert found["a"] is None and found["b"] is None
    assert found["c"].startswith("matmul 0.04 TFLOP/s, under 0.5 x 0.1")  # the median of the others' rates
    assert found["d"].startswith("all-reduce 0.3 GB/s, under 0.5 x the median 1")
    assert found["e"] == "memory test read back wrong values" and found["f"] == "marked unhealthy by a drill"
    assert found["g"] == "the probe failed: RayTaskError: lost"
    # Between nodes: a node whose faster pair in the ring is slow has the slow link; with two nodes, no one can tell.
    ring = [probe("a", pair_gbps=10.0), probe("b", pair_gbps=11.0), probe("c", pair_gbps=2.0)]
    found = verdicts(ring, 0.5)
    assert found["a"] is None and found["b"] is None and found["c"].startswith("all-reduce with its neighbours 2 GB/s")
    assert verdicts(ring[1:], 0.5)["c"] is None
        # A GPU against its peak (H100 bf16: 989 TFLOP/s dense), whatever the other nodes do.
    gpus = [probe("x", "NVIDIA H100 80GB HBM3", tflops=700.0), probe("y", "NVIDIA H100 80GB HBM3", tflops=400.0)]
    found = verdicts(gpus, min_fraction=0.5)
    assert found["x"] is None and found["y"].startswith("matmul 400 TFLOP/s, under 0.5 x 989")
    # One node probed after its failures is judged against the earlier probes of the others.
    assert verdicts([probe("c", tflops=0.04)], 0.5, reference=[probe("a"), probe("b")])["c"] is not None
    assert verdicts([probe("c", tflops=0.04)], 0.5)["c"] is None  # alone, a CPU has nothing to be slower than

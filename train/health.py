"""Node health: a short probe pinned to each node, a verdict against what the node should do, and the exclusion
of a node that fails it.

OPT-175B's team ran hardware diagnostics at every manual restart and took the broken nodes out of the pool;
Llama 3 and MegaScale do it automatically. Here the probe runs before the first start (every alive node)
and on a node implicated in failures (train/failures.py), as a Ray task pinned to the node:

- a matmul rate: bf16 on a GPU, against `train/plan/hardware.py`'s peak for the device; fp32 on a CPU,
  against the median of the nodes probed with it (a CPU has no table entry);
- a memory test: a buffer allocated, filled and read back;
- collectives: an all-reduce between two processes on the node (NCCL on a GPU, gloo on a CPU), and one
  between each node and the next in a ring of the nodes probed; their bus bandwidth against the other
  nodes' median (a node whose two pairs are both slow has the slow link).

A node below `train.health.min_fraction` of its reference on any of them is excluded: Ray's GCS is asked to
drain it (`GcsClient.drain_node`, the call `ray drain-node` and autoscaler v2 make), so no new task or actor
lands on it, and the autoscaler replaces it when the run asks for its resources again. Draining, not
labels or custom resources: a node's labels and resources are fixed when it joins, while a drain takes
effect at once on a live node and is what the autoscaler itself uses before terminating one. Everything goes
to `health.jsonl` in the run folder (and MLflow as a table, by the stage), each exclusion also to the
incidents and the logbook.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import time
from pathlib import Path

MATMUL_SECONDS = 0.3  # per probe: long enough to be a rate, short enough to run on every node at every check
ALLREDUCE_MB = 16


@dataclasses.dataclass
class Probe:
    node: str
    host: str
    device: str  # what ran it: "cpu" or torch.cuda.get_device_name()
    matmul_tflops: float
    memory_ok: bool
    allreduce_gbps: float  # bus bandwidth between two processes on the node
    pair_gbps: float = 0.0  # the faster of its all-reduces with its two neighbours in a ring of the nodes probed
    injected: bool = False  # a drill marked the node unhealthy (run_dir/inject/unhealthy-<node>)
    error: str | None = None  # the probe itself failed on the node (it raised, or its task was lost)
    time: float = dataclasses.field(default_factory=time.time)


def _matmul_tflops(device, dtype) -> float:
    import torch

    n = 4096 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < MATMUL_SECONDS:
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done += 1
    return 2 * n**3 * done / (time.perf_counter() - began) / 1e12


def _memory_ok(device, megabytes: int) -> bool:
    import torch

    buffer = torch.arange(megabytes * 2**18, device=device, dtype=torch.int32)  # 4 bytes each
    ok = bool((buffer[1:] - buffer[:-1] == 1).all())
    del buffer
    return ok


def _allreduce_worker(rank: int, port: int, cuda: bool, out) -> None:
    from train.parallel.collectives import bus_bandwidth

    rate = bus_bandwidth(rank, 2, f"tcp://127.0.0.1:{port}", cuda, ALLREDUCE_MB)
    if rank == 0:
        out.put(rate)


def _allreduce_gbps(cuda: bool) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_allreduce_worker, args=(r, port, cuda, out)) for r in range(2)]
    for p in procs:
        p.start()
    rate = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return rate


def probe_here(run_dir: str, memory_mb: int, collective: bool) -> dict:
    """The probe, on the node it runs on (a Ray task pinned there)."""
    import ray
    import torch

    node = ray.get_runtime_context().get_node_id()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    result = Probe(node=node, host=socket.gethostname(), device=torch.cuda.get_device_name(0) if cuda else "cpu",
                   matmul_tflops=_matmul_tflops(device, torch.bfloat16 if cuda else torch.float32),
                   memory_ok=_memory_ok(device, memory_mb),
                   allreduce_gbps=_allreduce_gbps(cuda and torch.cuda.device_count() >= 2) if collective else 0.0,
                   injected=(Path(run_dir) / "inject" / f"unhealthy-{node}").exists())
    return dataclasses.asdict(result)


def probe(nodes: list[str], run_dir: Path, memory_mb: int = 256, collective: bool = True) -> list[Probe]:
    """The probe on each node at once, each pinned to its node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(probe_here)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        str(run_dir), memory_mb, collective) for node in nodes]
    out = []
    for node, ref in zip(nodes, refs):
        try:
            out.append(Probe(**ray.get(ref, timeout=600)))
        except Exception as error:  # a node that cannot run its probe is not one to train on
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            out.append(Probe(node=node, host="?", device="?", matmul_tflops=0.0, memory_ok=False, allreduce_gbps=0.0,
                             error=f"{type(error).__name__}: {first_line}"))
    return out


class Peer:
    """One side of a pair of nodes' all-reduce (a Ray actor pinned to its node)."""

    def address(self) -> str:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def measure(self, rank: int, init_method: str) -> float:
        import torch

        from train.parallel.collectives import bus_bandwidth

        return bus_bandwidth(rank, 2, init_method, torch.cuda.is_available(), ALLREDUCE_MB)


def pair_bandwidths(nodes: list[str]) -> dict[str, float]:
    """Each node and the next (a ring): the all-reduce bus bandwidth between a process on each, one pair at a
    time (pairs measured together would share links); each node's faster pair. A node whose faster pair is
    slow has the slow link itself: its neighbours each have one good pair. 0.0: the pair failed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if len(nodes) < 2:
        return {}
    peer = ray.remote(num_cpus=0, max_restarts=0)(Peer)
    pairs = list(zip(nodes, nodes[1:] + nodes[:1]))[:len(nodes) if len(nodes) > 2 else 1]
    fastest = dict.fromkeys(nodes, 0.0)
    for a, b in pairs:
        sides = [peer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in (a, b)]
        try:
            init = ray.get(sides[0].address.remote(), timeout=300)
            rate = ray.get([side.measure.remote(rank, init) for rank, side in enumerate(sides)], timeout=300)[0]
        except Exception:  # a pair that cannot all-reduce at all: both ends are suspect, the verdict says which
            rate = 0.0
        finally:
            for side in sides:
                ray.kill(side)
        fastest[a], fastest[b] = max(fastest[a], rate), max(fastest[b], rate)
    return fastest


def verdicts(probes: list[Probe], min_fraction: float, reference: list[Probe] = ()) -> dict[str, str | None]:
    """Why each node fails (None: healthy). A GPU's matmul rate against its peak; a CPU's, and every node's
    all-reduce bandwidth, against the median of the nodes (these, and `reference`: earlier probes of others)."""
    from train.plan.hardware import peak_for

    peers = [p for p in (*probes, *reference) if p.error is None] or list(probes)
    median_rate = statistics.median(p.matmul_tflops for p in peers)
    bandwidths = [p.allreduce_gbps for p in peers if p.allreduce_gbps > 0]
    median_bw = statistics.median(bandwidths) if bandwidths else 0.0
    pair_rates = [p.pair_gbps for p in probes if p.pair_gbps > 0]
    median_pair = statistics.median(pair_rates) if pair_rates else 0.0
    out: dict[str, str | None] = {}
    for p in probes:
        expected = peak_for(p.device, "bf16") if p.device != "cpu" else median_rate
        why = None
        if p.error is not None:
            why = f"the probe failed: {p.error}"
        elif p.injected:
            why = "marked unhealthy by a drill"
        elif not p.memory_ok:
            why = "memory test read back wrong values"
        elif expected and p.matmul_tflops < min_fraction * expected:
            why = f"matmul {p.matmul_tflops:.3g} TFLOP/s, under {min_fraction:g} x {expected:.3g}"
        elif median_bw and 0 < p.allreduce_gbps < min_fraction * median_bw:
            why = f"all-reduce {p.allreduce_gbps:.3g} GB/s, under {min_fraction:g} x the median {median_bw:.3g}"
        elif median_pair and p.pair_gbps < min_fraction * median_pair and len(probes) > 2:
            why = (f"all-reduce with its neighbours {p.pair_gbps:.3g} GB/s, under {min_fraction:g} x the median "
                   f"{median_pair:.3g} (both of its pairs slow: the link is this node's)")
        out[p.node] = why
    return out


def exclude(node: str, why: str) -> bool:
    """Drain `node`: Ray schedules nothing new on it, the autoscaler may replace it. Whether the GCS accepted."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, _ = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                 f"excluded by the training run's health check: {why}", 0)
    return bool(accepted)


def alive_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def check(run_dir: Path, nodes: list[str], min_fraction: float, collective: bool = True) -> list[str]:
    """Probe `nodes`, record every result, exclude the ones that fail; the excluded nodes."""
    from train import goodput

    run_dir, began = Path(run_dir), time.monotonic()
    earlier = _probes(run_dir / "health.jsonl")
    probes = probe(nodes, run_dir, collective=collective)
    if collective:  # between nodes: the ring of the nodes probed now (one node after its failures: none)
        pairs = pair_bandwidths([p.node for p in probes if p.error is None])
        probes = [dataclasses.replace(p, pair_gbps=pairs.get(p.node, 0.0)) for p in probes]
    found = verdicts(probes, min_fraction, reference=[p for p in earlier if p.node not in nodes])
    excluded = []
    with open(run_dir / "health.jsonl", "a") as f:
        for p in probes:
            f.write(json.dumps({**dataclasses.asdict(p), "failed": found[p.node]}) + "\n")
    for p in probes:
        if found[p.node] is not None:
            accepted = exclude(p.node, found[p.node])
            excluded.append(p.node)
            _write_down(run_dir, p, found[p.node], accepted)
    goodput.mark(run_dir, "health", seconds=time.monotonic() - began, nodes=len(nodes), excluded=len(excluded))
    return excluded


def last_checked(run_dir: Path) -> dict[str, float]:
    """When each node was last probed (health.jsonl)."""
    out: dict[str, float] = {}
    for p in _probes(Path(run_dir) / "health.jsonl"):
        out[p.node] = max(out.get(p.node, 0.0), p.time)
    return out


def _probes(path: Path) -> list[Probe]:
    """The probes recorded in health.jsonl (each row also says why it failed, which a Probe does not hold)."""
    from train.goodput import read_jsonl

    keep = {f.name for f in dataclasses.fields(Probe)}
    return [Probe(**{k: v for k, v in row.items() if k in keep}) for row in read_jsonl(path)]


def _write_down(run_dir: Path, p: Probe, why: str, accepted: bool) -> None:
    from train.autopilot_policy import Logbook

    what = f"node {p.node} ({p.host}) excluded: {why}" + ("" if accepted else " (Ray did not accept the drain)")
    with open(run_dir / "incidents.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "step": 0, "rank": -1, "what": what}) + "\n")
    Logbook(run_dir).append({"time": time.time(), "step": 0, "kind": "node-excluded", "detail": what,
                             "actions": ["drain node"], "why": "a node that fails its health check fails the run again",
                             "node": p.node})

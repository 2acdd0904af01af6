"""Node health: a short probe pinned to each node, a verdict against what the node should do, and the exclusion
of a node that fails it.

OPT-175B's team ran hardware diagnostics at every manual restart and took the broken nodes out of the pool;
Llama 3 and MegaScale do it automatically. Here the probe runs before the first start (every alive node)
and at every restart (train/failures.py: every node that can host a worker, or only the nodes implicated in
failures), as a Ray task pinned to each node, all at once:

- a matmul rate on every device of the node, timed after an untimed warm-up: bf16 on a GPU, against the
  rate a healthy GPU of its kind reaches in this probe (REFERENCE_TFLOPS, measured); fp32 on a CPU, against
  the median of the CPU nodes probed with it (a CPU has no table entry). The node's rate is its slowest
  device's: one slow GPU sets the pace of all;
- a memory test on every device: a buffer over most of its free memory (a GPU's; a set size on a CPU)
  written and read back with three patterns;
- NVML's counters where it is present (`nvidia-ml-py`): uncorrectable ECC errors, and rows the GPU could not
  remap or is waiting to;
- collectives: an all-reduce across all of the node's GPUs (NCCL; two gloo processes on a CPU), and one
  between each node and the next in a ring of the nodes probed, in two or three rounds of pairs that share no
  node (`ring_rounds`); their bus bandwidth against the other nodes' median (a node whose two pairs are both
  slow has the slow link).

Only the nodes training can use are probed (`trainable_nodes`: those with the resources a training worker
asks for), never a head without them, and a probe is compared only with probes of the same device.

Every verdict comes first; then the guard: when more than `train.health.max_excluded_fraction` of those
nodes would be drained over the run, none is, and the cause is called systemic (every refused drain written
down). Otherwise a node below `train.health.min_fraction` of its reference on any test is excluded: Ray's GCS is asked to
drain it (`GcsClient.drain_node`, the call `ray drain-node` and autoscaler v2 make), so no new task or actor
lands on it, and the autoscaler replaces it when the run asks for its resources again. Draining, not
labels or custom resources: a node's labels and resources are fixed when it joins, while a drain takes
effect at once on a live node and is what the autoscaler itself uses before terminating one. Everything goes
to `health.jsonl` in the run folder (and MLflow as a table, by the stage), each exclusion also to the
incidents and the logbook.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time
from pathlib import Path

from train import records
from train.config import HealthConfig

MATMUL_SECONDS = 0.5  # per device, after the warm-up: long enough to be a rate, short enough for every check
WARMUP_MATMULS = 3  # untimed, first: cuBLAS's start-up (an H100's first 0.3 s read 0.64-0.72 of its warm rate)
ALLREDUCE_MB = 16
MEMORY_FRACTION = 0.8  # of a GPU's free memory, tested
MEMORY_CHUNK = 1 << 30  # bytes compared at a time (a comparison's own buffer stays this small)

# The bf16 rate a healthy GPU reaches in this probe (4096 x 4096 matmuls, warm), in TFLOP/s: what
# `min_fraction` is a fraction of. Measured, not the datasheet's peak (docs/benchmarks.md, "The GPU check on an
# H100": one H100 80GB HBM3 gave 610-642 warm, 408-451 cold, against a 989 peak).
REFERENCE_TFLOPS = {"NVIDIA H100 80GB HBM3": 620.0,  # docs/benchmarks.md, "The GPU check on an H100"
                    "NVIDIA H200": 630.0}  # "The GPU check on an H200": 612-639 in four calls
# A GPU not measured here: its bf16 peak (train/plan/hardware.py) times the H100's measured share of its own.
MEASURED_SHARE_OF_PEAK = 620.0 / 989.0


@dataclasses.dataclass
class Probe:
    node: str
    host: str
    device: str  # what ran it: "cpu" or torch.cuda.get_device_name()
    matmul_tflops: float
    memory_ok: bool
    allreduce_gbps: float  # bus bandwidth between two processes on the node
    pair_gbps: float = 0.0  # the faster of its all-reduces with its two neighbours in a ring of the nodes probed
    device_tflops: list[float] = dataclasses.field(default_factory=list)  # each device's; matmul_tflops is the least
    bad_devices: list[int] = dataclasses.field(default_factory=list)  # devices whose memory test read back wrong values
    nvml: str | None = None  # what NVML's counters report wrong (None: nothing, or no NVML)
    error: str | None = None  # the probe itself failed on the node (it raised, or its task was lost)
    began: float = 0.0  # when the probe started on the node (its tests ran from then to `time`)
    time: float = dataclasses.field(default_factory=time.time)


def _matmul_tflops(device, dtype) -> float:
    import torch

    n = 4096 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(WARMUP_MATMULS):
        a @ b
    sync()
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < MATMUL_SECONDS:
        a @ b
        sync()
        done += 1
    return 2 * n**3 * done / (time.perf_counter() - began) / 1e12


def _memory_ok(device, megabytes: int | None) -> bool:
    """A buffer written and read back three times: all ones and zeros alternating (0x55, then 0xAA), then each
    4-byte word its own index. `megabytes` None: MEMORY_FRACTION of the device's free memory (a GPU)."""
    import torch

    size = megabytes * 2**20 if megabytes is not None else int(torch.cuda.mem_get_info(device)[0] * MEMORY_FRACTION)
    size -= size % 4
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    words = buffer.view(torch.int32)
    try:
        for byte in (0x55, 0xAA):
            buffer.fill_(byte)
            if any(bool((buffer[i:i + MEMORY_CHUNK] != byte).any()) for i in range(0, size, MEMORY_CHUNK)):
                return False
        step = MEMORY_CHUNK // 4
        for i in range(0, words.numel(), step):
            words[i:i + step].copy_(torch.arange(i, min(i + step, words.numel()), dtype=torch.int32, device=device))
        return not any(bool((words[i:i + step] != torch.arange(i, min(i + step, words.numel()), dtype=torch.int32,
                                                                 device=device)).any())
                       for i in range(0, words.numel(), step))
    finally:
        del words, buffer


def _nvml_problems() -> str | None:
    """What NVML's counters say is wrong on this node's GPUs, or None (nothing, or no NVML): uncorrectable ECC
    errors since the driver loaded, and rows the GPU failed to remap or is waiting to remap (A100 and later)."""
    try:
        import pynvml
    except ImportError:
        return None
    problems = []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC)
                if ecc:
                    problems.append(f"GPU {i}: {ecc} uncorrectable ECC errors")
            except pynvml.NVMLError:  # ECC off, or not supported
                pass
            try:
                _, _, pending, failed = pynvml.nvmlDeviceGetRemappedRows(handle)
                if failed or pending:
                    problems.append(f"GPU {i}: row remapping {'failed' if failed else 'pending (reset needed)'}")
            except pynvml.NVMLError:  # before A100: retired pages instead, not read here
                pass
    finally:
        pynvml.nvmlShutdown()
    return "; ".join(problems) or None


def _allreduce_worker(rank: int, world: int, port: int, cuda: bool, out) -> None:
    from train.parallel.collectives import bus_bandwidth

    rate = bus_bandwidth(rank, world, f"tcp://127.0.0.1:{port}", cuda, ALLREDUCE_MB)
    if rank == 0:
        out.put(rate)


def _allreduce_gbps(cuda: bool, world: int) -> float:
    """Bus bandwidth of an all-reduce across `world` processes on this node, one per GPU (NCCL) or, on a CPU, gloo."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_allreduce_worker, args=(r, world, port, cuda, out)) for r in range(world)]
    for p in procs:
        p.start()
    rate = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return rate


def probe_here(memory_mb: int, collective: bool) -> dict:
    """The probe, on the node it runs on (a Ray task pinned there), on every device of the node."""
    import ray
    import torch

    began = time.time()
    node = ray.get_runtime_context().get_node_id()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [torch.device("cuda", i) for i in range(gpus)] or [torch.device("cpu")]
    rates = [_matmul_tflops(d, torch.bfloat16 if gpus else torch.float32) for d in devices]
    bad = [i for i, d in enumerate(devices) if not _memory_ok(d, None if gpus else memory_mb)]
    result = Probe(node=node, host=socket.gethostname(), device=torch.cuda.get_device_name(0) if gpus else "cpu",
                   matmul_tflops=min(rates), memory_ok=not bad, device_tflops=rates, bad_devices=bad,
                   allreduce_gbps=_allreduce_gbps(gpus >= 2, gpus if gpus >= 2 else 2) if collective else 0.0,
                   nvml=_nvml_problems() if gpus else None, began=began)
    return dataclasses.asdict(result)


def probe(nodes: list[str], memory_mb: int = 256, collective: bool = True) -> list[Probe]:
    """The probe on each node at once, each pinned to its node; one that has not answered in 600 s (counted
    from the start: they run together) failed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(probe_here)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        memory_mb, collective) for node in nodes]
    out, deadline = [], time.monotonic() + 600
    for node, ref in zip(nodes, refs):
        try:
            out.append(Probe(**ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))))
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


def ring_rounds(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """The ring's pairs (each node and the next) in rounds of pairs that share no node: two rounds for an even
    count of nodes, three for an odd one, whatever the count. Pairs in one round run together, and no node's
    link carries two of them, so a restart's probe at 124 nodes waits for two pairs' time, not 124."""
    pairs = list(zip(nodes, nodes[1:] + nodes[:1]))[:len(nodes) if len(nodes) > 2 else 1]
    rounds: list[tuple[set[str], list[tuple[str, str]]]] = []
    for a, b in pairs:
        free = next((r for r in rounds if a not in r[0] and b not in r[0]), None)
        if free is None:
            free = (set(), [])
            rounds.append(free)
        free[0].update((a, b))
        free[1].append((a, b))
    return [pairs for _, pairs in rounds]


def pair_bandwidths(nodes: list[str], timeout: float = 300.0) -> dict[str, float]:
    """Each node and the next (a ring): the all-reduce bus bandwidth between a process on each, the pairs of
    a round (`ring_rounds`) at once; each node's faster pair. A node whose faster pair is slow has the slow
    link itself: its neighbours each have one good pair. 0.0: the pair failed, or took over `timeout` s."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if len(nodes) < 2:
        return {}
    peer = ray.remote(num_cpus=0, max_restarts=0)(Peer)
    fastest = dict.fromkeys(nodes, 0.0)
    for pairs in ring_rounds(nodes):
        sides = {pair: [peer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                        for n in pair] for pair in pairs}
        deadline = time.monotonic() + timeout
        try:
            inits = {pair: two[0].address.remote() for pair, two in sides.items()}
            measures = {}
            for pair, two in sides.items():
                try:
                    init = ray.get(inits[pair], timeout=max(1.0, deadline - time.monotonic()))
                    measures[pair] = [side.measure.remote(rank, init) for rank, side in enumerate(two)]
                except Exception:  # a pair that cannot all-reduce at all: both ends are suspect, the verdict says which
                    pass
            for (a, b), refs in measures.items():
                try:
                    rate = ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))[0]
                except Exception:
                    continue
                fastest[a], fastest[b] = max(fastest[a], rate), max(fastest[b], rate)
        finally:
            for side in (side for two in sides.values() for side in two):
                ray.kill(side)
    return fastest


def reference_tflops(device: str) -> float | None:
    """The bf16 rate a healthy GPU of this kind reaches in the probe: measured (REFERENCE_TFLOPS), else its peak
    times the H100's measured share of its own; None for a CPU or a GPU with no table entry."""
    from train.plan.hardware import peak_for

    if device in REFERENCE_TFLOPS:
        return REFERENCE_TFLOPS[device]
    peak = peak_for(device, "bf16") if device != "cpu" else None
    return peak * MEASURED_SHARE_OF_PEAK if peak else None


def verdicts(probes: list[Probe], min_fraction: float, reference: list[Probe] = ()) -> dict[str, str | None]:
    """Why each node fails (None: healthy). A GPU's matmul rate against its kind's reference rate; a CPU's, and
    every node's all-reduce bandwidth, against the median of the nodes with the same device (these, and
    `reference`: earlier probes of others). A CPU is never measured against a GPU, nor one GPU kind against
    another."""
    def same(p: Probe) -> list[Probe]:
        return [q for q in (*probes, *reference) if q.error is None and q.device == p.device] or [p]

    pair_rates = [p.pair_gbps for p in probes if p.pair_gbps > 0]
    median_pair = statistics.median(pair_rates) if pair_rates else 0.0
    out: dict[str, str | None] = {}
    for p in probes:
        peers = same(p)
        expected = reference_tflops(p.device) or statistics.median(q.matmul_tflops for q in peers)
        bandwidths = [q.allreduce_gbps for q in peers if q.allreduce_gbps > 0]
        median_bw = statistics.median(bandwidths) if bandwidths else 0.0
        slowest = p.device_tflops.index(min(p.device_tflops)) if p.device_tflops else 0
        why = None
        if p.error is not None:
            why = f"the probe failed: {p.error}"
        elif not p.memory_ok:
            why = f"memory test read back wrong values (device {', '.join(map(str, p.bad_devices)) or '?'})"
        elif p.nvml:
            why = f"NVML: {p.nvml}"
        elif expected and p.matmul_tflops < min_fraction * expected:
            why = f"matmul {p.matmul_tflops:.3g} TFLOP/s on device {slowest}, under {min_fraction:g} x {expected:.3g}"
        elif median_bw and 0 < p.allreduce_gbps < min_fraction * median_bw:
            why = f"all-reduce {p.allreduce_gbps:.3g} GB/s, under {min_fraction:g} x the median {median_bw:.3g}"
        elif median_pair and p.pair_gbps < min_fraction * median_pair and len(probes) > 2:
            why = (f"all-reduce with its neighbours {p.pair_gbps:.3g} GB/s, under {min_fraction:g} x the median "
                   f"{median_pair:.3g} (both of its pairs slow: the link is this node's)")
        out[p.node] = why
    return out


def drains_allowed(population: int, max_fraction: float) -> int:
    """How many nodes a run may drain, in all, out of the `population` training can use: at least one."""
    return max(1, int(max_fraction * population))


@dataclasses.dataclass(frozen=True)
class DrainLimit:
    """The run's one limit on drains, for health checks and stragglers alike: `allowed` of the `population` of
    nodes training can use (health.max_excluded_fraction), of which `done` were drained within the window."""

    done: int
    allowed: int
    population: int

    def refuses(self, more: int) -> bool:
        """Whether draining `more` nodes now would pass the limit."""
        return self.done + more > self.allowed


def drain_limit(run_dir: Path, population: int, settings: HealthConfig) -> DrainLimit:
    """The limit now (`settings`: the run's health section): drains within its window_seconds, against its
    max_excluded_fraction of the `population`."""
    return DrainLimit(drained(run_dir, settings.window_seconds), drains_allowed(population, settings.max_excluded_fraction),
                      population)


def exclude(node: str, why: str, by: str = "health check") -> bool:
    """Drain `node`: Ray schedules nothing new on it, the autoscaler may replace it. Whether the GCS accepted."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, _ = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                 f"excluded by the training run's {by}: {why}", 0)
    return bool(accepted)


def trainable_nodes(cpus: float, gpus: float) -> list[str]:
    """The alive nodes that can host a training worker: at least `cpus` CPUs and `gpus` GPUs in all (a Ray
    node's total resources). Never a head started with `CPU: 0`, as cluster.yaml's is."""
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= cpus
            and n["Resources"].get("GPU", 0) >= gpus]


@dataclasses.dataclass
class Checked:
    excluded: list[str]  # drained now
    refused: list[str]  # failed, but not drained: the guard
    systemic: str | None  # why the guard held, or None
    rows: list[dict]  # this check's rows of health.jsonl

    def table(self) -> str:
        """This check's probes, one row per node (the console)."""
        return "\n".join(["| node | host | device | matmul TFLOP/s | memory | all-reduce GB/s | failed | drained |",
                          "|---|---|---|---|---|---|---|---|"] +
                         [f"| {r['node'][:12]} | {r['host']} | {r['device']} | {r['matmul_tflops']:.3g} | "
                          f"{'ok' if r['memory_ok'] else 'BAD'} | {r['allreduce_gbps']:.3g} | {r['failed'] or ''} | "
                          f"{'yes' if r['drained'] else 'no'} |" for r in self.rows])


def check(run_dir: Path, nodes: list[str], settings: HealthConfig, population: int | None = None,
          drill=None) -> Checked:
    """Probe `nodes` (`settings`: the run's health section), record every result; then, every verdict known,
    drain the ones that fail unless the run would then pass its limit on drains (`drain_limit`, over the
    `population` of nodes training can use; default: the nodes probed): then none is, each refusal is written
    down, and the cause is called systemic. `drill`: a drill's hook at health checks (train/loop/drill.py's
    `NodeFaults`), whose `failing(nodes)` verdicts join the probes'."""
    from train import goodput

    run_dir, began = Path(run_dir), time.monotonic()
    earlier = _probes(run_dir)
    population = population or len(nodes)
    limit = drain_limit(run_dir, population, settings)
    probes = probe(nodes, collective=settings.collective)
    if settings.collective:  # between nodes: the ring of the nodes probed now (one node after its failures: none)
        pairs = pair_bandwidths([p.node for p in probes if p.error is None])
        probes = [dataclasses.replace(p, pair_gbps=pairs.get(p.node, 0.0)) for p in probes]
    found = verdicts(probes, settings.min_fraction, reference=[p for p in earlier if p.node not in nodes])
    if drill is not None:
        found.update({node: found[node] or why for node, why in drill.failing(list(found)).items()})
    failing = [p for p in probes if found[p.node] is not None]
    systemic = None
    if failing and limit.refuses(len(failing)):
        systemic = (f"{len(failing)} of {len(probes)} nodes probed failed{f' ({limit.done} drained before)' if limit.done else ''}"
                    f": more than the {limit.allowed} of {population} a run may drain (health.max_excluded_fraction "
                    f"{settings.max_excluded_fraction:g}); the cause looks systemic (an image, a driver, an NCCL setting, the probe), "
                    "so none is drained")
    rows = [{**dataclasses.asdict(p), "failed": found[p.node], "drained": found[p.node] is not None and systemic is None}
            for p in probes]
    records.append(run_dir, records.PROBE, *rows)
    result = Checked([], [], systemic, rows)
    for p in failing:
        if systemic is None:
            accepted = exclude(p.node, found[p.node])
            result.excluded.append(p.node)
            _write_down(run_dir, p, found[p.node], accepted)
        else:
            result.refused.append(p.node)
            _write_down(run_dir, p, found[p.node], False, refused=systemic)
    goodput.mark(run_dir, "health", seconds=time.monotonic() - began, nodes=len(nodes), excluded=len(result.excluded))
    return result


def drained(run_dir: Path, within: float | None = None) -> int:
    """How many nodes this run has drained in the last `within` seconds (None: ever): `drained_nodes`."""
    return len(drained_nodes(run_dir, within))


def drained_nodes(run_dir: Path, within: float | None = None) -> list[str]:
    """The nodes this run has drained, in the last `within` seconds (None: ever): those that failed a health
    check (health.jsonl), and stragglers' (stragglers.jsonl, train.stragglers.exclude). One limit holds for both.
    A window, not the whole run: the autoscaler replaces a drained node, and over a run of weeks hardware fails
    node by node (Llama 3: about 8 interruptions a day on 2,000 nodes), so a limit over the whole run would
    stop draining a bad node long before anything systemic happened."""
    now = time.time()
    return [r["node"] for r in records.read(run_dir, records.PROBE) + records.read(run_dir, records.DRAIN)
            if r["drained"] and (within is None or now - r.get("time", now) <= within)]


def last_checked(run_dir: Path) -> dict[str, float]:
    """When each node was last probed (health.jsonl)."""
    out: dict[str, float] = {}
    for p in _probes(run_dir):
        out[p.node] = max(out.get(p.node, 0.0), p.time)
    return out


def _probes(run_dir: Path) -> list[Probe]:
    """The probes recorded in health.jsonl."""
    return [_probe(row) for row in records.read(run_dir, records.PROBE)]


def _probe(row: dict) -> Probe:
    """A health.jsonl row as a Probe (the row also says why it failed and whether it was drained, which a Probe
    does not hold)."""
    keep = {f.name for f in dataclasses.fields(Probe)}
    return Probe(**{k: v for k, v in row.items() if k in keep})


def _write_down(run_dir: Path, p: Probe, why: str, accepted: bool, refused: str | None = None) -> None:
    if refused:
        what = f"node {p.node} ({p.host}) failed its health check, not drained: {why}"
        entry = {"kind": "drain-refused", "actions": [], "why": refused}
    else:
        what = f"node {p.node} ({p.host}) excluded: {why}" + ("" if accepted else " (Ray did not accept the drain)")
        entry = {"kind": "node-excluded", "actions": ["drain node"],
                 "why": "a node that fails its health check fails the run again"}
    records.incident(run_dir, 0, -1, what)
    records.log_entry(run_dir, time=time.time(), step=0, detail=what, node=p.node, **entry)

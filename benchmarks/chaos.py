"""A chaos drill: the train stage on a local three-node Ray cluster with faults injected, and what it did about each.

    python benchmarks/chaos.py [--faults SPEC] [--steps 24] [--set KEY=VALUE ...] [--json] [--out /tmp/chaos]
    python benchmarks/chaos.py --data dedup|normalize [--at PHASE] [--docs 40000] [--set K=V] [--json]   (chaos_data.py)

The cluster: a head that holds no training worker and two nodes of one CPU each, the tiny model's two
Ray Train workers on them (so a named node always holds a rank). The drill plays the autoscaler: when a
node is drained, it adds a fresh node in its place and removes the drained one. First a clean run,
then the same run (same shards, seed and schedule) with the faults.

SPEC is a comma-separated list of kind@step[:node], node 1 or 2 (default 1):
- crash: the worker on the node dies (a lost GPU, an ECC error);
- hang: its step stalls until its watchdog ends it (train.hang_seconds is 15 here);
- slow: from that step on, its every step's compute takes twice as long (a straggler: relative to the
  machine's own speed, so the drill means the same on any CPU); with `--set train.stragglers.exclude=true`
  its node must also be drained at the next checkpoint and the run restarted from it on a replacement;
- unhealthy: from that step on, the node fails its health check; it must be found by the next check (at step
  0, the one before the first start; later, the next restart's, whichever node that restart was for);
- error: a deterministic exception on every attempt: the run must stop, naming it;
- lost: the node dies and no replacement comes (needs `--set train.elastic.enabled=true`): the run must go on
  with fewer replicas, from its last checkpoint, the same global batch;
- back: a new node joins in the lost one's place: the run must grow back at its next checkpoint.
The default schedule has one of each. Each is a `train.inject` fault of the run, the node named by its id.
A schedule that marks both nodes unhealthy at step 0 must stop the run before it starts, draining neither
(the cause looks systemic): the drill then exits 1 with `"stopped"` saying so.

Prints a table of each fault and what the run did, the last step's loss against the clean run's at the same
step, and the goodput breakdown; `--json` prints one object instead:
{"faults": [{"kind", "step", "node", "handled", "action"}...], "final_loss", "clean_loss", "ettr",
"excluded_nodes", "stragglers", "probed_nodes", "head_node", "drains_refused", "stopped", "clean_stragglers",
"clean_drained", "resized": [{"step", "from", "to"}...]}.
The head has no CPU, as cluster.yaml's: it can host no training worker, so it must never be probed nor
drained. `--set` passes a config override (full.py's syntax) to both runs. Exits 0 when every fault was
handled, the last step's loss equals the clean run's, nothing but an injected error stopped the run, and
the clean run (no fault) drained no node: a straggler it names is a false alarm, reported; drained, it
costs a planned restart. A run that changed size matches the clean run's loss within 1%, not exactly: its
micro-batches are summed in another order, and each replica draws its own dropout masks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)
from chaos_cluster import Cluster  # noqa: E402
from train import goodput, records  # noqa: E402

DEFAULT = "crash@4:1,slow@2:2,hang@9:2,unhealthy@10:1,crash@12:1,error@20:2"
SLOW = 2.0  # a straggler's compute, as a factor of its own
SEQ, BATCH = 64, 8
KINDS = ("crash", "hang", "slow", "unhealthy", "error", "lost", "back")


def parse(spec: str) -> list[dict]:
    faults = []
    for item in filter(None, spec.split(",")):
        kind, _, rest = item.partition("@")
        step, _, node = rest.partition(":")
        if kind not in KINDS or not step.isdigit() or node not in ("", "1", "2"):
            raise SystemExit(f"--faults: {item!r} is not kind@step[:node] (kinds {', '.join(KINDS)}; node 1 or 2)")
        faults.append({"kind": kind, "step": int(step), "node": int(node or 1)})
    return faults


def overrides(steps: int, inject: list[dict]) -> list[str]:
    faults = json.dumps(inject)
    return ["train.model=tiny", "train.num_workers=2", "train.cpus_per_worker=1", f"train.max_steps={steps}",
            f"train.global_batch_tokens={BATCH * SEQ}", "train.micro_batch_size=2", "train.checkpoint_every=2",
            "train.eval_every=0", "train.seeds=1", "train.warmup_tokens=0", "train.hang_seconds=15", "train.startup_seconds=120",
            "train.collective_timeout_seconds=300", "train.health.enabled=true",
            "train.stragglers.window=3", "train.autopilot.enabled=false", "train.elastic.replacement_wait_seconds=5",
            f"train.inject={faults}"]


def to_inject(faults: list[dict], cluster: Cluster) -> list[dict]:
    kinds = {"crash": "kill", "hang": "hang", "slow": "slow", "error": "error", "unhealthy": "unhealthy", "lost": "lost",
             "back": "back"}
    return [{"kind": kinds[f["kind"]], "step": f["step"],
             "node": str(f["node"]) if f["kind"] == "back" else cluster.node_id(f["node"]),
             **({"factor": SLOW} if f["kind"] == "slow" else {})} for f in faults]


def watch(cluster: Cluster, runs: Path, done: threading.Event) -> None:
    """Play the autoscaler for both runs: replace the nodes either drains (the clean run drains one only on a
    false alarm, which the report names; unreplaced, its run would wait for the lost node forever), and serve the
    drill's `lost` and `back` (a node removed for good, a node that joins)."""
    while not done.wait(0.5):
        for run_dir in runs.glob("*"):  # none until the stage has made its run folder
            cluster.replace_drained(run_dir)
            cluster.serve(run_dir)


def run(out: Path, label: str, shards: Path, extra: list[str]) -> tuple[Path, str | None]:
    """The train stage; its output folder (the run folder's files are copied there) and why it stopped, if it did."""
    from bench_train import train_stage

    try:
        return train_stage(out, label, shards, extra), None
    except RuntimeError as error:
        return out / label / "stage" / "output", str(error)


def judge(faults: list[dict], run_dir: Path, stopped: str | None, cluster: Cluster, exclude: bool) -> list[dict]:
    """Each fault, handled or not, and what the run did about it (`exclude`: train.stragglers.exclude was set, so a
    straggler's node must also have been drained at a checkpoint and replaced)."""
    failed, probes, incidents = (records.read(run_dir, kind) for kind in (records.FAILURE, records.PROBE, records.INCIDENT))
    named, drains = records.read(run_dir, records.STRAGGLER), records.read(run_dir, records.DRAIN)
    out = []
    for f in faults:
        node = f["node_id"]
        if f["kind"] in ("crash", "hang"):
            kind = "hardware" if f["kind"] == "crash" else "hang"
            seen = [x for x in failed if x["primary"] and x["kind"] == kind and x["step"] == f["step"] and x["node"] == node]
            handled, action = bool(seen), (f"recorded as {kind} on rank {seen[0]['rank']}, restarted" if seen else "not seen")
        elif f["kind"] == "slow":
            seen = [s for s in named if s["node"] == node]
            left = [s for s in drains if s["node"] == node and s["drained"]]
            handled = bool(seen) and (not exclude or (bool(left) and node in cluster.replaced))
            action = f"rank {seen[0]['rank']} named a straggler at step {seen[0]['step']}" if seen else "not named"
            if exclude:
                action += f"; its node drained at the checkpoint of step {left[0]['step']}, replaced" if left else \
                    "; its node NOT drained"
        elif f["kind"] == "unhealthy":
            seen = [p for p in probes if p["node"] == node and p["failed"]]
            refused = [p for p in seen if not p["drained"]]
            late = found_late(seen, failed, incidents, node)
            handled = bool(seen) and not late and (node in cluster.replaced or bool(refused and stopped))
            action = (f"failed its health check ({seen[0]['failed']}), "
                      f"{'not drained: the run stopped, the cause looked systemic' if refused else 'drained, replaced'}"
                      if handled else late or "not excluded")
        elif f["kind"] in ("lost", "back"):
            handled, action = resized(f, records.read(run_dir, records.RESIZE), cluster)
        else:
            handled = bool(stopped) and f"injected error at step {f['step']}" in stopped
            action = "stopped: " + stopped.splitlines()[0][:90] if handled else "not stopped"
        out.append({"kind": f["kind"], "step": f["step"], "node": f["node"], "handled": handled, "action": action})
    return out


def resized(fault: dict, resizes: list[dict], cluster: Cluster) -> tuple[bool, str]:
    """A lost node: removed, and the run went on smaller; one that came back: joined, and the run grew after it."""
    if fault["kind"] == "lost":
        done = [r for r in resizes if r["to"] < r["from"]]
        if fault["node_id"] not in cluster.lost or not done:
            return False, "node not removed" if fault["node_id"] not in cluster.lost else "the run did not shrink"
        return True, f"node removed, not replaced; the run went on with {done[0]['to']} replica(s) from step {done[0]['step']}"
    grew = [r for r in resizes if r["to"] > r["from"] and r["step"] >= fault["step"]]
    if str(fault["node"]) not in cluster.joined or not grew:
        return False, "no node joined" if str(fault["node"]) not in cluster.joined else "the run did not grow back"
    return True, f"a node joined; the run grew to {grew[0]['to']} replicas at the checkpoint of step {grew[0]['step']}"


def found_late(seen: list[dict], failed: list[dict], incidents: list[dict], node: str) -> str | None:
    """Why an unhealthy node was found too late, or None: it must fail the check that follows its marking (the
    first start's, or the next restart's, whichever node that restart was for), so before a second failed attempt
    after it. The mark's time is its incident's (none for step 0: the stage marks it before the first check)."""
    marked = next((r["time"] for r in incidents if r.get("what") == f"injected unhealthy: node {node}"), 0.0)
    attempts: dict[int, float] = {}
    for x in failed:
        if x["primary"] and x["time"] > marked:
            attempts[x["attempt"]] = min(x["time"], attempts.get(x["attempt"], x["time"]))
    after = sorted(attempts.values())
    if seen and len(after) >= 2 and seen[0]["time"] > after[1]:
        return f"found only after {sum(t < seen[0]['time'] for t in after)} restarts, not the next"
    return None


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", default=DEFAULT)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, both runs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="/tmp/chaos")
    p.add_argument("--data", choices=["dedup", "normalize"], help="the data drill instead (chaos_data.py): this stage")
    p.add_argument("--at", help="--data: the phase at which node 2 dies (default: the stage's first)")
    p.add_argument("--docs", type=int, default=40_000, help="--data: documents in the generated corpus")
    return p


def main() -> int:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    if args.data:
        import chaos_data

        return chaos_data.run(args.data, args.at, args.docs, Path(args.out + "-data"), args.json, args.set)
    faults = parse(args.faults)
    if any(f["kind"] == "lost" for f in faults) and "train.elastic.enabled=true" not in args.set:
        raise SystemExit("--faults lost needs --set train.elastic.enabled=true: otherwise the run waits for a "
                         "replacement that never comes")
    from bench_tokenize import make_shards

    out = Path(args.out)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    shards = out / "shards"
    make_shards(shards, BATCH * (args.steps + 1), seq_len=SEQ, vocab=512)
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster()
    done = threading.Event()
    try:
        threading.Thread(target=watch, args=(cluster, out / "work" / "train" / "runs", done), daemon=True).start()
        run(out, "clean", shards, [*overrides(args.steps, []), *args.set])
        (clean_dir,) = (out / "work" / "train" / "runs").glob("*-clean*")
        false_alarms = set(cluster.replaced.copy())  # nodes the clean run drained: no fault was injected there
        for f in faults:
            f["node_id"] = None if f["kind"] == "back" else cluster.node_id(f["node"])
        _, stopped = run(out, "faults", shards, [*overrides(args.steps, to_inject(faults, cluster)), *args.set])
        (run_dir,) = (out / "work" / "train" / "runs").glob("*-faults*")
        results = judge(faults, run_dir, stopped, cluster, "train.stragglers.exclude=true" in args.set)
        excluded = sorted(set(cluster.replaced.copy()) - false_alarms)
        head = cluster.head
    finally:
        done.set()
        cluster.shutdown()
    report = summarize(results, clean_dir, run_dir, excluded, stopped)
    report["resized"] = [{k: r[k] for k in ("step", "from", "to")} for r in records.read(run_dir, records.RESIZE)]
    probes = records.read(run_dir, records.PROBE)
    report.update(probed_nodes=sorted({p["node"] for p in probes}), head_node=head, clean_drained=sorted(false_alarms),
                  drains_refused=sum(1 for p in probes if p["failed"] and not p["drained"]))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    expected_stop = any(f["kind"] == "error" for f in results)
    return 0 if all(f["handled"] for f in results) and report["loss_matches"] and bool(stopped) == expected_stop \
        and not report["clean_drained"] else 1


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss; none when the run stopped before its first step."""
    return {r["step"]: r["loss"] for r in records.read(run_dir, records.STEP)}


def summarize(results: list[dict], clean_dir: Path, run_dir: Path, excluded: list[str], stopped: str | None) -> dict:
    clean, faulty = losses(clean_dir), losses(run_dir)
    tolerance = 1e-2 if records.read(run_dir, records.RESIZE) else 1e-6  # a resize sums in another order
    last = max(faulty, default=None)
    account = goodput.account(run_dir)
    stragglers = records.read(run_dir, records.STRAGGLER, records.DRAIN)
    return {"faults": results, "final_step": last, "final_loss": faulty.get(last), "clean_loss": clean.get(last),
            "loss_matches": last is not None and abs(faulty[last] - clean[last]) <= tolerance * abs(clean[last]),
            "loss_tolerance": tolerance,
            "ettr": account["ettr"],
            "goodput": {k: v for k, v in account.items() if k.endswith("_seconds")}, "excluded_nodes": excluded,
            "stragglers": [{"rank": s["rank"], "node": s["node"], "step": s["step"], **({"drained": s["drained"]}
                                                                                     if s["record"] == records.DRAIN.name else {})}
                           for s in stragglers],
            "stopped": stopped.splitlines()[0] if stopped else None,
            # ranks the clean run named, with no fault injected: false alarms (each drained with stragglers.exclude)
            "clean_stragglers": [{"rank": s["rank"], "step": s["step"], "seconds": s["seconds"],
                                  "others_seconds": s["others_seconds"]}
                                 for s in records.read(clean_dir, records.STRAGGLER)]}


def agreement(report: dict) -> str:
    if not report["loss_matches"]:
        return "DIFFERENT"
    return "equal" if report["loss_tolerance"] < 1e-3 else "within 1%: the run changed size"


def print_table(report: dict) -> None:
    print("| fault | step | node | handled | what the run did |\n|---|---:|---:|---|---|")
    for f in report["faults"]:
        print(f"| {f['kind']} | {f['step']} | {f['node']} | {'yes' if f['handled'] else 'NO'} | {f['action']} |")
    if report["final_step"] is None:
        print("\nno step ran with the faults")
    else:
        print(f"\nloss at step {report['final_step']}: {report['final_loss']:.6f} with the faults, "
              f"{report['clean_loss']:.6f} clean ({agreement(report)})")
    named = ", ".join(f"rank {s['rank']} at step {s['step']}" for s in report["stragglers"])
    print(f"excluded nodes: {', '.join(report['excluded_nodes']) or 'none'}; stragglers: {named or 'none'}")
    if report["resized"]:
        print("resized: " + ", ".join(f"{r['from']} -> {r['to']} replicas at step {r['step']}" for r in report["resized"]))
    false = ", ".join(f"rank {s['rank']} at step {s['step']} ({s['seconds'] * 1e3:.0f} ms against "
                      f"{s['others_seconds'] * 1e3:.0f})" for s in report["clean_stragglers"])
    print(f"stragglers named in the clean run (false alarms): {false or 'none'}; nodes it drained: "
          f"{', '.join(report['clean_drained']) or 'none'}")
    head = "PROBED" if report["head_node"] in report["probed_nodes"] else "never probed"
    print(f"probed nodes: {len(report['probed_nodes'])}; the head: {head}; drains refused: {report['drains_refused']}")
    print(f"\ngoodput: ETTR {report['ettr']:.1%}")
    print("| part | seconds |\n|---|---:|")
    for key, value in report["goodput"].items():
        print(f"| {key.removesuffix('_seconds')} | {value:.1f} |")


if __name__ == "__main__":
    sys.exit(main())

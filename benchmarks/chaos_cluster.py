"""The chaos drill's cluster (benchmarks/chaos.py, chaos_data.py): Ray's test cluster on this machine, a head
without CPUs for workers and two one-CPU nodes, and the autoscaler's part, a drained node replaced. A module of its
own so that both drills import it and neither imports the other."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Cluster:
    """Ray's test cluster on this machine: a head without CPUs for workers, two one-CPU nodes, and the
    autoscaler's part: a drained node replaced by a new one."""

    def __init__(self):
        import ray
        from ray.cluster_utils import Cluster as RayCluster

        self.cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0})
        self.nodes = {k: self.cluster.add_node(num_cpus=1, resources={f"chaos_node_{k}": 1}) for k in (1, 2)}
        ray.init(address=self.cluster.address, logging_level=logging.WARNING)
        self.cluster.wait_for_nodes()
        self.ids = {k: node.node_id for k, node in self.nodes.items()}
        self.head = self.cluster.head_node.node_id
        self.replaced: dict[str, str] = {}
        self.lost: list[str] = []  # nodes a drill removed for good (`lost`)
        self.joined: dict[str, str] = {}  # nodes a drill added (`back`): name -> node id
        self.session = ray._private.worker._global_node.get_session_dir_path()  # every process of it names it

    def node_id(self, k: int) -> str:
        return self.ids[k]

    def start_node(self, resource: str) -> str:
        """A new node joins, as the autoscaler would launch it (`ray start`: from any thread, unlike add_node)."""
        import ray

        subprocess.run([str(Path(sys.executable).parent / "ray"), "start", f"--address={self.cluster.address}",
                        "--num-cpus=1", f"--resources={json.dumps({resource: 1})}", "--disable-usage-stats"],
                       check=True, capture_output=True, timeout=120)
        deadline = time.time() + 60
        while time.time() < deadline:
            found = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
            if found:
                return found[0]
            time.sleep(0.5)
        raise RuntimeError(f"the replacement node ({resource}) did not join")

    def replace_drained(self, run_dir: Path) -> None:
        """Each node the run drained (health.jsonl: a failed check; stragglers.jsonl: a straggler's, at a
        checkpoint), replaced once: a fresh node joins, the drained one leaves. A drain refused: not replaced."""
        from train.health import drained_nodes

        failed = set(drained_nodes(run_dir))
        for k, node_id in list(self.ids.items()):
            if node_id in failed and node_id not in self.replaced and node_id not in self.lost:  # lost: for good
                self.replaced[node_id] = self.start_node(f"chaos_node_{k}_replacement")
                self.ids[k] = self.replaced[node_id]  # the drained node stays, taking nothing new

    def serve(self, run_dir: Path) -> None:
        """The run's drill's requests (train/loop/drill.py `request`): a node lost (removed, not replaced) or a node
        that joins; each marker removed once done."""
        from train.loop.drill import requested

        for node_id, marker in requested(run_dir, "lost"):
            k = next(k for k, n in self.ids.items() if n == node_id)
            self.cluster.remove_node(self.nodes.pop(k), allow_graceful=False)
            self.lost.append(node_id)
            marker.unlink()
        for name, marker in requested(run_dir, "back"):
            self.joined[name] = self.start_node(f"chaos_node_{name}_back")
            marker.unlink()

    def shutdown(self) -> None:
        """The cluster, and the nodes `ray start` added (their processes name the session's folder)."""
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and self.session in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass

"""Where Ray Train puts a training layout's workers, asked of the cluster before a long run.

    python -m pipelines.placement --config configs/opt-175b.yaml [--set train.num_workers=16 ...]

starts the training stage's worker group (train/stage.py's `fit`, the same resources) with a loop that
only reports each worker's world rank, local rank, node and (pipeline stage, data replica, tensor rank),
and prints them with every tensor group that spans nodes. Exit 1 when one does: the training stage's
workers would refuse to start (train/parallel/groups.py's `tensor_group_problem`).

Ray Train numbers its workers node by node: the worker group is sorted by Ray node, then by GPU id
(ray/train/v2/_internal/execution/worker_group/worker_group.py), world ranks are handed out in that
order, and the local rank is the position among the workers with the same node IP address, that is,
on the same machine (two Ray nodes started on one machine share one count). Ranks are ordered (stage,
replica, tensor) as DeepSpeed's topology orders them, so a tensor group, T consecutive world ranks, is
on one machine whenever the job's workers fill whole machines; the pipeline's stages then follow each
other machine by machine.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from train.config import ParallelConfig, TrainConfig


def report(parallel: ParallelConfig) -> None:
    """The probe's worker loop (handed train.parallel): this worker's place, gathered on rank 0 and reported to the driver."""
    import ray
    import ray.train
    import torch.distributed as dist

    from train.parallel.groups import ParallelDims, tensor_group_problem

    ctx = ray.train.get_context()
    rank, local, local_world = ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_local_world_size()
    dims = ParallelDims.for_world(ctx.get_world_size(), tp=parallel.tensor, pp=parallel.pipeline)
    stage, data, tensor = dims.coords(rank)
    mine = {"rank": rank, "local_rank": local, "local_world": local_world, "node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "stage": stage, "data": data, "tensor": tensor,
            "problem": tensor_group_problem(dims, rank, local, local_world)}
    everyone = [None] * ctx.get_world_size()
    dist.all_gather_object(everyone, mine)
    with tempfile.TemporaryDirectory() as tmp:  # to the driver as a checkpoint: Ray Train keeps metrics with one only
        checkpoint = None
        if rank == 0:
            (Path(tmp) / "placement.json").write_text(json.dumps(everyone))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({}, checkpoint=checkpoint)


def probe(train: TrainConfig, workdir: str) -> list[dict]:
    """Every worker's place, by world rank, for a train section; Ray Train's records go where the training
    stage's would (train.storage, or WORKDIR/train/runs: shared storage on a cluster)."""
    import shutil

    from train.stage import fit

    folder = Path(train.storage or Path(workdir) / "train" / "runs") / f"placement-{int(time.time())}"
    try:
        result = fit(train, train.parallel, folder, loop=report)
        with result.checkpoint.as_directory() as found:
            return json.loads((Path(found) / "placement.json").read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def table(rows: list[dict]) -> str:
    nodes = {n: i for i, n in enumerate(dict.fromkeys(r["node"] for r in rows))}
    lines = ["| world rank | Ray node | machine | local rank | stage | replica | tensor rank |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rank']} | {nodes[r['node']]} ({r['node'][:8]}) | {r['ip']} | {r['local_rank']} of {r['local_world']} | "
              f"{r['stage']} | {r['data']} | {r['tensor']} |" for r in rows]
    return "\n".join(lines)

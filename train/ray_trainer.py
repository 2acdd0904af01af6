"""Ray Train's TorchTrainer less two of its default callbacks, each an actor (a process, seconds of imports) that a
job of ours starts and never uses.

- `DatasetsCallback` starts a DatasetManager actor at every start of a worker group, restarts included, to hand out
  Ray Data shards. Our workers read their token shards themselves (train/loader.py), and a trainer given no
  `datasets` has none to hand out (a worker's `dataset_shard_provider` is then None, as Ray Train allows). Dropped
  whenever the trainer has no datasets.
- `PlacementGroupCleanerCallback` starts a detached PlacementGroupCleaner per job, which asks the State API every
  second whether the controller still lives, and removes its placement group once it does not. A Ray this pipeline
  started itself (core/ray_session.py `started_here`) has no dashboard, so no State API: the cleaner cannot tell,
  and only warns; and that Ray, placement groups and all, ends with the driver. Dropped there only: a cluster's
  jobs keep it.

And with `train.elastic` on a tensor- or pipeline-parallel model, its elastic group sized in whole model replicas
(`ReplicaScalingPolicy`): Ray Train's own policy counts workers one by one, and would start 30 workers where a
replica is 8.

On 2 cores their processes' imports are CPU taken from the jobs starting beside them (the screen's two proxy jobs:
`benchmarks/bench_job_start.py`, figures in docs/benchmarks.md, "Where the laptop run's time goes"). Callbacks are
matched by class name, so a Ray that renames them keeps them; tests/test_screen.py then fails, naming the actors a
job started.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

WITHOUT_DATASETS = "DatasetsCallback"
ON_A_LOCAL_RAY = "PlacementGroupCleanerCallback"
UNUSED_ACTORS = ("DatasetManager", "PlacementGroupCleaner")  # what the two would start (the test looks for them)


class ReplicaScalingPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy (ray/train/v2/_internal/execution/scaling_policy/elastic.py), its count of the
    workers the live nodes can host rounded down to whole replicas of `replica` workers (tensor x pipeline): what
    the loop's groups take (train/loop/elastic.py counts replicas the same way). Created in the driver and handed
    to Ray Train's controller actor, as Ray's own is."""

    def __init__(self, scaling_config, replica: int):
        super().__init__(scaling_config)
        self.replica = replica

    def _count_possible_workers(self, reserved_resources) -> int:
        return super()._count_possible_workers(reserved_resources) // self.replica * self.replica


class LeanTorchTrainer(TorchTrainer):
    replica_workers = 1  # workers per model replica: an elastic group of a split model grows and shrinks by them

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        """Ray Train's controller, given `ReplicaScalingPolicy` in place of its elastic policy for a split model."""
        if self.replica_workers > 1 and type(controller_init_kwargs.get("scaling_policy")) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = ReplicaScalingPolicy(self.scaling_config, self.replica_workers)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self) -> list:
        from core.ray_session import started_here

        unused = ({WITHOUT_DATASETS} if not self.datasets else set()) | ({ON_A_LOCAL_RAY} if started_here() else set())
        return [c for c in super()._create_default_callbacks() if type(c).__name__ not in unused]

"""Ray Train's TorchTrainer less two of its default callbacks, each an actor (a process, seconds of imports) that a
job of ours starts and never uses, and with a controller that does not import torch.

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

And a controller that does not import torch. The controller actor unpickles what the driver hands it, the backend
config among it; Ray's `TorchConfig` lives in a module that imports torch (2.4 s of a fresh process here), though the
controller only tells the workers what to run. `ProcessGroupConfig` and its backend live here, in a module without
torch, and what they run on the workers (Ray Train's own steps: the address, the environment, the process group, the
CUDA device) is imported there; so neither the controller nor the process that starts the job (the screen's tasks)
imports torch. Every job's start waits for its controller, so each saves those seconds (docs/benchmarks.md, "A
controller without torch"); tests/test_screen.py reads a live controller's memory map for torch.

And on a local Ray, a controller without a runtime env, so that it and its synchronization actor may start in workers
Ray has prestarted (`controller_runtime_env`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
from ray.train.v2._internal.util import TrainingFramework
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

logger = logging.getLogger(__name__)

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


def _distributed_env(addr: str, port: int) -> None:
    """On every worker: the rendezvous and torch.distributed's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...), as
    Ray's torch backend sets them."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    _set_torch_distributed_env_vars()


def _join_process_group(**kwargs) -> None:
    """On every worker: `torch.distributed.init_process_group`, by Ray's own function (NCCL's error handling
    set as Ray sets it)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(init_method="env://", **kwargs)


def _leave_process_group(destroy: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy)


class OnTheWorkersDevice:
    """Around the training function on each worker: Ray's own context (the worker's CUDA device made current),
    imported there. The process that wraps the function (the stage's driver, a screen's task) then needs no torch."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        self.ray_context = TorchConfigContextManager()
        self.ray_context.__enter__()

    def __exit__(self, *exc) -> bool:
        return self.ray_context.__exit__(*exc)


class ProcessGroupBackend(Backend):
    """What Ray's torch backend does on a job's start and end (ray/train/torch/config.py `_TorchBackend`, for
    `init_method="env"`), asked of the workers from a controller that never imports torch."""

    share_cuda_visible_devices = True  # as Ray's torch backend: a worker sees its node's GPUs, which NCCL needs

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        addr, port = worker_group.execute_single(0, get_address_and_port)  # the rendezvous: rank 0's node, a free port
        worker_group.execute(_distributed_env, addr=addr, port=port)
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, _join_process_group, backend=backend_config.backend,
                                                   world_rank=rank, world_size=size, timeout_s=backend_config.timeout_s)
                 for rank in range(size)])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        timeout = int(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(worker_group.execute_async(_leave_process_group, destroy=len(worker_group) > 1), timeout=timeout)
        except GetTimeoutError:
            logger.warning("torch's process group did not shut down within %d s", timeout)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray's `TorchConfig` with `init_method="env"`: `backend` gloo, or nccl where the workers have GPUs (the
    trainer chooses), and each collective's `timeout_s`."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def train_func_context(self):
        return OnTheWorkersDevice

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


def controller_runtime_env() -> dict | None:
    """The runtime env Ray Train gives a job's controller: the Ray Train settings set in the driver's environment
    (`get_env_vars_to_propagate`), and its blocking-get warning at Ray Train's default. None on a Ray this pipeline
    started whose processes have all of them already (core/ray_session.py `LOCAL_TRAIN_ENV`).

    Why: an actor with a runtime env starts in a worker process of its own, through Ray's setup_worker.py (a Python
    that imports Ray to set the variables, then execs the worker, which imports Ray again), and never in a worker
    that Ray has prestarted; the synchronization actor the controller starts inherits its runtime env, and so
    starts the same way. One-worker jobs on a local Ray of 2 CPUs reached their loop in 4.0 s without it, against
    4.5 s (medians of six; docs/benchmarks.md, issue 62's fifteenth step). A setting the driver has that a local
    Ray's processes do not (set in its environment after `ray.init`, or at any time on a cluster) still goes as Ray
    Train sends it."""
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                                                  get_env_vars_to_propagate)

    from core.ray_session import LOCAL_TRAIN_ENV, started_here

    env_vars = {RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR: DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                **get_env_vars_to_propagate()}
    if started_here() and env_vars.items() <= LOCAL_TRAIN_ENV.items():
        return None
    return {"env_vars": env_vars}


class LeanTorchTrainer(DataParallelTrainer):
    replica_workers = 1  # workers per model replica: an elastic group of a split model grows and shrinks by them

    def __init__(self, train_loop_per_worker, *, timeout_s: int, scaling_config, **kwargs):
        backend = "nccl" if scaling_config.use_gpu else "gloo"
        super().__init__(train_loop_per_worker, backend_config=ProcessGroupConfig(backend, timeout_s),
                         scaling_config=scaling_config, **kwargs)

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        """Ray Train's controller, started as Ray Train starts it (ray/train/v2/api/data_parallel_trainer.py), with
        two changes: `ReplicaScalingPolicy` in place of its elastic policy for a split model, and the runtime env of
        `controller_runtime_env`, none on a Ray whose processes already have what Ray Train would send."""
        from ray.train.v2._internal.execution.controller import TrainController

        if self.replica_workers > 1 and type(controller_init_kwargs.get("scaling_policy")) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = ReplicaScalingPolicy(self.scaling_config, self.replica_workers)
        node = {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}  # the driver's node, as Ray's
        controller = ray.remote(num_cpus=0, label_selector=node, runtime_env=controller_runtime_env())(
            TrainController).remote(**controller_init_kwargs)
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())

    def _create_default_callbacks(self) -> list:
        from core.ray_session import started_here

        unused = ({WITHOUT_DATASETS} if not self.datasets else set()) | ({ON_A_LOCAL_RAY} if started_here() else set())
        return [c for c in super()._create_default_callbacks() if type(c).__name__ not in unused]

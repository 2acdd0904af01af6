"""Starting Ray: in-process on a laptop, the cluster when RAY_ADDRESS is set.

`ray job submit` sets RAY_ADDRESS for the driver, and `ray.init()` then joins that cluster;
the same code with no RAY_ADDRESS starts a local Ray inside this process. Nothing else in the
project calls `ray.init`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass

from core.config import at_least
from core.console import route_ray_logging

PARTITION_BYTES = 256 << 20  # of shuffled data per hash-shuffle partition, when the caller names no count
SORT_BLOCK_BYTES = 64 << 20  # of data per input block of a sort shuffle (groupby)


@dataclass
class RayConfig:
    """How Ray starts when RAY_ADDRESS is not set (with it set, the cluster decides)."""

    num_cpus: int | None = None
    """CPUs of a Ray this process starts (no `RAY_ADDRESS`). `null`: every core of this machine. On a cluster the
    cluster decides."""
    small_shuffle_mb: int = 256
    """A groupby moving less than this many MB shuffles in Ray Data tasks (a sort); more goes through Ray Data's
    hash shuffle, with partitions sized from the data. Both give the same groups. 0: always the hash shuffle."""
    disk_shuffle: bool = True
    """Keep the hash shuffle's shards in files on each node (Ray's disk-based [SHUFFLE_V2](glossary.md#shuffle_v2))
    instead of the object store: the driver then holds a handle per map task, not a reference per map task and
    partition."""

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "num_cpus")
        at_least(self, key, 0, "small_shuffle_mb")


# Ray Train settings for a Ray this process starts (never for a cluster's): a laptop is not preempted,
# so no preemption-watcher actor per job (one process start, and an error-level log line of Ray's
# own about its constructor arguments); and the controller looks at its workers every 0.25 s, not
# 2 s, so a finished or failed worker group is seen at once (a job's end, and each restart).
# They reach Ray's processes through the environment the local Ray starts with, not a job runtime env:
# a worker of a job with a runtime env starts as a second Python (Ray's setup_worker.py, which imports Ray
# to set the variables, then execs the worker), and Ray prestarts no worker for it. Without one, a local
# Ray's first two tasks ran in 0.37 s against 1.3 s, six actors started in 1.9 s against 3.3 s
# (docs/benchmarks.md, issue 62's fourteenth step). The third is the one Ray Train gives every controller a runtime
# env for, at its own default (ray/train/v2/_internal/constants.py): with it here, a controller on a local Ray needs
# none (train/ray_trainer.py `LeanTorchTrainer._initialize_and_run_controller`).
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
                   "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}

# The node label of a Ray that `init_ray` started here: how `started_here` knows it, in the driver and the workers.
LOCAL_LABELS = {"opt-pipeline/ray": "started-by-the-pipeline"}

# Ray's worker pool for a Ray this process starts: an idle worker is ended after 10 s idle, not Ray's 1 s. Ray keeps
# idle workers only up to the CPUs that are free, so while a Ray Train worker or a stage's own task held every CPU,
# each idle worker was ended a second after its task, and the next task waited for a new process to start and import
# Ray Data, pyarrow and the stage's code: 24 worker processes for dedup's hash-shuffle rerun on 1 CPU, against 11
# now, and 52 s against 28 s (docs/benchmarks.md). A cluster's raylets take their settings from `ray start`.
LOCAL_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 10_000}


def started_here() -> bool:
    """True in every process of a Ray that `init_ray` started inside the pipeline's own process (no RAY_ADDRESS),
    driver and workers alike: its node carries LOCAL_LABELS. Such a Ray has no dashboard (so no State API), and
    ends with the driver."""
    import ray

    labels = ray.get_runtime_context().get_node_labels()
    return all(labels.get(key) == value for key, value in LOCAL_LABELS.items())


def init_ray(num_cpus: int | None = None, verbose: bool = False) -> None:
    """`ray.init`: the cluster named by RAY_ADDRESS, else a Ray inside this process with `num_cpus`
    (None: every core). The workers', raylet's and GCS's output stays in Ray's session logs unless
    `verbose`; the driver's Ray loggers show only errors (core/console.py)."""
    import ray
    import ray.data  # its loggers exist from here on

    route_ray_logging(verbose)  # before ray.init, which logs notices of its own
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.INFO, log_to_driver=verbose)
    else:
        with environment(LOCAL_TRAIN_ENV):  # Ray's processes inherit it; this one gets its own back
            ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.INFO, log_to_driver=verbose,
                     labels=LOCAL_LABELS, _system_config=LOCAL_SYSTEM_CONFIG)


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """os.environ with `values` set, as it was afterwards: for the processes started meanwhile."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_ray(config: RayConfig, verbose: bool = False) -> bool:
    """Start (or join) Ray and set Ray Data up for this pipeline; True when this call started Ray, so
    the caller shuts it down."""
    import ray
    import ray.data

    started = False
    if not ray.is_initialized():
        init_ray(config.num_cpus, verbose)
        started = True
    ctx = ray.data.DataContext.get_current()
    # Ray Data 2.60's default Parquet read (DataSourceV2) starts a pool of 32 FooterReader actors for every
    # read_parquet, however few the files: 32 process start-ups per read, most of a small stage's time on a
    # laptop (docs/benchmarks.md). Our reads are of our own parts (a few files of up to 256 MB per stage),
    # which the V1 reader's footer tasks plan as well at any size.
    ctx.use_datasource_v2 = False
    # Ray Data's own bars (one per operator) with --verbose on a terminal; the stages draw one of their own.
    ctx.enable_progress_bars = verbose and sys.stderr.isatty()
    return started


def groupby(ds, key: str, nbytes: int, ray_config: RayConfig, num_partitions: int | None = None):
    """`ds.groupby(key)` with a shuffle sized for the `nbytes` it moves.

    Ray Data's hash shuffle (Ray 2.60's SHUFFLE_V2: map and reduce operators, its shards in the object
    store or, with `ray.disk_shuffle`, in files) is what a corpus spread over a cluster needs; but
    each groupby through it has a fixed cost of seconds, whatever the data: a 1.4 MB groupby took
    3.3-3.6 s on the object store and 4.7-5.3 s on disk, against 0.7-0.8 s on the sort shuffle
    (2 cores; `benchmarks/bench_dedup_scale.py --small`, docs/benchmarks.md). Below
    `ray.small_shuffle_mb` the same groupby runs as Ray Data's sort shuffle instead, on blocks of
    SORT_BLOCK_BYTES. Above it, the hash shuffle, with `num_partitions` (default: one per
    PARTITION_BYTES). The groups, and so every result, are the same either way (tests/test_dedup.py
    runs both)."""
    from ray.data.context import ShuffleStrategy

    if nbytes < ray_config.small_shuffle_mb << 20:
        ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED  # this dataset's own copy of the context
        # The sort shuffle cuts each of its N input blocks into N pieces, and a task's return under 100 KB (Ray's
        # max_direct_call_object_size) is kept by its owner: the driver. With a block per input file, that put the
        # whole exchange in the driver's memory (96 MB from 60 blocks: +99 MB there; bench_dedup_scale.py --groupby).
        # Blocks of SORT_BLOCK_BYTES first: pieces of megabytes, in the object store, and the groupby 3x faster.
        return ds.repartition(max(1, -(-nbytes // SORT_BLOCK_BYTES))).groupby(key)
    ds.context.use_disk_based_hash_shuffle = ray_config.disk_shuffle
    return ds.groupby(key, num_partitions=num_partitions or max(1, -(-nbytes // PARTITION_BYTES)))


def over_all(ds, *aggregations) -> dict:
    """`ds.aggregate(...)` over the whole dataset (no key), e.g. Max("held"): {"max(held)": value}, each None for
    an empty one. On the sort shuffle, whatever the dataset's context says: a global aggregate moves one row per
    block, and the hash shuffle's aggregator actors cost seconds of start-up for it (6.7 s of the laptop's
    17 s dedup, for a sum of a few hundred rows)."""
    from ray.data.context import ShuffleStrategy

    ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED  # this dataset's own copy of the context
    rows = collect(ds.groupby(None).aggregate(*aggregations)).to_pylist()  # what ds.aggregate does, without its take(1)
    return rows[0] if rows else None


def largest(ds, column: str) -> int:
    """The largest value of `column` over the whole dataset (`over_all`), 0 for an empty one."""
    from ray.data.aggregate import Max

    return over_all(ds, Max(column))[f"max({column})"] or 0


def collect(ds) -> pa.Table:
    """A small dataset's rows, on the driver, as one table (no columns where it has no rows).

    Through its blocks' references, not Ray Data's iterators (`take`, `take_all`, `aggregate`): an iterator leaves
    threads behind (Prefetcher, iter_threaded) that hold its last blocks until they wind down, after the call
    returns, and then in reference cycles. Dedup collects its garbage as each phase ends (dedup/stage.py): a
    phase ended by an iterator could leave those blocks, and their task specifications, to the next (issue #61)."""
    import ray

    return collect_tables(ray.get(ds.to_arrow_refs()))


def collect_tables(tables: list[pa.Table]) -> pa.Table:
    import pyarrow as pa

    tables = [t for t in tables if t.num_rows]
    return pa.concat_tables(tables) if tables else pa.table({})

"""Starting Ray: in-process on a laptop, the cluster when RAY_ADDRESS is set.

`ray job submit` sets RAY_ADDRESS for the driver, and `ray.init()` then joins that cluster;
the same code with no RAY_ADDRESS starts a local Ray inside this process. Nothing else in the
project calls `ray.init`.
"""

from __future__ import annotations

import logging
import os
import sys

from pipelines.config import PipelineConfig


def under_pytest() -> bool:
    return "PYTEST_CURRENT_TEST" in os.environ


def quiet_worker_logs() -> None:
    """Every Ray worker runs this first (`worker_process_setup_hook`)."""
    if not os.environ.get("RAY_ADDRESS"):
        # Local Ray runs without the dashboard, so Ray Train's placement-group cleaner cannot use the
        # State API and would warn every few seconds; on a cluster it can.
        logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def start_ray(config: PipelineConfig) -> bool:
    """Start (or join) Ray; True when this call started it, so the caller shuts it down."""
    import ray
    import ray.data

    started = False
    runtime_env = {"worker_process_setup_hook": "pipelines.engines.quiet_worker_logs"}
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(runtime_env=runtime_env)  # joins the cluster named by RAY_ADDRESS
        else:
            ray.init(num_cpus=config.ray.num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                     runtime_env=runtime_env)
        started = True
    quiet = under_pytest() or not config.ray.progress_bars or not sys.stderr.isatty()  # no bars in logs
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = not quiet
    if quiet:
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    return started

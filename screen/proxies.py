"""The screen's proxy runs on Ray Train: jobs that take runs from one queue across the screen's rounds.

Starting a Ray Train job with DeepSpeed costs seconds (a controller, the workers importing torch and
DeepSpeed, the process group); a laptop's tiny proxy run costs about as much. So a job does not get
a fixed list of runs: it takes them one after another from the screen's queue, up to `runs_per_job`,
and waits for more while the screen decides what the next round needs. A later round then costs
its runs, not another start (on the laptop's sample: ~16 s -> ~5 s for the second round).
`runs_per_job: 1` (the cluster configs) is a job per run: a failure or a slow node touches one run.

A job's workers ask the queue for "the job's k-th run", so all ranks of a multi-worker proxy run
the same one; a job that Ray Train restarts asks again from k = 0 and reruns its runs in order (a
proxy run is a function of its mixture and seed, so the rerun gives the same curve).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

WAIT = "wait"  # the queue's answer while it is empty but open: ask again


class RunQueue:
    """The runs not yet taken (a Ray actor). Items are {"key": str, "config": the run's loop config}."""

    def __init__(self) -> None:
        self.pending: list[dict] = []
        self.given: dict[tuple[int, int], dict] = {}
        self.done: set[str] = set()
        self.closed = False

    def put(self, items: list[dict]) -> None:
        self.pending.extend(items)

    def take(self, job: int, k: int) -> dict | str | None:
        """Job `job`'s k-th run: the same for every rank that asks; WAIT while none is queued, None once closed."""
        if (job, k) not in self.given:
            if self.pending:
                self.given[job, k] = self.pending.pop(0)
            else:
                return None if self.closed else WAIT
        return self.given[job, k]

    def finish(self, key: str) -> None:
        self.done.add(key)

    def finished(self) -> set[str]:
        return self.done

    def taken_by(self, job: int) -> list[str]:
        return [item["key"] for (j, _), item in self.given.items() if j == job]

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class ProxyJob:
    """What each worker of one of the screen's Ray Train jobs is handed."""

    queue: object  # the RunQueue actor's handle
    job: int  # this job's number: its ranks ask the queue for "job j's k-th run"
    runs: int  # the most runs it takes


def proxy_loop(config: ProxyJob) -> None:
    """A Ray Train job of the screen: up to `config.runs` proxy runs, each `train_loop` with a fresh model,
    taken from `config.queue` as job `config.job`; it ends early when the queue is closed and empty."""
    import ray
    import ray.train

    from train.loop import train_loop

    queue, job = config.queue, config.job
    for k in range(config.runs):
        while (item := ray.get(queue.take.remote(job, k))) == WAIT:
            time.sleep(0.05)
        if item is None:
            return
        train_loop(item["config"])
        if ray.train.get_context().get_world_rank() == 0:  # rank 0 writes the run's metrics
            ray.get(queue.finish.remote(item["key"]))


def _fit(cfg, config: dict, folder: Path) -> None:
    from train.stage import fit

    fit(cfg, config, folder, loop=proxy_loop)


class ProxyJobs:
    """Up to `concurrent` Ray Train jobs of up to `runs_per_job` runs each, over one queue. `run(items)` queues
    a round's runs and returns when all are done (or raises, naming the runs of a job that failed); `close()`
    ends the jobs once the screen needs no more. Use as a context manager."""

    def __init__(self, train_cfg, *, concurrent: int, runs_per_job: int, folder: Path) -> None:
        import ray

        self.train_cfg, self.concurrent, self.runs_per_job, self.folder = train_cfg, concurrent, runs_per_job, folder
        self.queue = ray.remote(num_cpus=0)(RunQueue).remote()
        self.fit = ray.remote(num_cpus=0)(_fit)  # the trainer's workers hold the CPUs and GPUs; this task only waits
        self.live: dict = {}  # the fit task's ref -> the job's number
        self.started = 0

    def __enter__(self) -> "ProxyJobs":
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(wait=kind is None)

    def run(self, items: list[dict]) -> None:
        import ray

        ray.get(self.queue.put.remote(items))
        want = {item["key"] for item in items}
        while True:
            finished = ray.get(self.queue.finished.remote())
            if want <= finished:
                return
            # A job per run not yet done, up to `concurrent` (jobs still up from earlier rounds count).
            while len(self.live) < min(self.concurrent, len(want - finished)):
                self._start()
            ended, _ = ray.wait(list(self.live), num_returns=1, timeout=0.1)
            for ref in ended:
                self._ended(ref)

    def _start(self) -> None:
        number = self.started
        self.started += 1
        folder = self.folder / f"job-{number:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        config = ProxyJob(self.queue, number, self.runs_per_job)
        self.live[self.fit.remote(self.train_cfg, config, folder)] = number

    def _ended(self, ref) -> None:
        import ray

        number = self.live.pop(ref)
        try:
            ray.get(ref)
        except Exception as exc:
            done = ray.get(self.queue.finished.remote())
            lost = [key for key in ray.get(self.queue.taken_by.remote(number)) if key not in done]
            raise RuntimeError(f"proxy runs {', '.join(lost) or '(none taken)'} failed in job {number} "
                               f"(run folders under {self.folder}): {exc}") from exc

    def close(self, wait: bool = True) -> None:
        """No more runs: idle jobs end now. On an error, the other jobs finish the run they are in and end."""
        import ray

        ray.get(self.queue.close.remote())
        if wait:
            for ref in list(self.live):
                self._ended(ref)

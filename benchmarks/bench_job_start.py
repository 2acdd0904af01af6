"""How long a Ray Train job of ours takes to reach its loop, with Ray Train's own TorchTrainer and with ours.

    .venv/bin/python benchmarks/bench_job_start.py [--rounds 3] [--jobs 2] [--out /tmp/bench_job_start]

As the screen starts its proxy jobs on a laptop: `--jobs` one-worker jobs (1 CPU each) side by side on the local
Ray the pipeline starts (core/ray_session.py), each from a Ray task, as screen/proxies.py does. The loop imports
what ours does (train.loop, DeepSpeed) and ends. Each round starts the jobs with Ray Train's `TorchTrainer`, then
with `train/ray_trainer.py`'s `LeanTorchTrainer` (fewer actors, and a controller without torch; the sides take
turns: a 2-core cloud machine's speed drifts), and reports the seconds from the jobs' launch to the last one's
loop, and every actor class Ray started for them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)


def loop(config: dict) -> None:
    """The worker's side: what our loop imports before its first step, then the time it got here."""
    import time

    from train.deepspeed_import import import_deepspeed

    import_deepspeed()  # as train.loop.train_loop does first
    import train.loop  # noqa: F401
    Path(config["entered"]).write_text(str(time.time()))


def start_jobs(lean: bool, jobs: int, folder: Path) -> tuple[float, set[str]]:
    """(seconds from launch to the last job's loop, the actor classes Ray started meanwhile)."""
    import ray
    import ray._private.state

    def fit(n: int) -> None:
        from ray.train import RunConfig, ScalingConfig

        if lean:  # each imports what it needs, in the task as the screen's: Ray's trainer imports torch, ours not
            from train.ray_trainer import LeanTorchTrainer

            trainer_class = functools.partial(LeanTorchTrainer, timeout_s=1800)  # TorchConfig's default
        else:
            from ray.train.torch import TorchTrainer as trainer_class

        trainer = trainer_class(
            loop, train_loop_config={"entered": str(folder / f"entered-{n}")},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="ray", storage_path=str(folder / f"job-{n}")))
        trainer.fit()

    before = {a["ActorID"] for a in ray._private.state.actors().values()}
    launched = time.time()
    ray.get([ray.remote(num_cpus=0)(fit).remote(n) for n in range(jobs)])
    entered = max(float((folder / f"entered-{n}").read_text()) for n in range(jobs))
    started = {a["ActorClassName"] for a in ray._private.state.actors().values() if a["ActorID"] not in before}
    return entered - launched, started


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="turns each side takes (medians reported)")
    p.add_argument("--jobs", type=int, default=2, help="jobs started side by side (the laptop's screen: 2)")
    p.add_argument("--out", default="/tmp/bench_job_start")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    import shutil

    import ray

    from core.ray_session import init_ray

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    init_ray()
    ray.get([ray.remote(lambda: None).remote() for _ in range(4)])  # as in the pipeline: Ray's workers up
    seconds: dict[str, list[float]] = {"TorchTrainer": [], "LeanTorchTrainer": []}
    actors: dict[str, set[str]] = {}
    for k in range(args.rounds):
        for name in seconds:
            took, started = start_jobs(name == "LeanTorchTrainer", args.jobs, out / f"{name}-{k}")
            seconds[name].append(took)
            actors.setdefault(name, set()).update(started)
            print(f"round {k + 1} {name}: {took:.1f} s", flush=True)
    ray.shutdown()
    ours, theirs = (statistics.median(seconds[n]) for n in ("LeanTorchTrainer", "TorchTrainer"))
    print(f"\n{args.jobs} one-worker jobs side by side, launch to the last loop, median of {args.rounds}:")
    print("| trainer | seconds | each round | actors started |")
    print("|---|---:|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{', '.join(sorted(actors[name]))} |")
    print(f"LeanTorchTrainer / TorchTrainer: {ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

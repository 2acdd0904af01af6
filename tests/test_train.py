"""Training for real (Ray Train + DeepSpeed ZeRO-2 on CPU, tiny model, the sample's shards): the loss
falls, restarts after a killed or hung worker continue exactly, a rerun after the driver died
resumes the same run, the export loads in transformers."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from conftest import ROOT, manifest
from pipelines.full import main
from train import records
from train.loader import TokenShards


def losses(path: Path) -> dict[int, float]:
    """Training loss per step from metrics.jsonl; a step logged twice (before and after a restart): the last."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


@pytest.fixture(scope="module")
def baseline(sample_run):
    """The sample pipeline's own training run (30 steps, checkpoints every 10), as it was first made."""
    _, _, wd = sample_run
    train = manifest(wd, "train")
    return wd.parent / "sample.yaml", wd, train, losses(Path(train["output"]) / "metrics.jsonl")


def test_loss_falls_and_the_curves_reach_mlflow(baseline):
    _, wd, train, curve = baseline
    assert sorted(curve) == list(range(1, 31))
    vocab = json.loads((Path(manifest(wd, "tokenize")["output"]) / "index.json").read_text())["vocab_size"]
    assert abs(curve[1] - math.log(vocab)) < 0.3  # starts at chance
    assert curve[30] < curve[1] - 0.7  # from chance (6.9) to about 6.0 in 30 tiny steps
    assert train["steps"] == 30 and train["final_loss"] == curve[30]
    run = MlflowClient(f"sqlite:///{wd}/mlflow.db").get_run(train["mlflow_run_id"])
    history = MlflowClient(f"sqlite:///{wd}/mlflow.db").get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 31))
    for key in ("lr", "grad_norm", "tokens_per_second", "activation_norm", "eval.bpb", "eval.bpb.pile", "eval.loss",
                "eval.bpb.pile.HackerNews", "steps"):
        assert key in run.data.metrics, key
    assert "mfu" not in run.data.metrics  # CPU: no MFU
    rows = [json.loads(line) for line in (Path(train["output"]) / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert lr[1] == pytest.approx(3e-3 / 5) and lr[5] == pytest.approx(3e-3) and lr[30] < lr[6] < 3e-3  # warmup, decay
    assert sorted(r["step"] for r in rows if "eval.bpb" in r) == [10, 20, 30]
    # The other seeds (train.seeds: 3): the same run with seeds 1 and 2 on the same workers, each exported for the
    # downstream stage; every seed's final evaluation on the stage's run, tagged with the seeds and the evaluation
    # set's fingerprint.
    assert run.data.tags["eval.seeds"] == "0,1,2"
    assert run.data.tags["eval.fingerprint"] == manifest(wd, "normalize")["eval"]["fingerprint"] == train["eval_fingerprint"]
    assert run.data.metrics["seed0/eval.bpb"] == run.data.metrics["eval.bpb"] == [r for r in rows if "eval.bpb" in r][-1]["eval.bpb"]
    other = [json.loads(line) for line in (Path(train["run_dir"]) / "seed-1" / "metrics.jsonl").read_text().splitlines()]
    other = [r for r in other if "eval.bpb" in r]
    assert [r["step"] for r in other] == [10, 20, 30] and (Path(train["output"]) / "seed-1" / "model" / "config.json").exists()
    assert run.data.metrics["seed1/eval.bpb"] == other[-1]["eval.bpb"] != run.data.metrics["eval.bpb"]
    assert abs(run.data.metrics["seed1/eval.bpb"] - run.data.metrics["eval.bpb"]) < 0.05 * run.data.metrics["eval.bpb"]
    # Each of the two ranks hashed the files it wrote: its ZeRO-2 optimizer shard and its RNG states.
    meta = json.loads((Path(train["run_dir"]) / "checkpoints" / "step-00000030" / "meta.json").read_text())
    owners = {name: owner for name, (_, _, owner) in meta["files"].items()}
    assert owners["rng-rank00001.pt"] == 1 and owners["rng-rank00000.pt"] == 0
    assert {owners[n] for n in owners if "zero_pp_rank_1_" in n} == {1} and {owners[n] for n in owners if "zero_pp_rank_0_" in n} == {0}
    assert set(owners.values()) == {0, 1}
    # Each rank trained with one malloc arena (train/stage.py WORKER_ENV) and the threads its CPUs give it.
    for rank in (0, 1):
        identity = json.loads(records.rank_file(train["run_dir"], rank).read_text())
        assert identity["malloc_arena_max"] == "1" and identity["threads"] >= 1, identity
    # Saves in the background, each measured; where the run's wall time went (train/goodput.py).
    saves = [r for r in rows if "checkpoint.write_seconds" in r]
    assert [r["step"] for r in saves] == [0, 10, 20, 30]  # the initial weights (a rollback target), every 10 steps
    assert all(r["checkpoint.blocked_seconds"] >= 0 for r in saves)
    parts = {k: v for k, v in run.data.metrics.items() if k.startswith("goodput.")}
    assert 0 < parts["goodput.ettr"] < 1 and parts["goodput.lost_seconds"] == 0 and parts["goodput.restart_seconds"] == 0
    assert parts["goodput.kept_seconds"] == pytest.approx(sum(r["seconds"] for r in rows if "loss" in r), abs=0.01)
    named = sum(v for k, v in parts.items() if k.endswith("_seconds") and k != "goodput.wall_seconds")
    assert named == pytest.approx(parts["goodput.wall_seconds"], abs=0.05)  # every second is somewhere
    assert parts["goodput.startup_build_seconds"] > 0 and parts["goodput.evaluation_seconds"] > 0
    assert parts["goodput.seed_runs_seconds"] > 0  # the second seed: wall time, not training the run keeps
    assert {"checkpoint.blocked_seconds", "checkpoint.write_seconds"} <= set(run.data.metrics)
    assert "## Goodput" in (Path(train["output"]) / "LOGBOOK.md").read_text()
    assert (Path(train["output"]) / "goodput.png").stat().st_size > 5_000


def test_export_loads_in_transformers_with_the_same_loss(baseline):
    from transformers import AutoTokenizer, OPTForCausalLM

    from model.hf import from_pretrained

    _, wd, train, _ = baseline
    export = Path(train["output"]) / "model"
    shards = TokenShards(manifest(wd, "tokenize")["output"])
    tokens = torch.from_numpy(shards.rows(np.arange(4)).astype(np.int64))
    ours = from_pretrained(export).eval()
    theirs = OPTForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        our_loss = ours(tokens[:, :-1], tokens[:, 1:]).item()
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()  # HF shifts the labels itself
    assert their_loss == pytest.approx(our_loss, rel=1e-5)
    assert our_loss < math.log(ours.config.vocab_size) - 0.5  # the trained weights, not an init
    assert AutoTokenizer.from_pretrained(export).eos_token_id == 2


def test_rerun_after_the_driver_died_goes_on_elastic_in_the_one_split_replica_its_ray_can_host(baseline, tmp_path):
    """The driver killed with its Ray after the first checkpoint; the same command again goes on with the same run (its
    folder, its MLflow run) from its newest checkpoint, now elastic (`train.elastic`), each replica split over 2
    workers (tensor 2) of 0.625 CPUs: layout keys, not part of the run's identity. The suite's Ray of 2 CPUs hosts 3
    such workers, which Ray Train's own policy would start (and the run fail); ours (train/ray_trainer.py `ReplicaScalingPolicy`) starts one
    whole replica of 2. The group waits for the missing node (1 s), then goes on with one replica, saying so
    (resizes.jsonl, the logbook, an incident, MLflow), and loads the checkpoint through DeepSpeed's universal format
    (ZeRO-2's optimizer partitions written by 2 unsplit ranks, cut for 2 tensor ranks). Gradient accumulation makes
    up the missing replica: the same global batches, and the run ends where the same seed's run that never changed
    did (the baseline's seed 1)."""
    cfg, wd, train0, _ = baseline
    args = ["--config", str(cfg), "--only", "train", "--set", "train.seed=1", "--set", "train.seeds=1"]
    runs_before = set(glob.glob(f"{wd}/train/runs/*"))
    attempts_before = set((wd / "train").glob(".attempt-*.json"))  # the README run's failing-stage test leaves one
    log = tmp_path / "first-attempt.log"  # its console, for the message if it ends on its own
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "pipelines" / "full.py"), *args], start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            new = set(glob.glob(f"{wd}/train/runs/*")) - runs_before
            if new and (Path(next(iter(new))) / "checkpoints" / "step-00000010").is_dir():
                break
            assert proc.poll() is None, ("the first attempt ended before its first checkpoint:\n"
                                         + log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint within 240 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
        proc.wait()
    run_dir = Path(next(iter(new)))
    (attempt_file,) = set((wd / "train").glob(".attempt-*.json")) - attempts_before
    attempt = json.loads(attempt_file.read_text())
    # the suite's Ray has 2 CPUs (conftest.py): room for 3 workers of 0.625, one replica of 2. (Not 0.6: Ray reserves
    # 3 x 0.6 = 1.7999999999999998 CPUs, which holds 2 such workers by its own count.)
    elastic = ["train.num_workers=4", "train.parallel.tensor=2", "train.cpus_per_worker=0.625", "train.elastic.enabled=true",
               "train.elastic.replacement_wait_seconds=1"]
    assert main(args + [a for kv in elastic for a in ("--set", kv)]) == 0
    train = manifest(wd, "train")
    assert train["mlflow_run_id"] == attempt["mlflow_run_id"] and train["steps"] == 30
    assert train["run_dir"] == str(run_dir)
    incidents = [json.loads(line)["what"] for line in (run_dir / "incidents.jsonl").read_text().splitlines()]
    resumed = [w for w in incidents if w.startswith("resumed from step-")]
    assert len(resumed) == 1 and int(resumed[0][-8:]) >= 10
    changed = [w for w in incidents if w.startswith("layout changed: ")]
    assert len(changed) == 1 and changed[0].startswith(f"layout changed: 2 data-parallel replicas under ZeRO-2 wrote "
                                                       f"{resumed[0][-13:]}, 1 of a model split over 2 tensor ranks under ZeRO-2 go on from it"), changed
    same_seed = losses(Path(train0["run_dir"]) / "seed-1" / "metrics.jsonl")  # the baseline's seed 1, never changed
    # Each step's loss within 1% of it (the dropout masks after the change are the one rank's own: measured 1e-4 apart).
    assert losses(run_dir / "metrics.jsonl") == pytest.approx(same_seed, rel=0.01)
    assert not attempt_file.exists()  # finished: the next change starts a new run
    (resize,) = [json.loads(line) for line in (run_dir / "resizes.jsonl").read_text().splitlines()]
    assert (resize["step"], resize["from"], resize["to"]) == (int(resumed[0][-8:]), 2, 1)
    assert "hosts 1 of the 2 replicas" in resize["why"] and "replacement_wait_seconds (1 s)" in resize["why"]
    assert any(w.startswith(f"resized from 2 to 1 of 2 data-parallel replicas at step {resize['step']}: 4 micro-batches")
               for w in incidents)
    mlflow_run = MlflowClient(f"sqlite:///{wd}/mlflow.db").get_run(train["mlflow_run_id"])
    assert mlflow_run.data.tags["resumes"] == "1" and mlflow_run.data.tags["resize.1"].startswith(
        f"step {resize['step']}: 2 -> 1 replicas: the cluster hosts 1 of the 2")
    assert mlflow_run.data.metrics["resizes"] == 1 and mlflow_run.data.metrics["interventions"] == 0  # the cluster's doing
    assert mlflow_run.data.metrics["goodput.replacement_wait_seconds"] >= 1.0
    assert 0 < mlflow_run.data.metrics["goodput.kept_reduced_seconds"] <= mlflow_run.data.metrics["goodput.kept_seconds"]


def test_too_little_data_for_one_batch_fails_before_any_worker_starts(baseline, capsys):
    cfg, wd, _, _ = baseline
    assert main(["--config", str(cfg), "--only", "train", "--set", "train.global_batch_tokens=4096000"]) == 1
    err = capsys.readouterr().err
    assert "stage 'train' failed" in err and "fewer than one global batch of 64000" in err


def lr_at(step: int) -> float:
    """The sample config's schedule: peak 3e-3, 5 warmup steps, decay to 10% at 100000 / 1024 = 97 steps."""
    from train.schedule import Schedule

    return Schedule(3e-3, 5, 97, 0.1).lr(step)


def test_autopilot_rolls_back_skips_escalates_and_survives_a_kill_during_recovery(baseline, capsys):
    cfg, wd, _, curve = baseline
    capsys.readouterr()
    faults = ("train.inject=[{kind: spike, step: 14, factor: 300}, {kind: kill, step: 17}, {kind: spike, step: 24, factor: 300}, "
              "{kind: spike, step: 34, factor: 300}, {kind: slow, step: 1, rank: 1, factor: 4}]")
    assert main(["--config", str(cfg), "--only", "train", "--set", faults, "--set", "train.max_steps=40", "--set", "train.seeds=1",
                 "--set", "train.stragglers.window=4",
                 "--set", "train.health.enabled=true", "--set", "train.health.failures=1",
                 "--set", "train.health.collective=false",
                 "--set", "train.autopilot.warmup=5", "--set", "train.autopilot.window=10",
                 "--set", "train.autopilot.grad_ratio=100",  # loss spikes only: 10 steps of history is little
                 "--set", "train.autopilot.rollback_steps=0"]) == 0
    train = manifest(wd, "train")
    out = Path(train["output"])
    logged = [json.loads(line) for line in (out / "logbook.jsonl").read_text().splitlines()]
    book = [e for e in logged if e["kind"] != "straggler"]
    # Rank 1, its compute four times as long every step, is named after two windows of 4 steps in a row
    # (step 8, or 12 when the first window's warm-up hides it), once per attempt: again after the kill's restart
    # from step 10. Its node is named; the MLflow run is tagged with it.
    stragglers = [json.loads(line) for line in (out / "stragglers.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in stragglers] == [1, 1] and all(r["node"] for r in stragglers)
    assert stragglers[0]["step"] in (8, 12) and 12 <= stragglers[1]["step"] <= 20
    assert [e["step"] for e in logged if e["kind"] == "straggler"] == [r["step"] for r in stragglers]
    # The LR spike at step 14 shows in step 15's loss. One entry per spike, none lost or repeated across the
    # kill at step 17 (while recovering from the first: the run is back at step 10 then).
    assert [(e["step"], e["kind"], e["actions"]) for e in book] == [
        (15, "loss_spike", ["rollback", "skip"]), (25, "loss_spike", ["rollback", "skip", "lower_lr"]),
        (35, "loss_spike", ["rollback", "skip", "lower_lr", "lower_clip"])]
    assert [e["rolled_back_to"] for e in book] == [10, 20, 30]
    assert [(e["lr_factor"], e["clip"]) for e in book] == [(1.0, None), (0.5, None), (0.25, 0.3)]
    lr = {r["step"]: r["lr"] for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    assert lr[40] == pytest.approx(0.25 * lr_at(40), rel=1e-6)  # the schedule continues, lowered twice
    # From the checkpoint's batch (10) to the incident's (14) + 1 + skip_margin (10).
    assert book[0]["skipped_batches"] == [10, 25]
    incidents = [json.loads(line)["what"] for line in (out / "incidents.jsonl").read_text().splitlines()]
    assert "injected kill on rank 1" in incidents and "resumed from step-00000010" in incidents
    from train.failures import history

    # The kill: rank 1's process died at step 17 without an exception. Rank 0's barrier broke because of it: a
    # secondary failure, when Ray Train hears of it before it tears the group down (a race, so it may be absent).
    failed = history(Path(train["run_dir"]))
    assert [(f.attempt, f.rank, f.kind, f.step) for f in failed if f.primary] == [(1, 1, "hardware", 17)]
    assert all(f.node for f in failed) and all(not f.primary for f in failed if f.rank == 0)
    # The kill implicated this node (health.failures=1): probed before the first start, and again at the restart
    # once the failed group was torn down: every worker of attempt 1, rank 0 included, had ended before the probe
    # began. (Probed where Ray Train reports the failure, rank 0 would still hold the node.)
    import ray

    probes = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    assert [(p["node"], p["failed"], p["drained"]) for p in probes] == [(failed[0].node, None, False)] * 2
    workers = [a for a in ray._private.state.actors().values() if a["ActorClassName"] == "RayTrainWorker"]
    first = [a for a in workers if probes[0]["time"] < a["StartTime"] / 1e3 < failed[0].time]  # attempt 1's
    assert len(first) == 2 and all(a["EndTime"] for a in first)
    assert probes[1]["began"] > max(a["EndTime"] for a in first) / 1e3 > failed[0].time
    # A person at the terminal saw each intervention and the restart as they happened (train/follow.py).
    err = capsys.readouterr().err
    for e in book:
        assert f"[train] step {e['step']}: autopilot: loss_spike: {', '.join(e['actions'])} (back to step " \
               f"{e['rolled_back_to']})" in err, err
    assert "[train] step 17: injected kill on rank 1" in err and "resumed from step-00000010" in err
    assert train["interventions"] == [{k: e[k] for k in ("step", "kind", "actions")} for e in book]
    assert train["steps"] == 40 and train["final_loss"] < curve[1] - 0.5  # recovered: it still learned
    assert "LOGBOOK.md" in os.listdir(out) and (out / "training.png").stat().st_size > 10_000
    client = MlflowClient(f"sqlite:///{wd}/mlflow.db")
    tags = client.get_run(train["mlflow_run_id"]).data.tags
    assert tags["straggler.rank1"].startswith(f"step {stragglers[-1]['step']}: ")
    assert client.get_run(train["mlflow_run_id"]).data.metrics["stragglers"] == 2
    assert tags["autopilot.interventions"] == "3" and tags["autopilot.2"] == "step 25: loss_spike -> rollback, skip, lower_lr"
    assert {a.path for a in client.list_artifacts(train["mlflow_run_id"])} >= {"training.png", "LOGBOOK.md", "logbook.jsonl"}


def test_a_hung_start_up_ends_its_worker_with_the_reason(tmp_path):
    """The watchdog runs from the worker's first line: a start-up (model build, DeepSpeed's initialize, the
    checkpoint load) that outlasts train.startup_seconds ends the process, saying so, for Ray Train to restart;
    once started, each step has hang_seconds."""
    script = """
import sys, time
from train.loop.faults import Watchdog
said = []
def on_hang(step, stalled, started, waiting):
    print(f"hang step={step} started={started} stalled>={stalled >= float(sys.argv[1])} waiting={waiting}", flush=True)
dog = Watchdog(float(sys.argv[1]), on_hang)
if sys.argv[2] == "step":
    dog.beat(0, 0.4)  # start-up done; steps get 0.4 s
time.sleep(30)
"""
    for mode, expected in (("startup", "hang step=0 started=False stalled>=True waiting=False"),
                           ("step", "hang step=0 started=True")):
        proc = subprocess.run([sys.executable, "-c", script, "0.4", mode], capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert proc.returncode == 3 and proc.stdout.startswith(expected), (mode, proc.stdout, proc.stderr)


def test_the_same_error_in_start_up_on_two_attempts_in_a_row_stops_the_run_with_its_traceback(baseline, capsys):
    """A bug raises at the same place every time: Ray Train would restart it forever (max_failures: -1).
    Two failed attempts with the same exception in start-up (step 0: after the model is built, before the
    checkpoint load) stop the run, saying where and why, on the console and in the logbook. The same at a
    later step: tests/test_loop_parts.py."""
    cfg, wd, _, _ = baseline
    capsys.readouterr()
    step = 0
    assert main(["--config", str(cfg), "--only", "train", "--set", f"train.inject=[{{kind: error, step: {step}, rank: 0}}]",
                 "--set", "train.num_workers=1", "--set", "train.max_steps=6", "--set", "train.checkpoint_every=2",
                 "--set", "train.seeds=1"]) == 1
    err = capsys.readouterr().err
    at = "in start-up" if step == 0 else f"at step {step} (step)"
    assert f"the same error {at} on attempts 1 and 2, rank 0" in err, err
    assert f"RuntimeError: injected error at step {step} (drill.py:" in err and "Traceback (most recent call last)" in err
    run_dir = max((wd / "train" / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    from train.failures import history

    failed = [(f.attempt, f.rank, f.kind, f.step, f.phase, f.type) for f in history(run_dir) if f.rank == 0]
    assert failed == [(a, 0, "software", step or None, "step" if step else "start-up", "RuntimeError") for a in (1, 2)]
    assert all(f.node and f.host for f in history(run_dir))
    book = [json.loads(line) for line in (run_dir / "logbook.jsonl").read_text().splitlines()]
    assert book[-1]["kind"] == "repeated-error" and "injected error" in book[-1]["detail"]


def test_restarts_from_the_same_checkpoint_stop_after_the_limit_within_one_launch(tmp_path):
    """Every attempt's start goes into the run's ledger with the checkpoint it resumes from, and the one give-up
    decision reads it: the (limit + 1)-th restart in a row from one checkpoint stops the run; a new checkpoint
    starts the count again, and so does a relaunch (its starts and failures are counted from its own launch)."""
    from train import records
    from train.loop.context import Context
    from train.loop.faults import start_attempt

    ctx = Context(rank=0, world=1, run_dir=tmp_path, device=torch.device("cpu"))

    def start(launched_at=0.0, limit=2, checkpoint=None, last_step=100):
        if checkpoint is not None:
            (ctx.ckpt_dir / f"step-{checkpoint:08d}").mkdir(parents=True)
        stop = start_attempt(ctx, launched_at, limit, last_step)
        return None if stop is None else (stop.rule, stop.step, stop.detail)

    assert start() is None  # the first start
    assert start(checkpoint=10) is None  # progress: a new checkpoint since
    assert start() is None and start() is None  # two restarts without progress
    rule, step, why = start()  # three in a row from step 10: a fault that always comes back
    assert (rule, step) == ("stalled-restarts", 10)
    assert why.startswith("3 restarts in a row from step 10 without reaching another checkpoint")
    assert "train.max_stalled_restarts=2" in why
    assert start(last_step=10) is None  # the run is done: restarts of the job are for its further seeds' runs
    assert start(launched_at=time.time()) is None  # relaunched (a fix, say): its own count
    (ctx.ckpt_dir / "step-not-a-step").mkdir()  # a folder planted among the checkpoints is not a step
    assert start(checkpoint=20) is None and start(limit=0) is None and start(limit=0) is None
    ledger = records.read(tmp_path, records.START, records.FAILURE)
    assert [r["resumes"] for r in ledger] == [0, 10, 10, 10, 10, 10, 10, 20, 20, 20]


def test_one_ledger_holds_starts_and_failures_and_reads_an_older_failures_file(tmp_path):
    """The repeated-error rule reads the same ledger: two attempts that fail alike in start-up stop the run
    at the next start. A run folder of an earlier version (failures.jsonl, no `record`) reads as failures. Restarts
    the run planned itself do not count towards max_stalled_restarts."""
    from train import records
    from train.failures import Failure, give_up, history

    bug = dict(rank=0, kind="software", type="RuntimeError", message="boom", where="x.py:1 in f")
    (tmp_path / records.FORMERLY[records.ATTEMPTS]).write_text(
        json.dumps(dataclasses.asdict(Failure(attempt=1, **bug))) + "\n")
    records.append(tmp_path, records.START, {"resumes": 0, "time": time.time()})
    records.append(tmp_path, records.FAILURE, dataclasses.asdict(Failure(attempt=2, **bug)))
    assert [f.attempt for f in history(tmp_path)] == [1, 2]
    ledger = records.read(tmp_path, records.START, records.FAILURE)
    assert [r["record"] for r in ledger] == ["failure", "start", "failure"]
    stop = give_up(ledger + [{"record": "start", "resumes": 0, "time": time.time()}], max_stalled_restarts=3)
    assert stop.rule == "repeated-error" and "the same error in start-up on attempts 1 and 2" in stop.detail
    assert give_up(ledger[:2], max_stalled_restarts=3) is None  # one failed attempt: try again
    # planned ends (a straggler's node left, an elastic group grown or restarted whole) are no stalled restarts
    planned = dict(rank=0, kind="planned", type="PlannedRestart", message="grow", where="x.py:2 in g", step=10)
    ledger = [{"record": "start", "resumes": 10, "time": 1.0}]
    for attempt in range(1, 6):
        ledger += [{"record": "failure", **dataclasses.asdict(Failure(attempt=attempt, **planned))},
                   {"record": "start", "resumes": 10, "time": 1.0 + attempt}]
    assert give_up(ledger, max_stalled_restarts=2) is None
    crash = dict(planned, kind="hardware", type="ActorDiedError", message="died")
    for attempt in range(6, 9):
        ledger += [{"record": "failure", **dataclasses.asdict(Failure(attempt=attempt, **crash))},
                   {"record": "start", "resumes": 10, "time": 1.0 + attempt}]
    assert give_up(ledger, max_stalled_restarts=2).rule == "stalled-restarts"  # 3 unplanned from step 10


def test_split_layouts_train_as_one_worker_through_a_spike_a_hang_and_a_kill_and_export_the_unsplit_model(baseline):
    """train.parallel tensor=2 (2 workers) and tensor=2 x pipeline=2 (4 workers, one data-parallel rank, 4
    micro-batches per step through the 1F1B schedule) against 1 worker, the same global batches and no dropout
    (a pipeline stage would draw other masks than the whole model): the same loss at every step, through an
    injected LR spike at step 6 that the autopilot sees at step 7, rolls back to step 4 and skips, and a worker
    hung at step 10 (under tensor, ended by its watchdog) or killed there (under tensor x pipeline), all then
    resumed from step 8's checkpoint; the split runs' exports gather every shard and stage into a model that
    transformers loads with the one-worker run's logits. (Resuming with dropout on, its RNG states restored
    exactly: benchmarks/gpu_check.py's check 3, whose dry run is in tests/test_gpu_path.py.)
    Last in this module: it moves the train stage's current output, which the tests above read."""
    from transformers import OPTForCausalLM

    cfg, wd, _, _ = baseline
    common = ["train.seeds=1", "train.max_steps=12", "train.checkpoint_every=4", "train.zero_stage=1", "train.dropout=0.0",
              "train.inject=[{kind: spike, step: 6, factor: 300}]", "train.autopilot.warmup=3",
              "train.autopilot.window=10", "train.autopilot.grad_ratio=100", "train.autopilot.rollback_steps=0"]
    layouts = {"one": ["train.num_workers=1"],
               "tensor": ["train.num_workers=2", "train.parallel.tensor=2", "train.hang_seconds=4",
                          "train.inject=[{kind: spike, step: 6, factor: 300}, {kind: hang, step: 10, rank: 0}]"],
               "tensor x pipeline": ["train.num_workers=4", "train.parallel.tensor=2", "train.parallel.pipeline=2",
                                     "train.inject=[{kind: spike, step: 6, factor: 300}, {kind: kill, step: 10}]"]}
    curves, exports = {}, {}
    for name, settings in layouts.items():
        args = ["--config", str(cfg), "--only", "train"]
        assert main(args + [x for s in common + settings for x in ("--set", s)]) == 0
        train = manifest(wd, "train")
        out = Path(train["output"])
        curves[name], exports[name] = losses(out / "metrics.jsonl"), out / "model"
        loop = json.loads((out / "loop_config.json").read_text())
        assert loop["accumulation"] == 4 and loop["train"]["parallel"]["pipeline"] == (2 if name == "tensor x pipeline" else 1)
        book = [json.loads(line) for line in (out / "logbook.jsonl").read_text().splitlines()]
        assert [(e["step"], e["kind"], e["actions"], e["rolled_back_to"], e["skipped_batches"]) for e in book] == [
            (7, "loss_spike", ["rollback", "skip"], 4, [4, 17])], name
        incidents = [json.loads(line)["what"] for line in (out / "incidents.jsonl").read_text().splitlines()]
        resumed = [w for w in incidents if w.startswith("resumed")]
        if name == "tensor":  # rank 0 hung at step 10; its watchdog ended it, and all resumed from step 8
            assert "injected hang on rank 0" in incidents, incidents
            assert any(w.startswith("step 10 has run") and "ending this worker" in w for w in incidents), incidents
            assert resumed == ["resumed from step-00000008"], incidents
        if name == "tensor x pipeline":  # rank 3 (the last stage's) killed at step 10, all resumed from step 8
            assert "injected kill on rank 3" in incidents and resumed == ["resumed from step-00000008"], incidents
    assert sorted(curves["one"]) == list(range(1, 13)) and curves["one"][12] < curves["one"][1] - 0.3
    for name in ("tensor", "tensor x pipeline"):
        assert sorted(curves[name]) == list(range(1, 13))
        for step, loss in curves["one"].items():
            assert curves[name][step] == pytest.approx(loss, rel=1e-5), (name, step)
    tokens = torch.from_numpy(TokenShards(manifest(wd, "tokenize")["output"]).rows(np.arange(4)).astype(np.int64))
    with torch.no_grad():
        logits = {n: OPTForCausalLM.from_pretrained(exports[n]).eval()(tokens).logits for n in layouts}
    # Adam turns the layouts' other summation orders (losses within 1e-7 here) into weights about 1e-4 apart
    # after 12 steps: measured 1.2e-3 at most on logits of magnitude up to 1.9, 1.8e-4 relative RMS. A shard or
    # stage gathered wrong is off by the logits' own size; the exact gather is test_parallel.py's.
    for name in ("tensor", "tensor x pipeline"):
        diff = (logits[name] - logits["one"]).abs().max().item()
        assert diff < 5e-3 and torch.equal(logits[name].argmax(-1), logits["one"].argmax(-1)), (name, diff)

"""The training loop's parts, each on its own, in this process (rank 0 of 1 of a gloo group, DeepSpeed for
real, no Ray): the typed config, the feed, the step, the checkpointer, the autopilot's actions, metrics,
faults; then `Trainer.fit()` putting them together through an injected spike. The loop under Ray Train,
with restarts, hangs and split layouts: tests/test_train.py."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import pickle
import re
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.config import AutopilotConfig, ElasticConfig, InjectConfig, StragglerConfig, TrainConfig
from corpus.tokenize import FORMAT, INDEX, write_rows
from train.loader import Loader
from train.loop.checkpointer import Checkpointer
from train.loop.config import loop_config
from train.loop.context import Context
from train.loop.engine import build_engine
from train.loop.drill import Drill, Effects
from train.loop.elastic import hostable
from train.loop.metrics import Metrics
from train.loop.pilot import Pilot
from train.loop.step import Feed, StepResult, TrainStep, gradient_norm
from train.schedule import Schedule

SEQ = 16


# The evaluation set of `shards`: (source, subset, its documents' token ids, each ending with </s> (2), their bytes).
EVAL_UNITS = [("news", "", [[7, 8, 9, 2], [10, 2]], 9),
              ("web", "forum", [list(range(20, 40)) + [2], list(range(100, 130)) + [2]], 170),
              ("web", "wiki", [[300, 301, 2]], 6)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """64 training sequences of SEQ + 1 random tokens under the tiny model's vocabulary, and EVAL_UNITS as windows."""
    from corpus import evalset

    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    write_rows(folder / "train" / "00000.arrow", rng.integers(4, 512, (64, SEQ + 1), dtype=np.uint16))
    units = []
    for k, (source, subset, docs, n_bytes) in enumerate(EVAL_UNITS):
        windows = evalset.windows(docs, 2, 1, SEQ + 1).astype(np.uint16)
        write_rows(folder / "eval" / f"{k:05d}.arrow", windows)
        units.append({"source": source, "subset": subset, "documents": len(docs), "bytes": n_bytes,
                      "tokens": sum(len(d) - 1 for d in docs), "sequences": len(windows),  # scored: not </s>
                      "shards": [{"file": f"eval/{k:05d}.arrow", "sequences": len(windows)}]})
    index = {"format": FORMAT, "seq_len": SEQ, "block": SEQ + 1, "dtype": "uint16", "vocab_size": 512, "eos_id": 2,
             "pad_id": 1, "sequences": 64, "train": {"sequences": 64, "shards": [{"file": "train/00000.arrow", "sequences": 64}]},
             "eval": {"fingerprint": "0123456789abcdef", "units": units}}
    (folder / INDEX).write_text(json.dumps(index))
    return folder


def section(**changes) -> TrainConfig:
    """A one-worker tiny-model run: 4 sequences a step in micro-batches of 2, no dropout."""
    autopilot = AutopilotConfig(warmup=3, window=10, rollback_steps=0, grad_ratio=100)
    return dataclasses.replace(TrainConfig(
        model="tiny", num_workers=1, zero_stage=1, micro_batch_size=2, global_batch_tokens=4 * SEQ,
        warmup_tokens=2 * 4 * SEQ, total_tokens=100 * 4 * SEQ, max_steps=6, checkpoint_every=0, eval_every=3,
        dropout=0.0, autopilot=autopilot), **changes)


def context(tmp_path, rank: int = 0) -> Context:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Context(rank=rank, world=1, run_dir=tmp_path, device=torch.device("cpu"))


def test_the_loop_config_is_typed_derived_from_the_shards_and_travels(shards, tmp_path):
    cfg = loop_config(section(global_batch_tokens=8 * SEQ), shards, tmp_path, export_dir=None)
    assert (cfg.seq_len, cfg.global_batch, cfg.accumulation, cfg.last_step, cfg.total_steps) == (SEQ, 8, 4, 6, 50)
    assert cfg.warmup_steps == 1 and cfg.peak_lr == 1e-3 and cfg.eval_micro_batch == 8  # the tiny model's LR; 4 x micro
    assert cfg.architecture.vocab_size == 512 and cfg.architecture.dropout == 0.0
    # 6 of the schedule's 50 steps: the rate still high at the end, which a person is told (a run of all 50 is not)
    assert cfg.cut_short().startswith("max_steps 6 stops the run at 91% of its peak learning rate, which decays over 50")
    assert dataclasses.replace(cfg, last_step=50).cut_short() is None
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what Ray Train ships to the workers
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.last_step = 7
    cfg.write(tmp_path / "loop_config.json")
    written = json.loads((tmp_path / "loop_config.json").read_text())
    assert written["accumulation"] == 4 and written["train"]["parallel"]["pipeline"] == 1
    with pytest.raises(ValueError, match="does not split into micro-batches of 3 on 1 data-parallel ranks"):
        loop_config(section(micro_batch_size=3), shards, tmp_path, export_dir=None)
    with pytest.raises(ValueError, match="fewer than one global batch of 128"):
        loop_config(section(global_batch_tokens=128 * SEQ), shards, tmp_path, export_dir=None)
    # an elastic run on 4 replicas short of some: 4 micro-batches of 2 on 2 or 1 of them, or 2, 1, 1 on 3 (padded to 2)
    elastic = loop_config(dataclasses.replace(section(global_batch_tokens=8 * SEQ, num_workers=4),
                                              elastic=ElasticConfig(enabled=True)), shards, tmp_path, export_dir=None)
    assert [elastic.accumulation_at(d) for d in (4, 3, 2, 1)] == [1, 2, 2, 4] and elastic.accumulation == 1


def test_the_driver_imports_no_torch_and_a_worker_imports_deepspeed_without_mlflow():
    """What each process imports, in one fresh process. The pipeline's driver: its stages (pipelines/stages.py) and
    a run's loop config (the train stage's, screen's proxies') import neither torch nor Ray Train, 1.6 s of a
    corpus-only run's start (`--only dedup`). A process that starts a Ray Train job (a stage's driver, the screen's
    tasks) imports Ray Train but not torch, which the trainer leaves to the workers (train/ray_trainer.py; its
    controller's: tests/test_screen.py). Then as a Ray Train worker starts (train/deepspeed_import.py): the loop's
    module, unpickled first, and what `train_loop` imports before its first call import neither DeepSpeed nor
    MLflow; `import_deepspeed` (`train_loop`'s first call) imports DeepSpeed, whose autotuner then has no MLflow
    (0.6 s of each worker's start in a Ray worker), and its Muon optimizer's kernels stay eager (torch.compile off
    for that import: no inductor, 0.8 s of each ZeRO worker's start), while a later torch.compile compiles; and MLflow
    still imports afterwards."""
    import subprocess
    import sys

    from conftest import ROOT

    heavy = "('torch', 'ray.train', 'deepspeed', 'mlflow')"
    code = ("import os, sys, json\n"
            "import pipelines.stages, train.loop.config\n"
            f"seen = {{'driver': sorted(m for m in {heavy} if m in sys.modules)}}\n"
            "from ray.train import ScalingConfig\n"
            "import train.stage\n"
            "from train.loop import train_loop\n"
            "from train.ray_trainer import LeanTorchTrainer\n"
            "LeanTorchTrainer(train_loop, timeout_s=60, scaling_config=ScalingConfig(num_workers=1))._get_train_func()\n"
            "seen['starting a job'] = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)\n"
            "import train.loop, train.loop.context, train.loop.faults, train.loop.trainer\n"
            "seen['after train.loop'] = sorted(m for m in ('deepspeed', 'mlflow') if m in sys.modules)\n"
            "from train.deepspeed_import import import_deepspeed\n"
            "import_deepspeed()\n"
            "from deepspeed.autotuning import autotuner\n"
            "seen['after import_deepspeed'] = sorted(m for m in ('deepspeed', 'mlflow') if m in sys.modules)\n"
            "seen['has_mlflow'] = autotuner.has_mlflow\n"
            "from deepspeed.runtime.zero.muon import original_muon\n"
            "seen['muon compiled'] = hasattr(original_muon.muon_update, '_torchdynamo_orig_callable')\n"
            "seen['dynamo off'] = 'TORCHDYNAMO_DISABLE' in os.environ\n"
            "import torch\n"
            "from torch._dynamo.utils import counters\n"
            "torch.compile(lambda x: x * 2, backend='eager')(torch.ones(2))\n"
            "seen['compiled after'] = counters['stats']['unique_graphs']\n"
            "import mlflow\n"
            "seen['mlflow'] = hasattr(mlflow, 'MlflowClient')\n"
            "print(json.dumps(seen))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {"driver": [], "starting a job": [], "after train.loop": [],
                                                "after import_deepspeed": ["deepspeed"], "has_mlflow": False,
                                                "muon compiled": False, "dynamo off": False, "compiled after": 1,
                                                "mlflow": True}


def test_an_elastic_run_counts_the_workers_the_reserved_resources_hold_as_ray_train_does(shards, tmp_path, monkeypatch,
                                                                                            caplog):
    """Each node by itself: half a GPU here and half there is no worker; a resource a worker does not need, none:
    as Ray Train's own elastic policy counts, and for a split model in whole replicas, as its policy then does
    (train/ray_trainer.py `ReplicaScalingPolicy`). A short run of 4 replicas on 2 asks Ray's coordinator; when it
    cannot say, the run trains on at its size."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    from train.loop import elastic
    from train.ray_trainer import ReplicaScalingPolicy

    reserved = {"a": {"CPU": 8.0, "GPU": 8.0}, "b": {"CPU": 8.0, "GPU": 3.5}, "c": {"CPU": 2.0, "GPU": 8.0}, "d": {"CPU": 8.0}}
    assert hostable(reserved, 1.0, 1.0) == 8 + 3 + 2 + 0
    assert hostable(reserved, 0.5, 0.0) == 16 + 16 + 4 + 16
    for cpus, gpus in ((1.0, 1.0), (0.5, 0.0)):
        ray_scaling = ScalingConfig(num_workers=(2, 64), use_gpu=gpus > 0,
                                    resources_per_worker={"CPU": cpus, **({"GPU": gpus} if gpus else {})})
        assert ElasticScalingPolicy(ray_scaling)._count_possible_workers(reserved) == hostable(reserved, cpus, gpus)
        assert ReplicaScalingPolicy(ray_scaling, 4)._count_possible_workers(reserved) == hostable(reserved, cpus, gpus) // 4 * 4
    cfg = loop_config(dataclasses.replace(section(num_workers=4, global_batch_tokens=8 * SEQ, cpus_per_worker=1.0),
                                          elastic=ElasticConfig(enabled=True)), shards, tmp_path, export_dir=None)
    short = elastic.Elastic(cfg, Context(rank=0, world=2, run_dir=tmp_path, device=torch.device("cpu")))
    monkeypatch.setattr(elastic, "reserved", lambda: {"a": {"CPU": 3.0}, "b": {"CPU": 0.5}})
    assert short.short and short.room() == 3
    monkeypatch.setattr(elastic, "reserved", lambda: reserved)
    assert short.room() == 4  # at most the configured replicas

    def unreachable():
        raise TimeoutError("the coordinator did not answer")

    monkeypatch.setattr(elastic, "reserved", unreachable)
    said = logging.Handler()
    said.emit = lambda record: seen.append(record.getMessage())
    seen: list[str] = []
    train_log = logging.getLogger("train")  # caplog's root handler may not see it: the suite sets loggers up on its way
    monkeypatch.setattr(train_log, "disabled", False)  # (a dictConfig of a library's disables the loggers it finds)
    train_log.addHandler(said)
    try:
        with caplog.at_level(logging.WARNING, logger="train"):
            assert short.room() == 2
    finally:
        train_log.removeHandler(said)
    assert any("did not say what it reserves (TimeoutError" in m for m in seen), seen


def test_the_feed_gives_micro_batches_in_order_and_restarts_from_the_loaders_state(shards, tmp_path):
    loader = Loader(shards, 4, seed=0)
    feed = Feed(loader, context(tmp_path), micro_batch=2, accumulation=2)
    g, micro = feed.next()
    tokens = torch.from_numpy(loader.batch(g).astype(np.int64))
    assert g == 0 and [tuple(i.shape) + tuple(t.shape) for i, t in micro] == [(2, SEQ, 2, SEQ)] * 2
    assert torch.equal(torch.cat([i for i, _ in micro]), tokens[:, :-1])
    assert torch.equal(torch.cat([t for _, t in micro]), tokens[:, 1:])
    state = loader.state_dict()
    second = feed.next()
    feed.next()
    loader.load_state_dict(state)  # what a rollback does, then the feed follows the loader
    feed.restart()
    again = feed.next()
    assert again[0] == second[0] == 1 and all(torch.equal(a, b) for x, y in zip(again[1], second[1]) for a, b in zip(x, y))


def _uneven_steps(rank: int, world: int, shards: str, root: str) -> dict[int, tuple[list[tuple[float, float]], dict]]:
    """3 steps of an elastic run of 4 replicas on `world` data-parallel ranks, under ZeRO-2 and then ZeRO-0 (whose
    gradient averaging is DeepSpeed's, skipped on one rank alone: train/loop/engine.py `skip_lone_averaging`):
    for each stage, each step's loss and gradient norm, and the final weights."""
    from pathlib import Path

    out = {}
    for zero in (2, 0):
        cfg = loop_config(section(num_workers=4, zero_stage=zero, global_batch_tokens=8 * SEQ), shards,
                          Path(root) / f"zero{zero}", export_dir=None)
        ctx = Context(rank=rank, world=world, run_dir=Path(root) / f"zero{zero}", device=torch.device("cpu"))
        built = build_engine(cfg, ctx, spans_nodes=False)
        assert built.engine.enable_backward_allreduce == (zero > 0 or world > 1)
        loader = Loader(shards, cfg.global_batch, rank=rank, world_size=world, seed=0, micro_batch=2)
        step = TrainStep(built.engine, built.model, Feed(loader, ctx, 2, cfg.accumulation_at(world)), ctx,
                         built.own_grad_norm)
        losses = [(r.loss, r.grad_norm) for r in (step(lr=1e-3) for _ in range(3))]
        out[zero] = losses, {n: p.detach().clone() for n, p in built.model.named_parameters()}
        built.engine.destroy()
    return out


def test_replicas_that_do_not_divide_the_batch_pad_and_train_as_the_whole_run_does(deepspeed_rank, shards, tmp_path):
    """An elastic run short of replicas (train/loop/step.py `Feed`): the global batch's 4 micro-batches on 3 ranks
    under ZeRO-2 are 2, 1 and 1, and the last two ranks each run a padding micro-batch whose gradient counts for
    nothing, so that every rank runs 2 backward passes. Each step's loss and gradient norm, and the weights after 3
    steps, are those of one rank running all 4 (measured 1.6e-6 apart at most, 3e-7 on 2 ranks; with the padding
    counted, 6e-3; without the real micro-batches' weight of 3 x 2 / 4, the gradient norm is 2/3 of its own).
    The same under ZeRO-0, where the rank alone skips DeepSpeed's averaging and the three must not."""
    from test_parallel import run_ranks

    alone = {}
    ranks = run_ranks(3, _uneven_steps, str(shards), str(tmp_path / "three"),
                      meanwhile=lambda: alone.update(_uneven_steps(0, 1, str(shards), str(tmp_path / "one"))))
    for zero in (2, 0):
        for rank in ranks:
            (losses, weights), (alone_losses, alone_weights) = rank[zero], alone[zero]
            assert [x for pair in losses for x in pair] == pytest.approx([x for pair in alone_losses for x in pair],
                                                                         rel=1e-5), zero
            for name, w in alone_weights.items():
                assert torch.allclose(torch.as_tensor(weights[name]), w, atol=5e-6), (zero, name)


def _uneven_pipeline_steps(rank: int, world: int, shards: str, root: str) -> tuple[list[tuple[float, float]], dict]:
    """3 steps of an elastic run of 3 replicas of a 2-stage pipeline (ZeRO-1, 3 micro-batches) on `world` ranks:
    each step's loss and gradient norm, and this rank's stage's weights."""
    from pathlib import Path

    from train.config import ParallelConfig
    from train.loop.engine import groups_for

    cfg = loop_config(section(num_workers=6, zero_stage=1, global_batch_tokens=6 * SEQ, parallel=ParallelConfig(pipeline=2)),
                      shards, Path(root), export_dir=None)
    ctx = Context(rank=rank, world=world, run_dir=Path(root), device=torch.device("cpu"))
    ctx.groups = groups_for(cfg, ctx, rank, world)
    built = build_engine(cfg, ctx, spans_nodes=False)
    loader = Loader(shards, cfg.global_batch, rank=ctx.data_rank, world_size=ctx.data_world, seed=0, micro_batch=2)
    step = TrainStep(built.engine, built.model, Feed(loader, ctx, 2, cfg.accumulation_at(ctx.data_world)), ctx,
                     built.own_grad_norm)
    losses = [(r.loss, r.grad_norm) for r in (step(lr=1e-3) for _ in range(3))]
    weights = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    built.engine.destroy()
    return losses, weights


def test_a_pipeline_short_of_replicas_pads_and_trains_as_the_whole_run_does(shards, tmp_path):
    """The same for a pipeline (train/parallel/pipeline.py `Loss`): 3 micro-batches on 2 replicas of 2 stages are 2
    and 1, the second replica padding one, whose loss the last stage weighs by 0 in what the engine reports as in its
    gradient. Each step's loss and gradient norm, and every stage's weights after 3 steps, are those of one replica
    running all 3."""
    from test_parallel import run_ranks

    short = run_ranks(4, _uneven_pipeline_steps, str(shards), str(tmp_path / "two"))
    alone = run_ranks(2, _uneven_pipeline_steps, str(shards), str(tmp_path / "one"))
    reference = [x for pair in alone[0][0] for x in pair]
    for losses, _ in short + alone:
        assert [x for pair in losses for x in pair] == pytest.approx(reference, rel=1e-5)
    whole = {n: w for _, weights in alone for n, w in weights.items()}
    for _, weights in short:
        for name, w in weights.items():
            assert torch.allclose(torch.as_tensor(w), torch.as_tensor(whole[name]), atol=5e-6), name


def _layout_steps(rank: int, world: int, shards: str, root: str, zero: int, split: dict, steps: range,
                  load: str | None = None, save_at: int | None = None) -> tuple[dict[int, float], dict]:
    """`steps` of a 2-worker run whose model is split as `split` says (`{"tensor": 2}`, `{"pipeline": 2}` or `{}`,
    the rest data-parallel) under ZeRO-`zero`, the production parts, from checkpoint `load` if given, saving one at
    `save_at` into `root`: each step's loss, and the weights this rank holds (whole, or its pipeline stage's)."""
    from pathlib import Path

    from train import checkpoint_files
    from train.config import ParallelConfig
    from train.loop.engine import groups_for
    from train.parallel.groups import full_state_dict

    cfg = loop_config(section(num_workers=2, zero_stage=zero, global_batch_tokens=4 * SEQ, parallel=ParallelConfig(**split)),
                      shards, Path(root), export_dir=None)
    ctx = Context(rank=rank, world=world, run_dir=Path(root), device=torch.device("cpu"))
    ctx.groups = groups_for(cfg, ctx, rank, world)
    built = build_engine(cfg, ctx, spans_nodes=False)
    state = checkpoint_files.load(built.engine, Path(load))["loader"] if load else None
    loader = Loader(shards, cfg.global_batch, rank=ctx.data_rank, world_size=ctx.data_world, seed=0, micro_batch=2,
                    state=state)
    step = TrainStep(built.engine, built.model, Feed(loader, ctx, 2, cfg.accumulation_at(ctx.data_world)), ctx,
                     built.own_grad_norm)
    losses = {}
    for k in steps:
        losses[k] = step(lr=1e-3).loss
        if k == save_at:
            checkpoint_files.save(built.engine, Path(root), k, {"loader": loader.state_dict(), "health": {"healthy": True}})
    weights = full_state_dict(built.model, ctx.groups) if ctx.groups else \
        {n: p.detach().clone() for n, p in built.model.named_parameters()}
    built.engine.destroy()
    return losses, weights


def _split_phases(rank: int, world: int, shards: str, root: str, split: dict, zeros: tuple[int, ...]) -> dict:
    """The model split as `split` on 2 ranks, for each ZeRO stage of `zeros`: the unchanged run (steps 1-6, saving
    at step 2); then, once the other ranks have gone on with the model whole (`_whole_phase` writes `whole-done`),
    steps 5-6 from their checkpoint of step 4. DeepSpeed keeps the first layout's process groups for the process's
    life, so each layout has processes of its own, as a restart's workers do."""
    import time
    from pathlib import Path

    from train.checkpoint_files import step_name

    unchanged = {zero: _layout_steps(rank, world, shards, f"{root}/zero{zero}/unchanged", zero, split, range(1, 7),
                                     save_at=2) for zero in zeros}
    (Path(root) / f"split-done-{rank}").touch()
    deadline = time.monotonic() + 300
    while not (Path(root) / "whole-done").exists():
        assert time.monotonic() < deadline, "the whole model's phase did not finish"
        time.sleep(0.05)
    return {zero: (unchanged[zero], _layout_steps(rank, world, shards, f"{root}/zero{zero}/changed", zero, split,
                                                  range(5, 7), load=f"{root}/zero{zero}/changed/{step_name(4)}"))
            for zero in zeros}


def _whole_phase(rank: int, world: int, shards: str, root: str, zeros: tuple[int, ...]) -> dict:
    """The model whole (2 data-parallel replicas) for each ZeRO stage of `zeros`: steps 3-4 from the split run's
    checkpoint of step 2."""
    from train.checkpoint_files import step_name

    return {zero: _layout_steps(rank, world, shards, f"{root}/zero{zero}/changed", zero, {}, range(3, 5),
                                load=f"{root}/zero{zero}/unchanged/{step_name(2)}", save_at=4)[0] for zero in zeros}


@pytest.mark.parametrize("split, zeros", [({"tensor": 2}, (1, 2)), ({"pipeline": 2}, (1,))], ids=["tensor", "pipeline"])
def test_a_checkpoint_loads_into_another_tensor_or_pipeline_degree(shards, tmp_path, split, zeros):
    """Tensor 2 -> 1 -> 2 under ZeRO 1 and 2 (train/checkpoint_files.py `universal_info`, `reshaped`), and pipeline
    2 -> 1 -> 2 under ZeRO-1 (a pipeline's parameters renamed for the whole model and back, `universal`): a
    checkpoint of the split model goes on in 2 whole data-parallel replicas, whose checkpoint goes on split again.
    Every step's loss, and the weights at the end (each pipeline stage's, its tied embedding included), are the
    unchanged run's."""
    from test_parallel import run_ranks

    from train import checkpoint_files

    whole = {}

    def go_on_whole():
        while not all((tmp_path / f"split-done-{rank}").exists() for rank in (0, 1)):
            time.sleep(0.05)
        whole.update(run_ranks(2, _whole_phase, str(shards), str(tmp_path), zeros)[0])
        (tmp_path / "whole-done").touch()

    ranks = run_ranks(2, _split_phases, str(shards), str(tmp_path), split, zeros, meanwhile=go_on_whole)
    degrees = {"tensor": split.get("tensor", 1), "pipeline": split.get("pipeline", 1)}
    for zero in zeros:
        for run, step, layout in (("unchanged", 2, degrees), ("changed", 4, {"tensor": 1, "pipeline": 1})):
            meta = checkpoint_files.read_meta(tmp_path / f"zero{zero}" / run / checkpoint_files.step_name(step))
            assert meta["layout"] == {"data_parallel": 2 // (layout["tensor"] * layout["pipeline"]), "zero_stage": zero,
                                      **layout}
        assert not list((tmp_path / f"zero{zero}").glob("*/.universal-*"))  # converted, loaded, removed
        for rank in ranks:
            (reference, weights), (again, final) = rank[zero]
            losses = {**whole[zero], **again}
            assert losses == pytest.approx({s: reference[s] for s in losses}, rel=1e-5), zero
            assert weights.keys() == final.keys()
            for name, w in weights.items():
                assert torch.allclose(torch.as_tensor(final[name]), torch.as_tensor(w), atol=1e-6), (zero, name)
    if "pipeline" in split:  # each stage's own names, and its tied embedding on both, are the whole model's
        from model.configs import CONFIGS
        from train.parallel.pipeline import opt_name, pipeline_name, whole_names

        stages = [set(rank[zeros[0]][0][1]) for rank in ranks]
        assert stages[0] & stages[1] == {"tied_modules.embed.tokens.weight"}
        n_layer = CONFIGS["tiny"].n_layer
        assert sorted(opt_name(n, n_layer) for n in stages[0] | stages[1]) == sorted(whole_names(CONFIGS["tiny"]))
        assert all(pipeline_name(opt_name(n, n_layer), n_layer) == n for n in stages[0] | stages[1])


@pytest.fixture(scope="module")
def engines(deepspeed_rank, shards, tmp_path_factory):
    """The same tiny model under ZeRO-0 (the loop measures the grad norm itself) and ZeRO-1 (DeepSpeed does)."""
    made = {}
    for zero in (0, 1):
        cfg = loop_config(section(zero_stage=zero), shards, tmp_path_factory.mktemp(f"zero{zero}"), export_dir=None)
        made[zero] = cfg, build_engine(cfg, context(tmp_path_factory.mktemp(f"ctx{zero}")), spans_nodes=False)
    yield made
    for _, built in made.values():
        built.engine.destroy()


def test_a_step_trains_the_next_batch_and_measures_loss_and_norms_alike_under_zero_0_and_1(engines, shards, tmp_path):
    assert [engines[z][1].own_grad_norm for z in (0, 1)] == [True, False]
    results = {}
    for zero, (cfg, built) in engines.items():
        loader = Loader(shards, cfg.global_batch, seed=0)
        step = TrainStep(built.engine, built.model, Feed(loader, context(tmp_path), 2, cfg.accumulation), context(tmp_path),
                         built.own_grad_norm)
        tokens = torch.from_numpy(loader.batch(0).astype(np.int64))
        with torch.no_grad():  # the loss the step should report: its batch's, before the update
            expected = built.model(tokens[:, :-1], tokens[:, 1:]).item()
        before = [p.detach().clone() for p in built.model.parameters()]
        results[zero] = step(lr=1e-3)
        assert results[zero].batch == 0 and results[zero].lr == 1e-3 and not results[zero].overflow
        assert results[zero].loss == pytest.approx(expected, rel=1e-6) and results[zero].seconds > 0
        assert any(not torch.equal(a, b) for a, b in zip(before, built.model.parameters()))  # the optimizer stepped
    own, deepspeeds = results[0], results[1]
    assert own.grad_norm == pytest.approx(deepspeeds.grad_norm, rel=1e-4) and own.grad_norm > 0
    assert own.activation_norm == pytest.approx(deepspeeds.activation_norm, rel=1e-6)
    assert gradient_norm(torch.nn.Linear(2, 2)) == 0.0  # no gradients yet


def train_once(engine, seed: int) -> None:
    ids = torch.randint(4, 512, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()


def test_the_checkpointer_saves_prunes_rolls_back_and_resumes(engines, tmp_path):
    cfg, built = engines[1]
    ctx = context(tmp_path)
    ckpt = Checkpointer(built.engine, ctx, every=2, keep=1, keep_healthy=1, last_step=5)
    assert [s for s in range(1, 6) if ckpt.due(s)] == [2, 4, 5]
    assert not Checkpointer(built.engine, ctx, every=0, keep=1, keep_healthy=1, last_step=5).due(5)
    weights = {}
    for step, healthy in ((0, True), (2, True), (4, False)):
        train_once(built.engine, step)  # a different model at each save
        weights[step] = [p.detach().clone() for p in built.model.parameters()]
        ckpt.save(step, {"loader": {"epoch": 0, "step": step}, "health": {"healthy": healthy}})
    assert ckpt.healthy_before(4)["step"] == 2
    assert ckpt.healthy_before(2) is None  # step 0 was pruned: the newest one and the newest healthy one are kept
    meta = ckpt.roll_back(2, time.time())
    assert meta["step"] == 2 and all(torch.equal(a, b) for a, b in zip(weights[2], built.model.parameters()))
    names = sorted(p.name for p in ctx.ckpt_dir.iterdir())
    assert len(names) == 2 and re.fullmatch(r"abandoned-step-00000004-\d+", names[0]) and names[1] == "step-00000002"
    train_once(built.engine, 9)
    assert Checkpointer(built.engine, ctx, every=2, keep=1, keep_healthy=1, last_step=5).resume()["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(weights[2], built.model.parameters()))
    assert "resumed from step-00000002" in (tmp_path / "incidents.jsonl").read_text()


def test_a_wait_for_the_previous_write_is_counted_once_in_the_blocked_seconds(engines, tmp_path, monkeypatch):
    """Background saves back to back, each write slowed by 0.3 s: the blocked seconds the saves report add up
    to the time the training thread spent in them (the wait for a write in flush, once, as that save's)."""
    from train import checkpoint_files

    write = checkpoint_files.Write.run
    monkeypatch.setattr(checkpoint_files.Write, "run", lambda self: (time.sleep(0.3), write(self)))
    cfg, built = engines[1]
    blocked = []
    ckpt = Checkpointer(built.engine, context(tmp_path), every=1, keep=5, keep_healthy=5, last_step=3, background=True,
                        on_written=lambda step, seconds, written: blocked.append(seconds))
    waited = 0.0
    for step in (1, 2, 3):
        began = time.monotonic()
        ckpt.save(step, {"loader": {"epoch": 0, "step": step}, "health": {"healthy": True}})
        waited += time.monotonic() - began
    began = time.monotonic()
    ckpt.flush()
    waited += time.monotonic() - began
    assert len(blocked) == 3 and sum(blocked) > 0.6  # three writes of 0.3 s waited for
    assert sum(blocked) == pytest.approx(waited, abs=0.05)


def test_the_pilot_rolls_back_and_skips_on_a_spike_writing_it_down_first_and_stops_past_its_budget(engines, shards,
                                                                                                     tmp_path):
    cfg, built = engines[1]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, autopilot=dataclasses.replace(
        cfg.train.autopilot, budget=1)))
    ctx = context(tmp_path)
    ckpt = Checkpointer(built.engine, ctx, every=2, keep=3, keep_healthy=3, last_step=10)
    pilot = Pilot(cfg, ctx, built.engine, Schedule(cfg.peak_lr, 1, 100, 0.1), ckpt, scaler=None)
    pilot.resume(None)
    loader = Loader(shards, cfg.global_batch, seed=0)

    def result(step: int, loss: float) -> StepResult:
        return StepResult(batch=step - 1, lr=1e-3, loss=loss, grad_norm=1.0, activation_norm=1.0, overflow=False,
                          seconds=0.1)

    ckpt.save(0, {"loader": loader.state_dict(), "health": {"healthy": True}})
    for step in range(1, 7):
        assert pilot.observe(step, result(step, 6.0 - 0.01 * step)) is None
        if step == 4:
            assert pilot.healthy(4)  # four clean steps of four
            ckpt.save(4, {"loader": {"epoch": 0, "step": 4}, "health": {"healthy": True}})
    assert pilot.after_step(False) == 1.0  # fp32: no loss scale
    decision = pilot.observe(7, result(7, 60.0))
    assert decision.actions == ("rollback", "skip") and not pilot.healthy(7)
    meta = pilot.intervene(decision, batch=6, loader=loader)
    assert meta["step"] == 4 and loader.position == 4 and loader.skip_ranges == [(4, 17)]  # to the incident + margin
    book = [json.loads(line) for line in (tmp_path / "logbook.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"], e["actions"], e["rolled_back_to"], e["skipped_batches"]) for e in book] == [
        (7, "loss_spike", ["rollback", "skip"], 4, [4, 17])]
    assert json.loads((tmp_path / "autopilot.json").read_text())["rolled_back_to"] == 4
    assert "autopilot: loss_spike: rollback, skip (back to step 4)" in (tmp_path / "incidents.jsonl").read_text()
    for step in range(5, 9):
        pilot.observe(step, result(step, 6.0))
    again = pilot.observe(9, result(9, 60.0))
    assert again.stop and "budget of 1 interventions is spent" in pilot.stop(9, again)
    assert json.loads((tmp_path / "logbook.jsonl").read_text().splitlines()[-1])["actions"] == ["stop"]


def test_metrics_are_rank_0s_a_line_per_step_validation_and_a_summary(shards, tmp_path):
    cfg = loop_config(section(), shards, tmp_path, export_dir=None)
    step = StepResult(batch=3, lr=2e-4, loss=5.5, grad_norm=None, activation_norm=2.0, overflow=True, seconds=0.5)
    for rank, folder in ((0, tmp_path / "leader"), (1, tmp_path / "other")):
        metrics = Metrics(cfg, context(folder, rank), flops_per_step=1e12)
        metrics.step(4, step, loss_scale=2.0, skipped_steps=1)
        metrics.evaluation(4, {"eval.bpb": 1.25, "eval.bpb.web": 1.5}, seconds=1.5)
        metrics.close(4, 5.5, None)
    rows = [json.loads(line) for line in (tmp_path / "leader" / "metrics.jsonl").read_text().splitlines()]
    assert all(time.time() - row.pop("time") < 60 for row in rows)
    assert rows[0] == {"record": "step", "step": 4, "loss": 5.5, "lr": 2e-4, "grad_norm": None, "loss_scale": 2.0, "overflow": 1,
                       "skipped_steps": 1, "activation_norm": 2.0, "tokens_per_second": 4 * SEQ / 0.5, "batch": 3, "seconds": 0.5,
                       "tflops_per_device": 2.0}
    assert rows[1] == {"record": "evaluation", "step": 4, "eval.bpb": 1.25, "eval.bpb.web": 1.5, "eval_seconds": 1.5}
    assert json.loads((tmp_path / "leader" / "summary.json").read_text()) == {"steps": 4, "final_loss": 5.5,
                                                                             "stopped": None}
    assert list((tmp_path / "other").iterdir()) == []


def test_bits_per_byte_is_the_hand_computed_sum_over_every_token_of_every_document_but_its_eos(shards, tmp_path):
    """The evaluation (windows in micro-batches of 2, padded) against the model's log-likelihood of each unit's
    stream computed by hand, a forward per stretch of SEQ + 1 tokens that starts where the last one ended, summed
    over the targets that are not </s> (each </s> is context only), in bits over the units' bytes, per source,
    subset and all."""
    from corpus import evalset
    from model.configs import get
    from model.opt import OPT
    from train.loop.evaluation import unit_nll

    model = OPT(get("tiny").replace(vocab_size=512, dropout=0.0), seed=3)
    got = evalset.metrics(json.loads((shards / INDEX).read_text())["eval"]["units"],
                          unit_nll(model, str(shards), len(EVAL_UNITS), 2, 1, 2, context(tmp_path)))
    nats = {}
    with torch.no_grad():
        for source, subset, docs, _ in EVAL_UNITS:
            stream = torch.tensor([2] + [t for d in docs for t in d])
            total = 0.0
            for start in range(0, len(stream) - 1, SEQ):
                piece = stream[start:start + SEQ + 1][None]
                logp = torch.log_softmax(model(piece[:, :-1]), dim=-1)
                nll = -logp[0, torch.arange(piece.size(1) - 1), piece[0, 1:]]
                total += nll[piece[0, 1:] != 2].sum().item()  # the closing </s>s: not scored
            nats[source, subset] = total
    assert len(torch.tensor([2] + [t for d in EVAL_UNITS[1][2] for t in d])) > 3 * SEQ + 1  # 4 windows, the last padded
    bits = {k: v / np.log(2) for k, v in nats.items()}
    news, forum, wiki = ("news", ""), ("web", "forum"), ("web", "wiki")
    assert got["eval.bpb.news"] == pytest.approx(bits[news] / 9, rel=1e-5)
    assert got["eval.bpb.web.forum"] == pytest.approx(bits[forum] / 170, rel=1e-5)
    assert got["eval.bpb.web.wiki"] == pytest.approx(bits[wiki] / 6, rel=1e-5)
    assert got["eval.bpb.web"] == pytest.approx((bits[forum] + bits[wiki]) / 176, rel=1e-5)
    assert got["eval.bpb"] == pytest.approx(sum(bits.values()) / 185, rel=1e-5)
    assert got["eval.loss.news"] == pytest.approx(nats[news] / 4, rel=1e-5)  # per token scored: 3 + 1, no </s>
    assert set(got) == {f"eval.{m}{r}" for m in ("bpb", "loss") for r in ("", ".news", ".web", ".web.forum", ".web.wiki")}


def test_evaluation_windows_score_every_token_once_and_no_eos():
    from corpus import evalset

    docs = [[5, 6, 7, 2], [8, 2], list(range(10, 30)) + [2]]
    rows = evalset.windows(docs, eos=2, pad=1, block=8)
    assert rows.shape == (4, 8) and (rows[1:, 0] == rows[:-1, -1]).all()  # 28 tokens: 27 predicted, 7 a window
    targets = evalset.targets(rows, pad=1, eos=2)
    scored = targets[targets != evalset.IGNORE]
    assert scored.tolist() == [t for d in docs for t in d[:-1]]  # each document token once, in order; no </s>
    assert (rows[:, 1:] == 2).sum() == 3  # the closing </s>s are still there, as context
    assert rows[-1, -1] == 1 and rows[0, 0] == 2
    same = evalset.targets(evalset.windows(docs, eos=2, pad=2, block=8), pad=2, eos=2)  # <pad> and </s> one id
    assert same[same != evalset.IGNORE].tolist() == scored.tolist()


# A hand-built evaluation set: (source, subset, its documents' texts, their token ids, each ending with </s> (2)).
HAND_UNITS = [("news", "", ["héllo", "wörld!"], [[10, 20, 2], [30, 2]]),
              ("web", "forum", ["€"], [[40, 2]]),
              ("web", "wiki", ["ab", "c", "d"], [[50, 60, 2], [70, 2], [80, 2]])]


class FixedLoss:
    """A model whose loss for a target t is t / 10 nats, whatever the context, and 100 nats for </s>: were a </s>
    scored, every number below would be far off. Called as the engine is: (inputs, targets) -> the mean loss over
    the targets scored."""

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, x, y):
        from corpus import evalset

        y = y.reshape(-1)
        y = y[y != evalset.IGNORE].double()
        return torch.where(y == 2, torch.full_like(y, 100.0), y / 10).mean()


def hand_units(folder) -> list[dict]:
    """HAND_UNITS as the tokenize stage writes them (windows of 4 tokens, index.json's units), into `folder`."""
    from corpus import evalset

    units = []
    for k, (source, subset, texts, docs) in enumerate(HAND_UNITS):
        windows = evalset.windows(docs, 2, 1, 4)
        write_rows(folder / "eval" / f"{k:05d}.arrow", windows.astype(np.uint16))
        units.append({"source": source, "subset": subset, "documents": len(docs),
                      "bytes": sum(len(t.encode()) for t in texts),
                      "tokens": int((evalset.targets(windows, 1, 2) != evalset.IGNORE).sum()),
                      "sequences": len(windows), "shards": [{"file": f"eval/{k:05d}.arrow", "sequences": len(windows)}]})
    (folder / INDEX).write_text(json.dumps({"format": FORMAT, "block": 4, "dtype": "uint16", "eos_id": 2, "pad_id": 1,
                                            "eval": {"units": units}}))
    return units


def test_bits_per_byte_leaves_out_each_documents_eos_as_computed_by_hand(tmp_path):
    """Bits per byte and the loss per token of a hand-built set under a fixed loss per token: the nats of the
    documents' own tokens (not their </s>) over their UTF-8 bytes; and the rows' sizes, which add up."""
    from corpus import evalset
    from train.loop.evaluation import unit_nll

    units = hand_units(tmp_path)
    assert [u["sequences"] for u in units] == [2, 1, 3]  # [2 10 20 2] [2 30 2 <pad>]; [2 40 2 <pad>]; ...
    got = evalset.metrics(units, unit_nll(FixedLoss(), str(tmp_path), 3, 2, 1, 2, context(tmp_path)))
    # By hand: news 1 + 2 + 3 nats over 6 + 7 bytes ("é", "ö": 2 bytes each), 3 tokens; forum 4 nats over 3 bytes
    # ("€"), 1 token; wiki 5 + 6 + 7 + 8 nats over 4 bytes, 4 tokens.
    assert [len(t.encode()) for _, _, texts, _ in HAND_UNITS for t in texts] == [6, 7, 3, 2, 1, 1]
    ln2 = np.log(2)
    expected = {"eval.bpb.news": 6 / ln2 / 13, "eval.bpb.web.forum": 4 / ln2 / 3, "eval.bpb.web.wiki": 26 / ln2 / 4,
                "eval.bpb.web": 30 / ln2 / 7, "eval.bpb": 36 / ln2 / 20,
                "eval.loss.news": 2.0, "eval.loss.web.forum": 4.0, "eval.loss.web.wiki": 6.5, "eval.loss.web": 6.0,
                "eval.loss": 4.5}
    assert got == pytest.approx(expected, rel=1e-12)
    sizes = evalset.sizes(units)
    assert sizes == {f"eval.size.{k}{r}": v for r, counts in [("", (6, 20, 8)), (".news", (2, 13, 3)), (".web", (4, 7, 5)),
                                                              (".web.forum", (1, 3, 1)), (".web.wiki", (3, 4, 4))]
                     for k, v in zip(("documents", "bytes", "tokens"), counts)}
    for key in ("documents", "bytes", "tokens"):  # subsets sum to their source, sources to the whole set
        assert sizes[f"eval.size.{key}.web"] == sizes[f"eval.size.{key}.web.forum"] + sizes[f"eval.size.{key}.web.wiki"]
        assert sizes[f"eval.size.{key}"] == sizes[f"eval.size.{key}.news"] + sizes[f"eval.size.{key}.web"]


def test_the_train_stage_reports_the_sets_sizes_once_and_each_seeds_evaluation(tmp_path):
    from types import SimpleNamespace

    from corpus import evalset
    from train.stage import track_seeds

    units = hand_units(tmp_path)
    folders = {0: tmp_path / "seed-0", 1: tmp_path / "seed-1"}
    for seed, folder in folders.items():
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 3, "eval.bpb": 1.5 + seed, "eval.loss": 2.0}) + "\n")
    out, tags = track_seeds(SimpleNamespace(seed=0), {"eval": {"units": units, "fingerprint": "f"}, "data_fingerprint": "d"},
                            folders)
    assert out == {**evalset.sizes(units), "eval.bpb": 1.5, "eval.loss": 2.0, "seed0/eval.bpb": 1.5,
                   "seed0/eval.loss": 2.0, "seed1/eval.bpb": 2.5, "seed1/eval.loss": 2.0}
    assert out["eval.size.tokens.web.wiki"] == 4 and tags == {"eval.seeds": "0,1", "eval.fingerprint": "f", "data.fingerprint": "d"}


def test_injected_faults_fire_once_even_across_restarts(tmp_path):
    inject = [InjectConfig("spike", 2, factor=5.0), InjectConfig("nan", 3), InjectConfig("overflow", 4, count=2)]
    faults = Drill(inject, context(tmp_path), hang_seconds=1.0, startup_seconds=1.0)
    effects = [faults.before_step(s) for s in range(1, 8)]
    assert [e.lr_factor for e in effects] == [1, 5, 1, 1, 1, 1, 1]
    assert [e.overflow for e in effects] == [False, False, False, True, True, False, False]
    assert effects[1].poison == 1.0 and np.isnan(effects[2].poison) and effects[3].poison == 1e38
    restarted = Drill(inject, context(tmp_path), hang_seconds=1.0, startup_seconds=1.0)  # a restart replays steps 2-4
    assert all(restarted.before_step(s) == Effects() for s in range(1, 8))  # nothing fires twice
    assert faults.loss_scaler("bf16") is not None and faults.loss_scaler("fp16") is None  # fp16: DeepSpeed's own
    assert Drill(inject[:2], context(tmp_path), hang_seconds=1.0, startup_seconds=1.0).loss_scaler("bf16") is None
    said = [json.loads(line)["what"] for line in (tmp_path / "incidents.jsonl").read_text().splitlines()]
    assert said == ["injected spike (LR x 5)", "injected nan", "injected overflow (2 steps)"]


def test_a_trainer_fits_through_a_spike_rolled_back_and_skipped(deepspeed_rank, shards, tmp_path):
    """The parts together, as a worker runs them (without Ray Train, so without its checkpoint reports):
    a spike at step 4 seen at step 5, rolled back to the initial weights and skipped, then 6 steps."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from train.loop.trainer import Trainer

    train = section(inject=[InjectConfig("spike", 4, factor=300.0)], collective_timeout_seconds=4321.0)
    cfg = loop_config(train, shards, tmp_path, export_dir=None)
    before = distributed_c10d.default_pg_timeout
    try:
        trainer = Trainer(cfg, context(tmp_path), local_rank=0, local_world=1)
        # every process group made from start-up on waits the configured time (tests/test_parallel.py: DeepSpeed's)
        assert distributed_c10d._get_default_timeout("gloo") == timedelta(seconds=4321)
        done = trainer.fit()
        trainer.engine.destroy()
    finally:
        distributed_c10d.default_pg_timeout = before
    assert done.step == 6 and done.stopped is None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6]
    assert [r["batch"] for r in rows if "loss" in r][5:] == [15, 16, 17, 18, 19, 20]  # [0, 15) skipped
    assert [r["step"] for r in rows if "eval.bpb" in r] == [3, 3, 6] and "eval.bpb.web.forum" in rows[-1]
    # The initial weights' save (the first rollback target), written in the background, measured when published.
    saves = [r for r in rows if "checkpoint.write_seconds" in r]
    assert [r["step"] for r in saves] == [0] and saves[0]["checkpoint.blocked_seconds"] >= 0
    book = [json.loads(line) for line in (tmp_path / "logbook.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"], e["rolled_back_to"], e["skipped_batches"]) for e in book] == [
        (5, "loss_spike", 0, [0, 15])]  # step 5 trained batch 4: skipped up to it and 10 more
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 6, "final_loss": rows[-2]["loss"],
                                                                  "stopped": None}


class HostReads(TorchDispatchMode):
    """Counts the training loop's reads of tensor values to the host (each one waits for the device to finish):
    `aten._local_scalar_dense`, what `.item()`, `float()`, `int()` and `bool()` of a tensor dispatch to; `tolist()`,
    which copies without dispatching it; and DeepSpeed's device synchronizations (its timers').

    Only the thread that enters it counts, and Python's cyclic collector is off inside it (after a collection on
    entry): `tolist` and `synchronize` are patched for the whole process, and an earlier test's DeepSpeed engine
    collected mid-run synchronizes in its `__del__` (engine.destroy -> the ZeRO optimizer's destroy), which once
    counted as a second read in a step. Each read keeps its caller, for the message when a count is off."""

    def __init__(self, monkeypatch):
        super().__init__()
        from deepspeed.accelerator import get_accelerator

        self.count, self.callers, self.thread, self.collecting = 0, [], None, False
        tolist, accelerator = torch.Tensor.tolist, get_accelerator()
        synchronize = accelerator.synchronize
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (self.read(), tolist(t))[1])
        monkeypatch.setattr(accelerator, "synchronize", lambda *a, **k: (self.read(), synchronize(*a, **k))[1])

    def __enter__(self):
        gc.collect()
        self.thread, self.collecting = threading.get_ident(), gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc):
        if self.collecting:
            gc.enable()
        self.thread = None
        return super().__exit__(*exc)

    def read(self) -> None:
        if threading.get_ident() == self.thread:
            self.count += 1
            self.callers.append((self.count, "".join(traceback.format_stack(limit=6)[:-2])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.read()
        return func(*args, **(kwargs or {}))

    def between(self, before: int, upto: int) -> str:
        """Who made the reads after the `before`-th, up to the `upto`-th: a failure's message."""
        return "\n".join(f"read {n}:\n{stack}" for n, stack in self.callers if before < n <= upto)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_zero_0_step_reads_the_device_once_and_skips_a_non_finite_update_on_it(deepspeed_rank, shards, tmp_path,
                                                                                 monkeypatch, precision):
    """ZeRO-0 (one GPU's layout, DeepSpeed wrapping no optimizer of its own; bf16 as torch's autocast over fp32
    weights): each step of fit() reads the device once, the loss, activation and grad norms together (DeepSpeed's
    timers and torch's unfused AdamW read it 41 times a step here before, DeepSpeed's bf16 wrapper 42); a nan in
    the gradients (injected at step 4) is kept from the weights on the device, and counted as a skipped update."""
    from train.loop.trainer import Trainer

    train = section(zero_stage=0, precision=precision, max_steps=8, eval_every=0, inject=[InjectConfig("nan", 4)],
                    autopilot=AutopilotConfig(enabled=False))
    cfg = loop_config(train, shards, tmp_path, export_dir=None)
    trainer = Trainer(cfg, context(tmp_path), local_rank=0, local_world=1)
    reads, per_step, computed = HostReads(monkeypatch), [], set()
    linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, inputs, output: computed.add(output.dtype))
    log_step = trainer.metrics.step
    monkeypatch.setattr(trainer.metrics, "step", lambda *a: (per_step.append(reads.count), log_step(*a)))
    with reads:
        trainer.fit()
    trainer.engine.destroy()
    counts = np.diff([0, *per_step]).tolist()
    off = next((step for step, n in enumerate(counts, 1) if n != 1), None)
    assert counts == [1] * 8, f"step {off}'s reads:\n" + reads.between(*[0, *per_step][off - 1:off + 1]) if off else ""
    weights = {p.dtype for p in trainer.model.parameters()}
    assert weights == {torch.float32} and computed == {{"fp32": torch.float32, "bf16": torch.bfloat16}[precision]}
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [(r["overflow"], r["skipped_steps"], r["grad_norm"] is None) for r in rows] == (
        [(0, 0, False)] * 3 + [(1, 1, True)] + [(0, 1, False)] * 4)
    assert all(np.isfinite(r["loss"]) and (r["grad_norm"] is None or r["grad_norm"] > 0) for r in rows)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert int(trainer.engine.optimizer.state[next(iter(trainer.model.parameters()))]["step"]) == 7  # 8 steps, 1 skipped


def test_compiled_blocks_train_as_the_eager_model_does(deepspeed_rank, shards, tmp_path):
    """`train.compile: true` (each block through torch.compile's inductor, fullgraph): the same loss and gradients
    as the eager model within float tolerance (a fused kernel sums in another order), and under ZeRO-1, the cluster
    configs' stage, the same loss at every step of a run (gap_attrib's dry run compiles under ZeRO-0 and bf16
    autocast), the parameters' names unchanged (checkpoints and the export read them). Weights after AdamW are not
    compared: Adam scales a gradient near zero to a whole step, whatever its rounding."""
    from model.configs import get
    from model.opt import OPT
    from train.loop.engine import compile_blocks
    from train.loop.trainer import Trainer

    ids = torch.randint(0, 512, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    grads, outputs = [], []
    for compiled in (False, True):
        model = OPT(get("tiny").replace(dropout=0.0), seed=0)
        if compiled:
            compile_blocks(model, torch.device("cpu"))
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        outputs.append(loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=0)
    assert grads[1].keys() == grads[0].keys()
    for name, g in grads[1].items():
        torch.testing.assert_close(g, grads[0][name], rtol=1e-4, atol=1e-6, msg=name)

    runs = {}
    for compiled in (False, True):
        folder = tmp_path / f"compile-{compiled}"
        train = section(max_steps=4, eval_every=0, compile=compiled, autopilot=AutopilotConfig(enabled=False))
        trainer = Trainer(loop_config(train, shards, folder, export_dir=None), context(folder), local_rank=0, local_world=1)
        trainer.fit()
        trainer.engine.destroy()
        blocks = [b._compiled_call_impl is not None for b in trainer.model.decoder.layers]  # what Module.compile sets
        losses = [r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        runs[compiled] = losses, list(trainer.model.state_dict()), blocks
    (eager, eager_names, _), (losses, names, blocks) = runs[False], runs[True]
    assert len(losses) == 4 and losses[-1] < losses[0] and losses == pytest.approx(eager, rel=1e-5)
    assert names == eager_names and runs[False][2] == [False, False] and blocks == [True, True]


def test_a_step_error_is_described_where_it_happened_and_two_alike_in_a_row_stop_the_run(deepspeed_rank, shards,
                                                                                         tmp_path):
    """What a worker attaches to an exception that leaves its loop (train/loop/__init__.py), and the policy on
    the records the controller makes of it: the same software error at the same step on two attempts in a
    row stops the run; a different step, or a hardware failure, does not. Start-up: tests/test_train.py."""
    from train.failures import Failure, describe_exception, failure_of, repeated_error
    from train.loop.trainer import Trainer

    cfg = loop_config(section(inject=[InjectConfig("error", 3, rank=0)]), shards, tmp_path, export_dir=None)
    trainer = Trainer(cfg, context(tmp_path), local_rank=0, local_world=1)
    with pytest.raises(RuntimeError, match="injected error at step 3") as raised:
        trainer.fit()
    trainer.engine.destroy()
    assert trainer.progress.where() == (3, "step")
    error = raised.value
    error.train_failure = describe_exception(error, *trainer.progress.where(), rank=0, node="n1")
    first, second = (failure_of(0, error, attempt, tmp_path) for attempt in (1, 2))
    assert (first.kind, first.step, first.phase, first.node) == ("software", 3, "step", "n1")
    assert first.where.startswith("drill.py:") and "raise RuntimeError" in first.traceback
    assert repeated_error([first]) is None
    why = repeated_error([first, second])
    assert why.startswith("the same error at step 3 (step) on attempts 1 and 2, rank 0") and first.traceback in why
    moved = dataclasses.replace(second, step=4)
    lost = Failure(attempt=2, rank=1, kind="hardware", type="ActorDiedError", message="died", step=3, phase="step")
    assert repeated_error([first, moved]) is None and repeated_error([first, lost]) is None
    assert repeated_error([first, moved, dataclasses.replace(second, attempt=3)]) is None  # not in a row


def test_a_rank_slower_than_the_others_median_in_windows_in_a_row_is_named_once_with_its_node(tmp_path, monkeypatch):
    """Rank 0's view of four ranks' compute: rank 2 is named after two slow windows in a row, with the node its
    identity file gives, once; a rank slow in one window only is not; two ranks' spread within the margin
    is not. (The medians come from an all_gather over the ranks; here, the values it would return.)"""
    from train import failures
    from train.loop import stragglers as module

    windows = iter([[0.10, 0.11, 0.30, 0.10], [0.10, 0.25, 0.31, 0.10], [0.10, 0.10, 0.29, 0.10]])
    monkeypatch.setattr(module, "all_gather_float", lambda value: next(windows))
    ctx = Context(rank=0, world=4, run_dir=tmp_path, device=torch.device("cpu"))
    failures.write_identity(tmp_path, 2, "node-b")
    watch = module.Stragglers(ctx, StragglerConfig(window=3, margin=0.5, patience=2))
    named = [watch.observe(step, 0.1) for step in range(1, 10)]
    assert named == [[], [], [], [], [], [2], [], [], []]  # rank 1 was slow in the second window only
    (row,) = [json.loads(line) for line in (tmp_path / "stragglers.jsonl").read_text().splitlines()]
    assert (row["rank"], row["step"], row["node"]) == (2, 6, "node-b") and row["others_seconds"] == pytest.approx(0.1)
    book = [json.loads(line) for line in (tmp_path / "logbook.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"]) for e in book] == [(6, "straggler")] and "rank 2 on" in book[0]["detail"]
    assert watch.slower([0.10, 0.14]) == [] and watch.slower([0.10, 0.16]) == [1] and watch.slower([0.2]) == []


def test_one_stalled_step_does_not_hide_a_straggler(tmp_path, monkeypatch):
    """Each rank gives the window's median of its steps: rank 0's one stall (a warm-up, a host's hiccup) on
    10 ms steps does not hide rank 1 at four times its speed. With the window's mean, rank 0's 0.2 s made it
    57.5 ms a step, over rank 1's 40 (CI at stop 53: the straggler named 8 steps late)."""
    from train.loop import stragglers as module

    gathered = []
    monkeypatch.setattr(module, "all_gather_float", lambda value: gathered.append(value) or [value, 0.040])
    watch = module.Stragglers(Context(rank=0, world=2, run_dir=tmp_path, device=torch.device("cpu")),
                              StragglerConfig(window=4, margin=0.5, patience=1))
    named = [watch.observe(step, seconds) for step, seconds in enumerate([0.010, 0.2, 0.011, 0.009], 1)]
    assert gathered == [pytest.approx(0.0105)] and named == [[], [], [], [1]]

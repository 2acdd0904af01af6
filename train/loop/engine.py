"""The DeepSpeed engine for the configured layout: one process holding the whole model (ZeRO 0-3, or
ZeRO-3 partitioned at build), a tensor-parallel split of it, or this rank's pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.build import build
from train.loop.config import LoopConfig
from train.loop.context import Context
from train.optim import adamw, deepspeed_config
from train.parallel import pipeline
from train.parallel.collectives import backend
from train.parallel.groups import Groups, ParallelDims, parallelize, tensor_group_problem
from train.plan.network import efa_problem


@dataclass
class Built:
    engine: object  # DeepSpeedEngine, or its PipelineEngine
    model: torch.nn.Module  # what the engine wraps: the OPT (whole, split or partitioned) or this rank's stage
    own_grad_norm: bool  # DeepSpeed reports the pre-clip grad norm from its ZeRO and mixed-precision optimizers only


def groups_for(cfg: LoopConfig, ctx: Context, local_rank: int, local_world: int) -> Groups | None:
    """The tensor x pipeline x data process groups, or None for a model that is not split. Refuses a tensor
    group that spans machines: every layer's all-reduces would cross the network."""
    tp, pp = cfg.train.parallel.tensor, cfg.train.parallel.pipeline
    if tp == 1 and pp == 1:
        return None
    dims = ParallelDims.for_world(ctx.world, tp=tp, pp=pp)
    split = tensor_group_problem(dims, ctx.rank, local_rank, local_world)
    if split is not None:
        raise RuntimeError(split)
    return Groups(dims, ctx.rank)


def build_engine(cfg: LoopConfig, ctx: Context, *, spans_nodes: bool) -> Built:
    """The model for this rank (`ctx.groups` set first) and DeepSpeed's engine around it. On NCCL, a run over
    several nodes that would not use EFA is refused here, once its communicator exists."""
    import deepspeed

    t = cfg.train
    if ctx.device.type == "cpu":  # DeepSpeed's shared-memory allreduce would be compiled with g++ on first use
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_config = deepspeed_config(micro_batch=t.micro_batch_size, accumulation=cfg.accumulation_at(ctx.data_world),
                                 world_size=ctx.data_world, zero_stage=t.zero_stage, precision=t.precision,
                                 grad_clip=t.grad_clip, pipeline=ctx.pipelined)
    if ctx.pipelined:  # only this stage's layers, each drawn from its own streams (the same weights as built whole)
        deepspeed.init_distributed(dist_backend=backend())  # PipelineModule asks DeepSpeed's comm for ranks
        model = pipeline.pipeline_module(cfg.architecture, ctx.groups, seed=t.seed,
                                         activation_checkpointing=cfg.architecture.activation_checkpointing)
    else:
        model = build(cfg.architecture, ds_config, seed=t.seed, rank=ctx.rank)
        if ctx.groups:  # built whole from the seed (ZeRO 0-2), then this rank's shard of it kept
            parallelize(model, ctx.groups)
    if t.compile:  # tensor and pipeline 1, ZeRO 0-2 (train/config.py check_engine)
        compile_blocks(model, ctx.device)
    engine, _, _, _ = deepspeed.initialize(  # a pipeline's engine takes its module's own process grid as mpu
        model=model, optimizer=adamw(model, cfg.peak_lr, t.weight_decay), config=ds_config,
        mpu=None if ctx.pipelined else ctx.groups)
    if backend() == "nccl":  # its communicator exists by now (DeepSpeed's initialize broadcast the weights)
        problem = efa_problem(spans_nodes=spans_nodes)
        if problem is not None:
            raise RuntimeError(problem)
    skip_lone_averaging(engine, t.zero_stage, ctx.data_world, ctx.pipelined)
    # ZeRO-0 (fp32, or bf16 as autocast; fp16 takes ZeRO 1-3): DeepSpeed wraps no optimizer of its own around ours
    return Built(engine, model, own_grad_norm=t.zero_stage == 0)


def compile_blocks(model: torch.nn.Module, device: torch.device) -> None:
    """`torch.compile` each of the OPT's blocks in place, as torchtitan compiles per block: one graph per block
    (fullgraph: a break would fail here, not run half-compiled), compiled once and reused by every block of the
    same shapes. The model's parameters and their names stay as they were (Module.compile wraps the forward
    only, where torch.compile(module) would rename every state_dict key), so checkpoints, the export and
    DeepSpeed see the same model. The embeddings and the loss stay eager: the loss is already one pass a block of
    rows at a time (model/loss.py). On CPU, torch's inductor writes C++: without a compiler, a clear error here
    rather than a traceback from the first step."""
    import os
    import shutil

    if device.type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c):
        raise RuntimeError("train.compile on CPU needs a C++ compiler (torch's inductor writes C++ kernels): install "
                           "g++, or set compile: false")
    for block in model.decoder.layers:
        block.compile(fullgraph=True)


def skip_lone_averaging(engine, zero_stage: int, data_world: int, pipelined: bool) -> None:
    """At ZeRO-0 with one data-parallel replica, DeepSpeed's gradient averaging is the identity, yet it copies every
    gradient into flat buckets, all-reduces them over a group of one and copies them back (engine.py
    `_backward_epilogue` and `step` -> `allreduce_gradients` -> `buffered_allreduce_fallback`): 3% of a 125M step
    on CPU. Both call sites skip it when `enable_backward_allreduce` is off, as DeepSpeed itself turns it off without
    a process group (engine.py `__init__`, `if self.dist_backend is None`). ZeRO 1-3 reduce in their own optimizers,
    and a tensor group's reductions are the model's own (train/parallel), not these."""
    if zero_stage == 0 and data_world == 1 and not pipelined:
        engine.enable_backward_allreduce = False

"""Pipeline parallelism: an OPT as DeepSpeed's PipelineModule, each stage building only its own layers.

The layers, in order (a stage holds a contiguous run of them; the blocks are balanced over the stages):

    Embedding        ids (B, T) -> token embeddings (B, T, d)      tied, first stage
    Positions        + the learned positions
    PipeBlock x n    (B, T, d) -> (B, T, d)
    FinalNorm        pre-LN models only
    Embedding.head   -> logits (B, T, V/T) of this rank's vocabulary rows   tied, last stage
    loss             the (vocabulary-parallel) cross-entropy, on the last stage

Every parameter is drawn from its own stream under its name in the whole model
(model.opt.generator_for), so whatever the layout the weights are those of `OPT(config, seed)`,
and no process builds more than its stage's layers, one at a time, each whole and then split over
the tensor group (a block of 175B is 7 GB of fp32 on the host while it is split).

The token embedding is tied to the output layer: the first and the last stage each hold a copy;
DeepSpeed broadcasts the first's at start, sums the two gradients every step
(PipelineModule.allreduce_tied_weight_gradients) and counts the copy once in the gradient norm
(`ds_pipe_replicated`). DeepSpeed's pipeline engine takes ZeRO 0-1 only (pipe/engine.py:
"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cache, partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.configs import OPTConfig
from model.hf import PREFIX, SHARD_BYTES, export_parts, file_names, shard_plan, write_metadata
from model.opt import OPT, POSITION_OFFSET, Block, Decoder, TokenEmbedding, init_seeded
from train.parallel.groups import Groups, check_split, split_block, split_embedding, unsplit


class Embedding(nn.Module):
    """The token embedding (vocabulary-split under tensor parallelism): forward on the first stage, `head`
    (the tied output layer) on the last, which also measures the final activations for the autopilot."""

    def __init__(self, config: OPTConfig, seed: int, groups: Groups):
        super().__init__()
        tokens = TokenEmbedding(config.vocab_size, config.d_model)
        init_seeded(tokens, "decoder.embed_tokens", config, seed)
        self.tokens = split_embedding(tokens, groups) if groups.dims.tp > 1 else tokens
        self.last_activation_norm: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d)
        return self.tokens(ids)


def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, V / T)
    with torch.no_grad():  # what OPT.hidden leaves in last_activation_norm
        embedding.last_activation_norm = x.detach().float().norm(dim=-1).mean()
    return embedding.tokens.logits(x)


class Positions(nn.Module):
    def __init__(self, config: OPTConfig, seed: int):
        super().__init__()
        self.max_seq_len = config.max_seq_len
        self.embed_positions = nn.Embedding(config.max_seq_len + POSITION_OFFSET, config.d_model)
        init_seeded(self, "decoder", config, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> same, + positions
        T = x.size(1)
        if T > self.max_seq_len:
            raise ValueError(f"sequence of {T} tokens, the model takes at most {self.max_seq_len}")
        return x + self.embed_positions(torch.arange(T, device=x.device) + POSITION_OFFSET)


class PipeBlock(Block):
    """Decoder block `index`, built whole from its own streams, then this rank's tensor-parallel shard of it."""

    def __init__(self, config: OPTConfig, index: int, seed: int, groups: Groups):
        super().__init__(config)
        init_seeded(self, f"decoder.layers.{index}", config, seed)
        if groups.dims.tp > 1:
            split_block(self, groups)


class FinalNorm(nn.LayerNorm):
    def __init__(self, config: OPTConfig, seed: int):
        super().__init__(config.d_model, eps=config.layer_norm_eps)
        init_seeded(self, "decoder.final_layer_norm", config, seed)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """The same loss, its gradient times `factor`: how the loop's injected faults poison a step's gradients
    (nan, or an fp16 overflow) while the loss it reports stays the true one."""
    return loss if factor == 1.0 else _ScaleGradient.apply(loss, factor)


class Loss:
    """The last stage's loss function: the mean cross-entropy of the tied output layer's logits. During a training
    step, each micro-batch's loss times its weight (`weights`, in the order the engine runs them: train/loop/step.py
    `Feed.weights`), so that an elastic replica's padding micro-batch counts for nothing, in the loss the engine
    reports as in its gradient."""

    def __init__(self, embedding: Embedding | None):
        self.embedding = embedding  # None on the other stages, which never call it
        self.gradient_factor = 1.0
        self.weights: Iterator[float] | None = None  # None: each micro-batch its own mean (validation)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.embedding.tokens.loss(logits, targets)
        if self.weights is not None:
            loss = loss * next(self.weights)
        return scale_gradient(loss, self.gradient_factor)


# A PipelineModule names each layer's parameters by the layer's index in `layer_specs` (1 the positions, 2 to
# n_layer + 1 the blocks, n_layer + 2 the final norm) and the tied embedding's under `tied_modules`, whatever the
# number of stages: these two turn those names into the whole OPT's (model/opt.py) and back, for the export
# (`export_model`) and for a checkpoint's optimizer state that loads into a layout with a pipeline from one
# without, or the other way (train/checkpoint_files.py `universal`).
TIED = "tied_modules.embed.tokens."


def opt_name(name: str, n_layer: int) -> str:
    """Pipeline parameter `name`'s name in the whole OPT."""
    if name.startswith(TIED):
        return "decoder.embed_tokens." + name.removeprefix(TIED)
    index, rest = name.split(".", 1)
    if int(index) == 1:
        return "decoder." + rest
    if int(index) < n_layer + 2:
        return f"decoder.layers.{int(index) - 2}.{rest}"
    return "decoder.final_layer_norm." + rest


def pipeline_name(name: str, n_layer: int) -> str:
    """The whole OPT's parameter `name` as a pipeline names it (`opt_name`'s inverse)."""
    for prefix, to in (("decoder.embed_tokens.", TIED), ("decoder.final_layer_norm.", f"{n_layer + 2}.")):
        if name.startswith(prefix):
            return to + name.removeprefix(prefix)
    if name.startswith("decoder.layers."):
        index, rest = name.removeprefix("decoder.layers.").split(".", 1)
        return f"{int(index) + 2}.{rest}"
    return "1." + name.removeprefix("decoder.")


@cache
def whole_names(config: OPTConfig) -> tuple[str, ...]:
    """Every parameter name of the whole OPT, in order, without its weights (built on the meta device): what stage 0
    describes to DeepSpeed's converter for every stage (train/checkpoint_files.py `universal_info`)."""
    with torch.device("meta"):
        return tuple(f"decoder.{name}" for name, _ in Decoder(config).named_parameters())  # OPT's, less its init


PARTITION_METHOD = "type:PipeBlock"  # the blocks balanced; the embeddings with the first, the head with the last


def layer_specs(config: OPTConfig, groups: Groups, *, seed: int) -> list:
    """The whole model's layers as DeepSpeed's LayerSpecs, in order; each stage builds its own run of them."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    tied = partial(TiedLayerSpec, "embed", Embedding, config, seed, groups, tied_weight_attr="tokens.weight")
    layers = [tied(), LayerSpec(Positions, config, seed),
              *(LayerSpec(PipeBlock, config, i, seed, groups) for i in range(config.n_layer))]
    if config.pre_ln:
        layers.append(LayerSpec(FinalNorm, config, seed))
    layers.append(tied(forward_fn=head))
    return layers


def pipeline_module(config: OPTConfig, groups: Groups, *, seed: int, activation_checkpointing: bool):
    """This rank's stage of the model, as a DeepSpeed PipelineModule over `groups`' layout."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dims = groups.dims
    if dims.pp > config.n_layer:
        raise ValueError(f"{dims.pp} pipeline stages for {config.n_layer} layers: every stage needs at least one")
    if dims.tp > 1:
        check_split(config, dims.tp, training=True)
    module = PipelineModule(
        layer_specs(config, groups, seed=seed),
        topology=PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp),
        partition_method=PARTITION_METHOD,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,  # each block recomputed in backward
        activation_checkpoint_func=partial(checkpoint, use_reentrant=False), checkpointable_layers=["PipeBlock"],
        # Training's micro-batches all have one shape: its p2p shapes go once, not with a host sync (.item() in
        # pipe/engine.py's _recv_tensor_meta) per micro-batch; validation turns it on for itself.
        dynamic_shape=False)
    last = groups.stage == dims.pp - 1
    module.opt_config = config  # the whole model's, which this stage's checkpoints describe (`whole_names`)
    module.loss_fn = Loss(module.tied_modules["embed"] if last else None)
    return module


def local_layers(module) -> list[nn.Module]:
    """This stage's layers that hold parameters, in order (the tied embedding once, though used twice)."""
    out = [module.tied_modules["embed"]] if "embed" in module.tied_modules else []
    return out + [f for f in module.forward_funcs if isinstance(f, nn.Module) and f not in out]


def activation_norm(module, groups: Groups) -> torch.Tensor:
    """The last stage's final-activation norm (of the step's last micro-batch), on every stage."""
    embed = module.tied_modules["embed"] if "embed" in module.tied_modules else None
    norm = embed.last_activation_norm if embed is not None and groups.stage == groups.dims.pp - 1 else None
    device = next(module.parameters()).device
    out = torch.zeros((), dtype=torch.float32, device=device) if norm is None else norm.detach().float().clone()
    dist.all_reduce(out, group=groups.pipeline)  # zero from every stage but the last
    return out


def eval_nll(engine, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], scored: list[int], groups: Groups) -> torch.Tensor:
    """The summed loss over `micro_batches` (the same number on every rank of the pipeline), on every stage: each
    micro-batch's mean loss over its scored targets from the last stage, times `scored` (one with none adds 0)."""
    engine.dynamic_shape = True  # its micro-batches are larger than training's, and its last one smaller
    try:
        losses = engine.eval_batch(iter(micro_batches), compute_loss=True, reduce_output=None, bcast_loss=False,
                                   num_micro_batches=len(micro_batches))
    finally:
        engine.dynamic_shape = False
        engine.reset_activation_shape()  # training's shapes are sent again, once, at its next micro-batch
    device = next(engine.module.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    if groups.stage == groups.dims.pp - 1:
        for loss, n in zip(losses, scored, strict=True):
            if n:
                total += loss.double() * n
    dist.all_reduce(total, group=groups.pipeline)
    return total


def export_model(module, groups: Groups, config: OPTConfig, out_dir: str | Path, save_tokenizer=None,
                 max_shard_bytes: int = SHARD_BYTES) -> None:
    """The whole model as a Hugging Face folder (model/hf.py's format), written by many ranks at once. Each
    stage's pieces go into weights files of their own (model.hf.shard_plan); for each piece the stage's tensor
    group gathers it, which leaves it whole on every tensor rank, and the tensor rank the piece's file falls to
    keeps it and writes the file: at 175B 32 writers of 11 GB each, where one rank used to receive and write
    350 GB while the others waited on it. Rank 0 writes the index, config.json and the tokenizer once every
    file is written. No rank holds more than one file beyond its own stage. Every rank of the first
    data-parallel replica calls this; the others return at once."""
    if groups.data_rank != 0:
        return
    with torch.device("meta"):
        skeleton = OPT(config)
    names = {id(p): n for n, p in skeleton.named_parameters()}
    order = [(names[id(p)], p.numel()) for part in export_parts(skeleton) for p in part.parameters()]
    mine = {opt_name(n, config.n_layer): p for n, p in module.named_parameters()}  # the tied embedding once
    owners = _owners(mine, groups)
    dtype = next(module.parameters()).dtype
    width = dtype.itemsize
    plan = shard_plan([(name, numel * width, owners[name]) for name, numel in order], max_shard_bytes)
    finals, out = file_names(len(plan)), Path(out_dir)
    for i, (final, file) in enumerate(zip(finals, plan)):
        if owners[file[0]] != groups.stage:
            continue
        writer = i % groups.dims.tp == groups.tensor_rank
        tensors = {}
        for name in file:
            whole = unsplit(mine[name], groups)  # a collective over this stage's tensor group
            if writer:
                tensors[PREFIX + name] = whole.to("cpu", copy=True).contiguous()
        if writer:
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / f".{final}.tmp"), metadata={"format": "pt"})
            os.replace(out / f".{final}.tmp", out / final)
    dist.barrier(group=groups.tensor)  # this stage's files are written ...
    dist.barrier(group=groups.pipeline)  # ... and every stage's
    if groups.rank != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {PREFIX + name: final for final, file in zip(finals, plan) for name in file}
    write_metadata(out, config, dtype, weight_map, sum(numel for _, numel in order) * width, save_tokenizer)


def _owners(mine: dict, groups: Groups) -> dict[str, int]:
    """The stage that holds each parameter (the first one, for the tied embedding), known on every rank."""
    held = [None] * groups.dims.pp
    dist.all_gather_object(held, sorted(mine), group=groups.pipeline)
    owners: dict[str, int] = {}
    for stage, names in enumerate(held):
        for name in names:
            owners.setdefault(name, stage)
    return owners

"""Who is who in a tensor x pipeline x data layout, the process groups, and the tensor-parallel form of an OPT.

`ParallelDims` is the layout (sizes that multiply to the world) and each rank's coordinates in it;
`Groups` builds every process group once and answers DeepSpeed's `mpu` questions (ZeRO shards over
the data-parallel group, the gradient norm sums over the tensor group); `parallelize` turns an OPT
built whole from the seed into this rank's tensor-parallel shard of it, and `full_state_dict` gathers
the shards back, so the same weights load into either form (model/opt.py stays the reference).

Ranks are ordered (pipe, data, tensor), DeepSpeed's PipeModelDataParallelTopology: a tensor group is
T neighbouring ranks, which Ray Train places on one node (it fills a node's GPUs with consecutive
world ranks), so the all-reduces of every layer stay on NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from model.opt import OPT
from train.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @classmethod
    def for_world(cls, world: int, tp: int = 1, pp: int = 1) -> "ParallelDims":
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise ValueError(f"tensor {tp} x pipeline {pp} does not divide {world} workers")
        return cls(tp, pp, world // (tp * pp))

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel rank, tensor rank) of a world rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def rank_of(self, stage: int, data: int, tensor: int) -> int:
        return (stage * self.dp + data) * self.tp + tensor

    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank_of(s, d, t) for t in range(self.tp)] for s in range(self.pp) for d in range(self.dp)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank_of(s, d, t) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank_of(s, d, t) for s in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]


def tensor_group_problem(dims: ParallelDims, rank: int, local_rank: int, local_world: int) -> str | None:
    """Why this rank's tensor group is not all on its machine, or None. Ray Train numbers the workers node by
    node (ray/train/v2/.../worker_group.py: grouped by node, each node's sorted by GPU id) and counts local
    ranks per node IP address, so the machine holds world ranks [rank - local_rank, rank - local_rank +
    local_world), and the group, ranks [rank - t, rank - t + tp), is on it when it lies within them. Ray
    places as many workers on a node as fit, so a node left partly busy by another job can split a group.
    `python -m pipelines.placement` shows where a layout's workers land."""
    t = dims.coords(rank)[2]
    if t <= local_rank and dims.tp - t <= local_world - local_rank:
        return None
    return (f"rank {rank}'s tensor group (ranks {rank - t}-{rank - t + dims.tp - 1}) spans nodes: Ray Train placed "
            f"{local_world} workers on this node, not a multiple of train.parallel.tensor={dims.tp}; give the job whole "
            "free nodes (num_workers x gpus_per_worker a multiple of the GPUs per node)")


class Groups:
    """This rank's process groups (every rank creates every group, in the same order, as torch requires),
    and DeepSpeed's `mpu` interface over them."""

    def __init__(self, dims: ParallelDims, rank: int):
        if dist.get_world_size() != dims.world:
            raise ValueError(f"{dims} needs {dims.world} ranks, the process group has {dist.get_world_size()}")
        self.dims, self.rank = dims, rank
        self.stage, self.data_rank, self.tensor_rank = dims.coords(rank)
        self.tensor = self._mine(dims.tensor_groups())
        self.data = self._mine(dims.data_groups())
        self.pipeline = self._mine(dims.pipeline_groups())

    @classmethod
    def coordinates_only(cls, dims: ParallelDims, rank: int) -> "Groups":
        """Where `rank` sits in the layout, without process groups: enough to build its modules where no
        collective runs (on the meta device, to count what a rank of a 992-GPU layout holds)."""
        groups = cls.__new__(cls)
        groups.dims, groups.rank = dims, rank
        groups.stage, groups.data_rank, groups.tensor_rank = dims.coords(rank)
        groups.tensor = groups.data = groups.pipeline = None
        return groups

    def _mine(self, all_groups: list[list[int]]):
        mine = None
        for ranks in all_groups:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    # DeepSpeed's mpu: "model parallel" is the tensor group (the pipeline engine keeps its own grid)
    def get_model_parallel_group(self):
        return self.tensor

    def get_model_parallel_rank(self) -> int:
        return self.tensor_rank

    def get_model_parallel_world_size(self) -> int:
        return self.dims.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self):
        return self.data

    def get_data_parallel_rank(self) -> int:
        return self.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dims.dp

    def sum_over_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of a tensor of the model's (on its device) over this rank's tensor group."""
        t = t.clone()
        dist.all_reduce(t, group=self.tensor)
        return t


COLUMN = ("q_proj", "k_proj", "v_proj", "fc1")  # split by output: weight and bias along dim 0
ROW = ("out_proj", "fc2")  # split by input: the weight along dim 1, the bias whole


def split_dim(name: str) -> int | None:
    """How `parallelize` splits the parameter `name` of the unsplit OPT (model/opt.py's names): the dimension its
    shards concatenate along, or None when every tensor rank holds it whole. What a checkpoint tells DeepSpeed's
    converter (train/checkpoint_files.py `universal_info`), at any tensor degree, 1 included."""
    *path, leaf = name.split(".")
    if path[-1:] == ["embed_tokens"]:
        return 0  # by vocabulary
    if path[-1:] and path[-1] in COLUMN:
        return 0
    if path[-1:] and path[-1] in ROW:
        return 1 if leaf == "weight" else None
    return None


def parallelize(model: OPT, groups: Groups) -> OPT:
    """This rank's tensor-parallel shard of `model`, in place: q/k/v and fc1 split by output (heads, FFN
    columns), out_proj and fc2 by input, the token embedding (and so the tied output layer) by vocabulary.
    LayerNorms, positions and the row-parallel biases stay whole on every rank."""
    if groups.dims.tp == 1:
        return model
    check_split(model.config, groups.dims.tp, model.training)
    d = model.decoder
    d.embed_tokens = split_embedding(d.embed_tokens, groups)
    for block in d.layers:
        split_block(block, groups)
    return model


def check_split(cfg, tp: int, training: bool) -> None:
    for what, size in (("n_head", cfg.n_head), ("ffn_dim", cfg.ffn_dim), ("vocab_size", cfg.vocab_size)):
        if size % tp:
            raise ValueError(f"tensor parallel {tp} does not divide {what} {size}")
    if cfg.attn_dropout and training:
        # Each rank holds other heads, so attention dropout would need a generator per rank (Megatron's RNG
        # tracker); OPT trains with none, and nothing else draws random numbers inside the split region.
        raise ValueError("attention dropout under tensor parallelism is not supported (OPT's is 0.0)")


def split_embedding(embedding: nn.Embedding, groups: Groups) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(embedding, groups.tensor, groups.tensor_rank, groups.dims.tp)


def split_block(block: nn.Module, groups: Groups) -> nn.Module:
    """One decoder block's tensor-parallel shard, in place."""
    tp, rank, group = groups.dims.tp, groups.tensor_rank, groups.tensor
    attn = block.self_attn
    for module in (attn, block):
        for name in COLUMN + ROW:
            if hasattr(module, name):
                split = ColumnParallelLinear if name in COLUMN else RowParallelLinear
                setattr(module, name, split(getattr(module, name), group, rank, tp))
    return block


def full_state_dict(model: nn.Module, groups: Groups) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict (the names of model/opt.py), gathered over the tensor group on every rank."""
    return {name: unsplit(p, groups).clone() for name, p in model.named_parameters()}


def unsplit(p: torch.Tensor, groups: Groups) -> torch.Tensor:
    """A parameter whole: its shards gathered over the tensor group when it is split (a collective there),
    else itself, detached."""
    t = p.detach()
    if getattr(p, "tensor_model_parallel", False) and groups.dims.tp > 1:
        shards = [torch.empty_like(t) for _ in range(groups.dims.tp)]
        dist.all_gather(shards, t.contiguous(), group=groups.tensor)
        t = torch.cat(shards, dim=p.partition_dim)
    return t

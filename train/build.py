"""The model built where it will live: whole in every process for ZeRO 0-2, partitioned as it is
constructed for ZeRO-3 (a pipeline's stages build only their own layers: train/parallel/pipeline.py).

Built whole, OPT-175B is 700 GB of fp32 in every worker's host memory (8 workers per node):
no node has that. Under `deepspeed.zero.Init` each module's parameters are partitioned over the
data-parallel ranks (in the training dtype, on the GPU) as soon as the module is constructed, so
no process ever holds more than one module's parameters whole.

The model's own init then runs on empty placeholders, so OPT's init rule (`model.opt.init_`) is
applied here to each rank's partition instead. The rule is elementwise, so a partition drawn
with a generator seeded by (seed, rank) has exactly the distribution of the same slice of a
whole-model init; only the random stream differs from a ZeRO 0-2 build of the same seed.
"""

from __future__ import annotations

import torch

from model.configs import OPTConfig
from model.opt import OPT, init_


def is_partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter: its data is a placeholder, `ds_tensor` holds this rank's partition."""
    return hasattr(p, "ds_tensor")


def shape_of(p: torch.Tensor) -> torch.Size:
    """The parameter's real shape, also when ZeRO-3 has partitioned it (then `p.shape` is a placeholder's)."""
    return p.ds_shape if is_partitioned(p) else p.shape


def build(config: OPTConfig, ds_config: dict, *, seed: int, rank: int) -> OPT:
    """The model for a DeepSpeed engine configured by `ds_config` (the dict `train.optim.deepspeed_config`
    made), on this rank. ZeRO 0-2: whole, each parameter from its own stream of `seed` (model.opt.generator_for),
    as train/parallel/pipeline.py builds a stage's layers."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return OPT(config, seed=seed)  # each parameter from its own stream: the same weights as a pipeline's stages
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = OPT(config)
    init_partitions(model, seed=seed, rank=rank)
    return model


def init_partitions(model: OPT, *, seed: int, rank: int) -> None:
    """OPT's init on this rank's partition of every parameter (the padding past the end included,
    which nothing reads)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        part = p.ds_tensor
        if part.device not in generators:
            generators[part.device] = torch.Generator(device=part.device).manual_seed(
                (seed * 1_000_003 + rank) % 2**63)
        init_(name, part, model.config, generator=generators[part.device])

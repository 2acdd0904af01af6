"""The training stage's rules: the layouts it takes (`layout_rule`, which each training section's `validate`
checks, train/config.py), DeepSpeed's loss-scale floor, and the config rules that need the model's sizes
(model/configs.py) or the GPU tables (train/plan/hardware.py).

They take plain values, not config objects: train/config.py imports this module. They run last when a config is
loaded (pipelines/config.py's `training_rules`, where the train and screen.proxy sections meet), on each of the
two with the same keys and messages.
"""

from __future__ import annotations

from core.config import ConfigError
from model.configs import CONFIGS, OPTConfig, param_count
from train.plan.hardware import NODES

def layout_rule(tensor: int, pipeline: int, zero_stage: int, precision: str) -> tuple[str, str] | None:
    """The first rule of this project's training stage that a layout breaks, as (its key within a training
    section, the message), or None. One source for the config (train, screen.proxy) and the layout planner
    (train/plan/layout.py: refused_here); they need neither the model's sizes nor the GPU tables."""
    if precision == "fp16" and zero_stage == 0:
        # DeepSpeed's ZeRO-0 fp16 wrapper around a client torch optimizer applies updates loss-scale times
        # too small (platform notes), and has no loss scaler for the autopilot to reset.
        return "zero_stage", "fp16 needs zero_stage 1, 2 or 3"
    if pipeline > 1 and zero_stage != 1:
        return "parallel.pipeline", (f"pipeline parallelism takes zero_stage 1, got {zero_stage}: DeepSpeed's pipeline "
                                     "engine refuses ZeRO-2 and ZeRO-3 (deepspeed/runtime/pipe/engine.py: \"ZeRO-2 and "
                                     "ZeRO-3 are incompatible with pipeline parallelism\"), and under ZeRO-0 it reports "
                                     "no gradient norm, which the autopilot watches")
    if tensor > 1 and zero_stage == 3:
        return "parallel.tensor", ("tensor parallelism takes ZeRO 0-2 here: the model is built whole and then split "
                                   "(train/parallel/groups.py), which ZeRO-3's partitioned build cannot follow")
    return None


def compile_rule(tensor: int, pipeline: int, zero_stage: int | str) -> str | None:
    """Why compiled blocks (`compile: true`, train/loop/engine.py compile_blocks) cannot run in this layout, or None.
    One source for the config's check (train/config.py) and the stages `zero_stage: auto` may choose
    (train/plan/planner.py)."""
    if tensor > 1 or pipeline > 1 or zero_stage == 3:
        return ("compiled blocks take tensor and pipeline 1 and zero_stage 0 to 2: a split block's collectives, a "
                "pipeline's stages and ZeRO-3's parameter gathers are not compiled here")
    return None


# DeepSpeed's dynamic loss scale never goes under this (its `min_loss_scale`: an integer, at least 1); an overflow
# at it raises "Current loss scale already at minimum" and ends the run.
DEEPSPEED_MIN_LOSS_SCALE = 1


# The largest model the tensor-parallel path without a pipeline takes: its export gathers the fp16 model whole on
# a GPU (train/parallel/groups.py full_state_dict), which must leave an 80 GB GPU room for the rank's weights,
# gradients and optimizer states. OPT-13B (26 GB gathered) fits; OPT-30B (60 GB, with 15 GB of its own weights
# and gradients at tensor 8) does not. Up to this size the whole fp32 build is also at most 80 GB of host memory
# per worker.
TENSOR_ONLY_MAX_PARAMS = 20e9


def check_section(key: str, name: str, t: int, p: int, gpus_per_worker: float | None) -> None:
    """A training section's layout (tensor `t`, pipeline `p`) against its model's layers and widths and against
    the largest node."""
    model = CONFIGS.get(name)  # an unknown model is check_batch's error
    if model is not None and p > model.n_layer:
        raise ConfigError(f"{key}.parallel.pipeline", f"{p} stages for the {name} model's {model.n_layer} "
                          "layers: every stage needs at least one")
    for what in ("n_head", "ffn_dim", "vocab_size"):
        if model is not None and getattr(model, what) % t:
            raise ConfigError(f"{key}.parallel.tensor", f"{t} does not divide the {name} model's {what} "
                              f"({getattr(model, what)})")
    split = model is not None and tensor_only_problem(model, t, p)
    if split:
        raise ConfigError(f"{key}.parallel.pipeline", split)
    per_node = max(node.gpus for node in NODES.values())
    if gpus_per_worker and t * gpus_per_worker > per_node:
        raise ConfigError(f"{key}.parallel.tensor", f"a tensor group of {t} workers x {gpus_per_worker:g} GPUs "
                          f"would span nodes of {per_node} GPUs: its all-reduces, two per layer, would cross the network")


def tensor_only_problem(model: OPTConfig, tensor: int, pipeline: int) -> str | None:
    """Why tensor parallelism without a pipeline cannot take this model, or None (the config's rule and the
    layout planner's, train/plan/layout.py refused_here)."""
    n = param_count(model)
    if tensor == 1 or pipeline > 1 or n <= TENSOR_ONLY_MAX_PARAMS:
        return None
    return (f"tensor parallelism without a pipeline takes models up to {TENSOR_ONLY_MAX_PARAMS / 1e9:.0f}B parameters, "
            f"and {model.name} has {n / 1e9:.1f}B: each worker builds the whole model in fp32 before it keeps its "
            f"shard ({4 * n / 1e9:.0f} GB of host memory each, {32 * n / 1e9:.0f} GB for a node's 8; train/build.py), "
            f"and the export gathers the whole model in fp16 ({2 * n / 1e9:.0f} GB) onto every GPU of the first "
            "replica beside its training state (train/loop/export.py). Set parallel.pipeline > 1: a pipeline's "
            "stages build and export only their own layers")


def check_batch(key: str, model: str, batch_tokens: int | None, seq_len: int, micro: int, workers: int,
                seq_len_key: str | None = None) -> None:
    """The model exists, and its global batch splits into micro-batches on every worker."""
    if model not in CONFIGS:
        raise ConfigError(f"{key}.model", f"expected one of {', '.join(CONFIGS)}, got {model!r}")
    batch_tokens = batch_tokens or CONFIGS[model].batch_tokens
    sequences = batch_tokens // seq_len
    if sequences == 0 or sequences % (micro * workers):
        raise ConfigError(f"{key}.global_batch_tokens", f"{batch_tokens} tokens are {sequences} sequences of "
                          f"{seq_len_key or key + '.seq_len'}={seq_len}: not a multiple of micro_batch_size x num_workers"
                          f" / (parallel.tensor x parallel.pipeline) = {micro * workers}")

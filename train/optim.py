"""OPT's optimizer, and the DeepSpeed config generated from ours.

AdamW with betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only (not on biases or
LayerNorm parameters) (opt-facts.md). Its LR schedule: train/schedule.py.
"""

from __future__ import annotations

import torch

from train.rules import DEEPSPEED_MIN_LOSS_SCALE
from train.build import shape_of

BETAS = (0.9, 0.95)
EPS = 1e-8


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:  # biases and LayerNorm weights are 1-D (ZeRO-3 placeholders are all 1-D: their real shape)
            (decay if len(shape_of(p)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's fused AdamW (one kernel for all parameters, on CPU and CUDA alike). Its default, the single-tensor
    one, reads each parameter's step count to the host at every update (torch/optim/adam.py `_get_value`, 2 to 36
    reads a step here); the fused one keeps the counts on the device, and skips an update on the device when its
    `found_inf` is set (step.py sets it on ZeRO-0, where no DeepSpeed optimizer checks the gradients)."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=BETAS, eps=EPS, fused=True)


def autocast_dtype(*, zero_stage: int, precision: str, pipeline: bool = False) -> torch.dtype | None:
    """bf16 under ZeRO-0: the weights, gradients and Adam's state in fp32, the forward computed in bf16 under
    torch's autocast, as nanoGPT and torchtitan train. DeepSpeed's own bf16 at ZeRO-0 is its
    FP16_UnfusedOptimizer, which reads the device 41 times a step (an overflow scan per parameter, the weights'
    norms) and sums gradients over micro-batches in bf16; autocast leaves DeepSpeed an fp32 engine, which wraps
    no optimizer of ours (docs/training.md, "Host reads per step"). ZeRO 1-3 and a pipeline keep DeepSpeed's bf16."""
    return torch.bfloat16 if precision == "bf16" and zero_stage == 0 and not pipeline else None


INITIAL_SCALE_POWER = 16  # fp16's dynamic loss scale starts (and is reset by the autopilot) at 2**16


def deepspeed_config(*, micro_batch: int, accumulation: int, world_size: int, zero_stage: int, precision: str,
                     grad_clip: float, pipeline: bool = False) -> dict:
    """DeepSpeed's JSON config for our settings. The optimizer and schedule are ours (above); `world_size` is
    the data-parallel size; `pipeline`: for DeepSpeed's pipeline engine."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch * accumulation * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as OPT used
        "steps_per_print": 1 << 30,  # our own progress line instead
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device at each micro-batch's forward and
        # step (utils/timer.py `ThroughputTimer.start/stop`, from engine.py `_forward_prologue` and `step`) to time
        # what only its own progress print reports; our step is timed by step.py.
        "timers": {"throughput": {"enabled": False}},
    }
    if zero_stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if pipeline:
        # Each tensor rank sends the whole activation to the next stage. Partitioned sends would keep the shape of
        # the first micro-batch they saw (pipe/engine.py: pipe_partition_input_meta_cache), and gather validation's
        # larger micro-batches wrong; the layout planner prices unpartitioned sends.
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
        # A stage's layer files written by all its data-parallel replicas, each its share of the layers
        # (pipe/module.py `save_state_dict`), not all by the first: at 175B (31 replicas) the 32 ranks of the first
        # replica wrote 11 GB of weights each beside their 2.1 GB of optimizer state, and every rank waited for
        # them at the engine's barrier; now each writes about 0.35 GB of weights (docs/scale.md, "Checkpoints").
        config["checkpoint"] = {"parallel_write": {"pipeline_stage": True}}
    if autocast_dtype(zero_stage=zero_stage, precision=precision, pipeline=pipeline) is not None:
        # bf16 at ZeRO-0: an fp32 engine whose forward DeepSpeed itself runs under torch's autocast. Not the loop's
        # own autocast around the engine's call: the engine's forward turns an outer CUDA autocast off unless this
        # section is on (runtime/torch_autocast.py `autocast_if_enabled`, which asks `torch.is_autocast_enabled()`,
        # CUDA's state alone), so on a GPU the forward ran in fp32, 4x slower than bf16 at 125M on an H200; a CPU's
        # autocast it never saw. At ZeRO-0 the section changes nothing else: the gradients' communication dtype it
        # sets on Linear weights is read by ZeRO's optimizers only, and its GradScaler is fp16's.
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "bf16":
        # Gradients summed over micro-batches in fp32: in bf16 (DeepSpeed's default, the model's dtype) each
        # addition keeps 8 bits of mantissa, and a sum over many micro-batches loses the small ones. (ZeRO 0
        # refuses the mix, engine._do_optimizer_sanity_check: "unsupported mix"; its bf16 is autocast, above.)
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        if zero_stage == 1:
            # ZeRO-1 in bf16 with fp32 sums is DeepSpeed's BF16_Optimizer (engine._do_optimizer_sanity_check),
            # whose fp32 gradient buffer is whole on every rank. By default it also keeps each bf16 gradient
            # until the step (bf16_optimizer.py: update_hp_grads(clear_lp_grads=False)): 2 bytes per parameter
            # more, 11 GB per GPU of the 175B layout. Added into the fp32 buffer as each is made, and freed.
            config["bf16"]["immediate_grad_update"] = True
    elif precision == "fp16":
        # fp16 weights, fp32 master weights and Adam state, dynamic loss scale (OPT-175B's setup).
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": DEEPSPEED_MIN_LOSS_SCALE}
    return config

"""DeepSpeed's fp16 engines on a CPU, for the tests and gpu_check's dry run: never the pipeline's choice (config
validation refuses fp16 without GPUs, train/rules.py).

DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16 kernels
(`torch.ops.mkldnn._is_mkldnn_fp16_supported()`: AVX-512-FP16 or AMX-FP16, deepspeed/accelerator/cpu_accelerator.py
`is_fp16_supported`), and refuses the engine elsewhere: "Type fp16 is not supported on your device". torch's own
fp16 kernels need no such feature; they run on any x86-64 or ARM CPU, only slower. So what we test of fp16 on a
CPU (DeepSpeed's real loss scaler, its fp16 optimizers' memory) can run on most laptops and AMD servers, which
lack both features, once that one check is lifted in the process that builds the engine: the test process, each
spawned gloo rank, each Ray worker."""

from __future__ import annotations

from core.cpu import this_cpu


def torch_fp16_error() -> str | None:
    """None where torch's fp16 kernels train on this CPU (a Linear's forward and backward, finite), else why not,
    naming the CPU and its 16-bit features: the reason a test skips with."""
    import torch

    try:
        layer = torch.nn.Linear(16, 16).half()
        x = torch.randn(4, 16).half().requires_grad_()
        layer(x).float().square().mean().backward()
        if not (torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()):
            raise RuntimeError("non-finite gradients")
    except (RuntimeError, NotImplementedError) as e:
        return f"torch's fp16 kernels fail on this CPU ({this_cpu().describe()}): {e}"
    return None


def allow_deepspeed_fp16() -> None:
    """Lift DeepSpeed's oneDNN check in this process, on the accelerator object every engine asks."""
    from train.deepspeed_import import import_deepspeed

    import_deepspeed()  # a Ray worker calls this before the loop does
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True

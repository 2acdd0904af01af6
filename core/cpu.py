"""What this CPU is, for the figures measured on it: its model, the instruction sets that change our speed, and
what torch, oneDNN and numpy make of them. Hosts of one machine kind differ (an Intel core with AMX or an AMD
one with AVX2 only): torch's matmuls ran 2.5-4x apart between them, and DeepSpeed takes fp16 on a CPU only
where oneDNN has fp16 kernels. A figure that does not name its CPU cannot be compared with another."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The ISA features that change our speed, by their names in /proc/cpuinfo, and as we print them.
FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "avx512_fp16": "AVX-512-FP16",
            "amx_bf16": "AMX-BF16", "amx_fp16": "AMX-FP16"}
# The environment variables that make torch and oneDNN use less than the CPU has (AVX2_ONLY, tests/test_any_cpu.py).
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
# An AVX2-only CPU (most laptops, many AMD servers) on any x86-64 host: oneDNN, ATen and MKL held to AVX2, so
# oneDNN reports neither fp16 nor bf16 kernels (torch.ops.mkldnn._is_mkldnn_fp16_supported and bf16: False)
# and DeepSpeed's CPU accelerator refuses fp16, as on such a CPU. Each is read when the library loads, so it
# reaches every process started with it in its environment: spawned ranks, Ray workers, subprocesses.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@dataclass(frozen=True)
class Cpu:
    model: str
    cores: int
    features: dict[str, bool | None]  # FEATURES' names; None where the OS does not say (not Linux)

    def describe(self) -> str:
        """One line: 'AMD EPYC, 2 cores; AVX2 yes, AVX-512 yes, ..., AMX-FP16 no'."""
        def say(v: bool | None) -> str:
            return "unknown" if v is None else "yes" if v else "no"

        return f"{self.model}, {self.cores} cores; " + ", ".join(f"{FEATURES[k]} {say(v)}" for k, v in self.features.items())


def this_cpu() -> Cpu:
    flags, model = _cpuinfo()
    features = {k: (k in flags) if flags is not None else None for k in FEATURES}
    return Cpu(model, os.cpu_count() or 1, features)


def _cpuinfo() -> tuple[set[str] | None, str]:
    """(the flags, the model name) from /proc/cpuinfo; (None, what platform says) elsewhere."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        fields: dict[str, str] = {}
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block is every core's
            fields.setdefault(key.strip(), value.strip())
        flags = set(fields.get("flags", "").split())
        model = fields.get("model name") or platform.machine()
        if "cpu family" in fields:  # a hypervisor may name only 'AMD EPYC': the family tells its generation
            model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
        return flags, model
    if platform.system() == "Darwin":
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout
        return None, brand.strip() or platform.machine()
    return None, platform.processor() or platform.machine()


def torch_kernels() -> str:
    """What torch makes of this CPU: ATen's kernels, oneDNN's 16-bit support, its threads (imports torch)."""
    import torch

    def say(check) -> str:
        try:
            return "yes" if check() else "no"
        except Exception:  # an op a build lacks
            return "unknown"

    return (f"torch {torch.__version__}: {torch.backends.cpu.get_cpu_capability()} kernels, "
            f"oneDNN fp16 {say(torch.ops.mkldnn._is_mkldnn_fp16_supported)}, "
            f"bf16 {say(torch.ops.mkldnn._is_mkldnn_bf16_supported)}, {torch.get_num_threads()} threads")


def numpy_kernels() -> str:
    """numpy's BLAS, the kernels it chose for this CPU and its threads, where threadpoolctl can tell."""
    import numpy

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return f"numpy {numpy.__version__}: BLAS threads unknown (no threadpoolctl)"
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not blas:
        return f"numpy {numpy.__version__}: no BLAS loaded"
    b = blas[0]
    return f"numpy {numpy.__version__}: {b['internal_api']} {b.get('architecture') or ''} kernels, {b['num_threads']} threads".replace("  ", " ")


def isa_limits() -> str:
    """The environment's limits on the ISA torch and oneDNN use ('' when none): a figure under them is a
    simulation of a smaller CPU, not this one."""
    set_ = [f"{k}={os.environ[k]}" for k in ISA_LIMITS if os.environ.get(k)]
    return f"ISA limited by {' '.join(set_)}" if set_ else ""

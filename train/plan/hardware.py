"""What the GPUs and the nodes we plan for can do: datasheet numbers, each with where it comes from.

Two users: the training loop's MFU (`peak_for`, by the name CUDA reports) and the layout planner
(`train/plan/planner.py`: memory, peak, bandwidths by a short name, and nodes by their instance type).
No torch here, so the planner starts in a blink.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense peak TFLOP/s per device (NVIDIA's datasheets, without sparsity; fp32 without tensor cores), by a
# substring of torch.cuda.get_device_name(), the first that matches: the H100 PCIe and NVL parts are
# slower than the SXM one ("NVIDIA H100 80GB HBM3"), so they come before it.
PEAK_TFLOPS = [("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
               ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
               ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
               ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
               ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5})]


def peak_for(device_name: str, precision: str) -> float | None:
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            return peaks[precision]
    return None


GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str  # the planner's short name (--gpu)
    device_name: str  # as torch.cuda.get_device_name() says it: the key into PEAK_TFLOPS
    memory_bytes: float  # HBM the allocator can use
    hbm_bytes_s: float  # memory bandwidth
    nvlink_bytes_s: float  # NVLink per GPU, per direction (through NVSwitch to any GPU of the node)

    def peak_tflops(self, precision: str) -> float:
        peak = peak_for(self.device_name, precision)
        assert peak is not None, self.device_name
        return peak


# NVIDIA's A100 datasheet (40/80 GB, 1.6/2.0 TB/s, NVLink 3: 600 GB/s per GPU both ways), H100 SXM
# datasheet (80 GB, 3.35 TB/s, NVLink 4: 900 GB/s), H200 datasheet (141 GB, 4.8 TB/s, 900 GB/s). Memory
# as the CUDA driver reports it (80 GiB parts report 80 GiB less ~0.5 GiB; the H200 reports 139.8 GiB).
GPUS = {g.name: g for g in [
    GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", 40 * GIB, 1.555e12, 300e9),
    GPU("a100-80gb", "NVIDIA A100-SXM4-80GB", 80 * GIB, 2.039e12, 300e9),
    GPU("h100", "NVIDIA H100 80GB HBM3", 79.6 * GIB, 3.35e12, 450e9),
    GPU("h200", "NVIDIA H200", 139.8 * GIB, 4.8e12, 450e9),
]}


@dataclass(frozen=True)
class Node:
    gpu: str
    gpus: int
    inter_gbps: float  # the node's network for collectives between nodes, Gb/s per direction
    source: str


NODES = {
    # AWS's instance pages (aws.amazon.com/ec2/instance-types/p4, /p5): p4d/p4de 400 Gbps EFA (4 cards),
    # p5 and p5e/p5en 3200 Gbps EFA (32 x 100 or 16 x 200).
    "p4d.24xlarge": Node("a100-40gb", 8, 400, "AWS p4d: 8 x A100 40GB, 400 Gbps EFA"),
    "p4de.24xlarge": Node("a100-80gb", 8, 400, "AWS p4de: 8 x A100 80GB, 400 Gbps EFA"),
    "p5.48xlarge": Node("h100", 8, 3200, "AWS p5: 8 x H100, 3200 Gbps EFA"),
    "p5e.48xlarge": Node("h200", 8, 3200, "AWS p5e: 8 x H200, 3200 Gbps EFA"),
    "p5en.48xlarge": Node("h200", 8, 3200, "AWS p5en: 8 x H200, 3200 Gbps EFA"),
    # NVIDIA's DGX datasheets: 8 single-port ConnectX-6 (HDR, 200 Gb/s) / ConnectX-7 (NDR, 400 Gb/s) for
    # compute traffic. dgx-a100 is Selene's node, where Narayanan et al. 2021 measured (tests/test_plan.py).
    "dgx-a100": Node("a100-80gb", 8, 1600, "NVIDIA DGX A100: 8 x A100 80GB, 8 x 200 Gb/s HDR InfiniBand"),
    "dgx-h100": Node("h100", 8, 3200, "NVIDIA DGX H100: 8 x H100, 8 x 400 Gb/s NDR InfiniBand"),
}

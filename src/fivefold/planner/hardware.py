"""Hardware profiles: peak rates, memory and links of each device the planner knows.

Peak rates are dense (no structured sparsity) datasheet figures in TFLOP/s; bandwidths are
per device and per direction in GB/s (NVLink figures are the vendor's bidirectional total
halved). The trainer uses the peak of its precision as the denominator of MFU. The "cpu"
profile is this project's development machine (2 cores, AVX2, no bf16 units); its fp32 rate
is the best measured GEMM rate there (../shared/DESIGN.md), not a datasheet figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_tflops: dict[str, float]  # by precision: bf16, fp16, fp8, fp32
    memory_bytes: int
    hbm_GBps: float
    intra_node_GBps: float
    inter_node_GBps: float
    source: str

    def peak_flops(self, precision: str) -> float:
        return self.peak_tflops.get(precision, self.peak_tflops["fp32"]) * 1e12


GB = 10**9

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in [
    HardwareProfile("V100-32GB", {"fp16": 125, "bf16": 125, "fp32": 15.7}, 32 * GB, 900, 150,
                    12.5, "NVIDIA V100 datasheet (SXM2); no bf16 units, fp16 rate used"),
    HardwareProfile("A100-40GB", {"bf16": 312, "fp16": 312, "fp32": 19.5}, 40 * GB, 1555, 300,
                    25, "NVIDIA A100 datasheet (SXM4), HDR 200 Gb/s per GPU"),
    HardwareProfile("A100-80GB", {"bf16": 312, "fp16": 312, "fp32": 19.5}, 80 * GB, 2039, 300,
                    25, "NVIDIA A100 datasheet (SXM4), HDR 200 Gb/s per GPU"),
    HardwareProfile("H100-SXM", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 80 * GB,
                    3350, 450, 50, "NVIDIA H100 datasheet (SXM5), NDR 400 Gb/s per GPU"),
    HardwareProfile("H800", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 80 * GB, 3350,
                    200, 50, "NVIDIA H800 (SXM5): H100 compute, NVLink 400 GB/s"),
    HardwareProfile("H200", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 141 * GB, 4800,
                    450, 50, "NVIDIA H200 datasheet (SXM), NDR 400 Gb/s per GPU"),
    HardwareProfile("B200", {"bf16": 2250, "fp16": 2250, "fp8": 4500, "fp32": 75}, 180 * GB,
                    8000, 900, 50, "NVIDIA HGX B200 datasheet, NDR 400 Gb/s per GPU"),
    HardwareProfile("GB200", {"bf16": 2500, "fp16": 2500, "fp8": 5000, "fp32": 80}, 186 * GB,
                    8000, 900, 100, "NVIDIA GB200 NVL72 datasheet, 800 Gb/s per GPU"),
    HardwareProfile("cpu", {"fp32": 0.164}, 24 * 2**30, 20, 5, 5,
                    "measured: fp32 GEMM on the 2-core development machine (DESIGN.md)"),
]}


def detect_profile(device: torch.device, name: str | None = None) -> HardwareProfile | None:
    """The named profile, or the one matching this device; None for an unknown GPU."""
    if name is not None:
        return PROFILES.get(name)
    if device.type == "cpu":
        return PROFILES["cpu"]
    gpu = torch.cuda.get_device_name(device)
    for key in ("H200", "H800", "H100", "B200", "GB200", "V100"):
        if key in gpu:
            return PROFILES["H100-SXM" if key == "H100" else
                            "V100-32GB" if key == "V100" else key]
    if "A100" in gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        return PROFILES["A100-80GB" if total > 50 * GB else "A100-40GB"]
    return None

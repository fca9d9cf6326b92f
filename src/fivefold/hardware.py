"""Hardware profiles: peak rates, memory, links and measured efficiencies of each device.

A profile has two parts. The datasheet part: dense (no structured sparsity) peak TFLOP/s per
precision, memory, HBM bandwidth, and per-device one-direction link bandwidths (NVLink's
bidirectional total halved; the network as one NIC's share per device). The efficiency part
(`Efficiency`) says how much of those peaks real kernels reach; it is what the simulator's
roofline per operator (fivefold.planner.compute) and collective model
(fivefold.planner.comm) multiply the peaks by. Efficiencies are per profile, never per run,
and describe the hardware, not the software that runs on it (that is `train.stack`,
fivefold.planner.stack); what a long training step sustains of them is the handful of
constants of fivefold.planner.fitted, shared by every GPU profile:

- H200 (and H800, H100-SXM, H100-96GB-500W: the same die): GEMM, attention, fp8 and copy
  terms fitted to one H200's measurements (shared/reference/h200_measured.json) by
  fivefold.planner.calibrate.fit_h200_reference; checked against that file's measured HF
  Llama-1B training step. The power-capped 96 GB HBM2e part (torchtitan's runs) differs
  only in its datasheet figures.
- A100-80GB / A100-40GB: GEMMs at 0.74 of peak and Megatron-LM 2021's unfused attention
  as 3.1 ps of memory traffic per score, fitted earlier to arXiv 2104.04473's runs (the
  only Ampere rows) and held fixed since: the least out-of-sample of the profiles.
- V100, B200, GB200: no measurement here; the nearest calibrated generation's terms (stated
  per profile).
- cpu: the development machine, measured by `fivefold calibrate` (which writes a profile file
  that `cluster.gpu = PATH` accepts); rerun it for another machine.

`load_profile(name_or_path)` returns a named profile or reads a calibrated JSON file; a file
that does not parse raises `ConfigError` on `cluster.gpu`. `device_profile(name, memory)`
finds the profile of a device by the name torch gives it; asking torch for that name is the
runtime's part (fivefold.train.dist.detect_profile).

Why at the top level, without torch: the planner predicts from these profiles on machines
without torch, and the trainer divides by the same peaks for its MFU, so both layers import
this module and neither imports the other.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.config import ConfigError

GB = 10**9


@dataclass(frozen=True)
class Efficiency:
    """What fraction of each peak real kernels reach, and the fixed costs they pay.

    gemm_eff          large-GEMM rate / dense peak (compute term of the GEMM roofline)
    gemm_fp8_eff      the same for fp8 GEMMs, over the fp8 peak
    gemm_mem_eff      HBM fraction reached by a GEMM's operand traffic (its memory term)
    attn_eff          fused causal attention's matmul rate / peak (FlashAttention-2/3)
    attn_score_s      seconds per attention score element for the softmax (exp) work or,
                      unfused, the s x s memory traffic, forward; backward pays 2x
    attn_row_s        seconds per query row and head (load Q, rescale, write O), forward;
                      backward pays 5x
    mem_eff           HBM fraction reached by element-wise ops, norms, casts, the optimizer
    eltwise_passes    HBM passes over each element-wise tensor: 1 = perfectly fused kernels;
                      eager PyTorch reads and writes intermediates several times
    kernel_overhead_s fixed cost per kernel launch (tail effects, launch latency)
    comm_intra_eff    fraction of NVLink bandwidth NCCL's collectives reach (bus bandwidth)
    comm_inter_eff    the same for the inter-node network
    latency_intra_s   per-hop latency of a collective within a node
    latency_inter_s   per-hop latency across nodes
    nic_aggregation   how many of a node's NICs one collective's ring uses together: the
                      per_node ranks of a group reach per_node^a NICs' bandwidth (1 = all)
    overlap_eff       fraction of a collective that hides behind concurrent compute (the
                      rest slows the compute: shared SMs and HBM)
    reserved_bytes    memory not available to tensors (CUDA context, allocator slack)
    """

    gemm_eff: float = 0.75
    gemm_fp8_eff: float = 0.65
    gemm_mem_eff: float = 0.8
    attn_eff: float = 0.6
    attn_score_s: float = 0.0
    attn_row_s: float = 0.0
    mem_eff: float = 0.8
    eltwise_passes: float = 1.0
    kernel_overhead_s: float = 5e-6
    comm_intra_eff: float = 0.8
    comm_inter_eff: float = 0.8
    latency_intra_s: float = 5e-6
    latency_inter_s: float = 15e-6
    nic_aggregation: float = 1.0
    overlap_eff: float = 0.9
    reserved_bytes: int = 2 * GB


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_tflops: dict[str, float]  # by precision: bf16, fp16, fp8, fp32
    memory_bytes: int
    hbm_GBps: float
    intra_node_GBps: float
    inter_node_GBps: float
    source: str
    eff: Efficiency = field(default_factory=Efficiency)
    nvlink_domain: int = 8  # devices one fast fabric joins (cluster.gpus_per_node's meaning)
    cores: int = 0  # CPU profiles: cores that ranks on one machine share (0 for GPUs)

    def peak_flops(self, precision: str) -> float:
        return self.peak_tflops.get(precision, self.peak_tflops["fp32"]) * 1e12

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The Hopper die at full power (H200, H800): GEMM, attention and copy terms fitted to one
# H200's measurements (h200_measured.json: 30 bf16 GEMM shapes, 4 causal SDPA shapes, 4 fp8
# GEMMs, a copy) by fivefold.planner.calibrate.fit_h200_reference. Eager element-wise passes
# (3) from that file's HF Llama-1B step: 0.313 s predicted eager, 0.346 s measured (compiled,
# one pass: 0.272 s vs 0.281 s). Latencies: NCCL's per-hop figures on NVLink and NDR.
HOPPER = Efficiency(gemm_eff=0.722, gemm_fp8_eff=0.672, gemm_mem_eff=1.0, attn_eff=0.678,
                    attn_score_s=0.0, attn_row_s=3.49e-10, mem_eff=0.883, eltwise_passes=3.0,
                    kernel_overhead_s=9.7e-6, comm_intra_eff=0.80, comm_inter_eff=0.80,
                    latency_intra_s=1.5e-6, latency_inter_s=6e-6, overlap_eff=0.85,
                    reserved_bytes=3 * GB)
# H100-SXM (700 W, HBM3) and the power-capped H100-96GB-500W: the same die, so the same
# kernel-level terms as the H200 measurement; what differs is on the datasheet (peak,
# HBM bandwidth, memory). The software that runs on them is the spec's `train.stack`
# (fivefold.planner.stack), not a property of the profile.
H100 = HOPPER
# Ampere (A100): fitted to the 16 Megatron-LM runs (arXiv 2104.04473) of calibration_runs.json
# (`python -m fivefold.planner.fit A100-80GB`): GEMMs at 0.74 of 312 TFLOP/s; their unfused
# s x s attention as 3.1 ps of memory traffic per score. Link efficiencies, overlap and NIC
# aggregation are now fivefold.planner.fitted's (the values here are overridden).
AMPERE = Efficiency(gemm_eff=0.740, gemm_fp8_eff=0.740, gemm_mem_eff=1.0, attn_eff=0.25,
                    attn_score_s=3.1e-12, attn_row_s=0.0, mem_eff=0.80, eltwise_passes=1.0,
                    kernel_overhead_s=6e-6, comm_intra_eff=0.90, comm_inter_eff=0.85,
                    latency_intra_s=1.5e-6, latency_inter_s=6e-6, overlap_eff=0.70,
                    nic_aggregation=0.06, reserved_bytes=3 * GB)
# Volta: no measurement here; Ampere's terms with the lower tensor-core utilisation that
# Megatron-LM reported on V100 (arXiv 1909.08053: 30% of peak end to end at 8.3B).
VOLTA = dataclasses.replace(AMPERE, gemm_eff=0.70, attn_eff=0.35)
# Blackwell: no measurement here; Hopper's terms (same software stack, larger dies).
BLACKWELL = HOPPER

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in [
    HardwareProfile("V100-32GB", {"fp16": 125, "bf16": 125, "fp32": 15.7}, 32 * GB, 900, 150,
                    12.5, "NVIDIA V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor (no bf16 units;"
                    " the fp16 rate is used), 900 GB/s HBM2, NVLink2 300 GB/s total; one "
                    "100 Gb/s EDR NIC per GPU", VOLTA),
    HardwareProfile("A100-40GB", {"bf16": 312, "fp16": 312, "fp8": 312, "fp32": 19.5},
                    40 * GB, 1555, 300, 25, "NVIDIA A100 SXM4 datasheet: 312 TFLOP/s bf16, "
                    "1555 GB/s HBM2, NVLink3 600 GB/s total; DGX A100: one 200 Gb/s HDR NIC "
                    "per GPU (no fp8 units: fp8 runs at the bf16 rate)", AMPERE),
    HardwareProfile("A100-80GB", {"bf16": 312, "fp16": 312, "fp8": 312, "fp32": 19.5},
                    80 * GB, 2039, 300, 25, "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s "
                    "bf16, 2039 GB/s HBM2e, NVLink3 600 GB/s total; DGX A100: one 200 Gb/s "
                    "HDR NIC per GPU", AMPERE),
    HardwareProfile("H100-SXM", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 80 * GB,
                    3350, 450, 50, "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 1979 "
                    "fp8, 3.35 TB/s HBM3, NVLink4 900 GB/s total; DGX H100: one 400 Gb/s NDR "
                    "NIC per GPU", H100),
    HardwareProfile("H100-96GB-500W", {"bf16": 912, "fp16": 912, "fp8": 1824, "fp32": 62},
                    96 * GB, 2400, 450, 50, "Meta Grand Teton H100 (the torchtitan paper's "
                    "runs, arXiv 2410.06511): 96 GB HBM2e at 2.4 TB/s, TDP capped at 500 W, "
                    "whose sustained peak the paper places between H100 SXM (989 TFLOP/s bf16 "
                    "dense) and H100 NVL (835): taken as the midpoint, 912; NVLink4 900 GB/s "
                    "total; one 400 Gb/s NIC per GPU", H100),
    HardwareProfile("H800", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 80 * GB, 3350,
                    200, 50, "NVIDIA H800 SXM5: H100 compute and memory, NVLink cut to 400 GB/s "
                    "total; 400 Gb/s IB per GPU (DeepSeek-V3 report, arXiv 2412.19437 Sec. "
                    "3.2)", HOPPER),
    HardwareProfile("H200", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 141 * GB,
                    4800, 450, 50, "NVIDIA H200 SXM datasheet: H100 compute, 141 GB HBM3e at "
                    "4.8 TB/s, NVLink4 900 GB/s total; 400 Gb/s NDR NIC per GPU", HOPPER),
    HardwareProfile("B200", {"bf16": 2250, "fp16": 2250, "fp8": 4500, "fp32": 75}, 180 * GB,
                    8000, 900, 50, "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s bf16 dense, 4.5 fp8, "
                    "180 GB HBM3e at 8 TB/s, NVLink5 1.8 TB/s total; DGX B200: one 400 Gb/s "
                    "NIC per GPU", BLACKWELL),
    HardwareProfile("GB200", {"bf16": 2500, "fp16": 2500, "fp8": 5000, "fp32": 80}, 186 * GB,
                    8000, 900, 50, "NVIDIA GB200 NVL72 datasheet: per GPU 2.5 PFLOP/s bf16 "
                    "dense, 5 fp8, 186 GB HBM3e at 8 TB/s, NVLink5 1.8 TB/s total in a 72-GPU "
                    "domain; compute tray: 4 GPUs, 4 ConnectX-7 400 Gb/s NICs", BLACKWELL, 72),
    HardwareProfile("cpu", {"fp32": 0.1055, "bf16": 0.0009, "fp16": 0.0009}, 24 * 2**30, 38.1,
                    1.54, 1.54, "`fivefold calibrate` on the idle 2-core development machine "
                    "(one thread, 2026-11-30; bf16 matmul 0.9 GFLOP/s from DESIGN.md); rerun "
                    "it on your machine",
                    Efficiency(gemm_eff=0.975, gemm_fp8_eff=0.975, gemm_mem_eff=1.0,
                               attn_eff=1.0, attn_score_s=1.58e-9, mem_eff=1.0,
                               eltwise_passes=3.0, kernel_overhead_s=9.16e-5,
                               comm_intra_eff=1.0, comm_inter_eff=1.0, latency_intra_s=7.1e-4,
                               latency_inter_s=7.1e-4, overlap_eff=0.0, reserved_bytes=0),
                    2, 2),
]}


def profile_from_dict(data: dict, where: str = "profile") -> HardwareProfile:
    """A profile from its JSON form (what `fivefold calibrate` writes); ConfigError if bad."""
    try:
        eff = Efficiency(**data.get("eff", {}))
        fields = {k: v for k, v in data.items() if k != "eff"}
        profile = HardwareProfile(**fields, eff=eff)
        float(profile.peak_tflops["fp32"])
    except (TypeError, KeyError, ValueError) as err:
        raise ConfigError("cluster.gpu", f"{where} is not a hardware profile ({err}); write one "
                                         "with `fivefold calibrate --out FILE`") from None
    return profile


def load_profile(name_or_path: str) -> HardwareProfile:
    """A named profile (see PROFILES) or a profile file written by `fivefold calibrate`."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError("cluster.gpu", f"{name_or_path!r} is neither a known profile "
                                         f"({', '.join(PROFILES)}) nor a profile file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("cluster.gpu", f"profile file {str(path)!r} does not parse: {err}; "
                                         "write one with `fivefold calibrate --out FILE`") from None
    if not isinstance(data, dict):
        raise ConfigError("cluster.gpu", f"profile file {str(path)!r} must hold a JSON object")
    return profile_from_dict(data, f"profile file {str(path)!r}")


def device_profile(device_name: str, memory_bytes: int = 0) -> HardwareProfile | None:
    """The profile of the device torch names `device_name` ("cpu" for the CPU); a GPU's
    memory tells the A100s apart. None for a GPU no profile describes."""
    if device_name == "cpu":
        return PROFILES["cpu"]
    for key in ("H200", "H800", "H100", "GB200", "B200", "V100"):
        if key in device_name:
            return PROFILES["H100-SXM" if key == "H100" else
                            "V100-32GB" if key == "V100" else key]
    if "A100" in device_name:
        return PROFILES["A100-80GB" if memory_bytes > 50 * GB else "A100-40GB"]
    return None

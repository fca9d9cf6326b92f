"""Hardware profiles: peak rates, memory, links and measured efficiencies of each device.

A profile has two parts. The datasheet part: dense (no structured sparsity) peak TFLOP/s per
precision, memory, HBM bandwidth, and per-device one-direction link bandwidths (NVLink's
bidirectional total halved; the network as one NIC's share per device). The efficiency part
(`Efficiency`) says how much of those peaks real kernels reach; it is what the simulator's
roofline per operator (fivefold.planner.compute) and collective model
(fivefold.planner.comm) multiply the peaks by. Efficiencies are per profile, never per run,
and describe the hardware, not the software that runs on it (that is `train.stack`,
fivefold.planner.stack); what a long training step sustains of them is the handful of
constants of fivefold.planner.fitted, shared by every GPU profile.

Each profile names its `architecture` (what fivefold.planner.stack and .bands read, never
the profile's name) and its `kernel_source`: where its kernel tables (fivefold.kernel_tables:
the Efficiency terms, a GEMM efficiency surface per dtype, attention by kernel generation)
come from. No profile holds another architecture's efficiencies:

- Hopper (H200; H800, H100-SXM and the H100-96GB-500W are the same die, with their own
  datasheet figures): the GEMM, attention, fp8 and copy terms fitted to one H200's
  measurements (h200_measured.json) by fivefold.planner.calibrate_fit.fit_h200_reference,
  the GEMM surfaces read from that file's 35 bf16 and 5 fp8 shapes (tensorwise and rowwise
  scales, each its own rate and surface), FlashAttention-2-class kernels at arXiv
  2407.08608's H100 ratio; checked against the file's HF Llama-1B step.
- Ampere (A100-80GB / A100-40GB): FlashAttention-2 at 73% of peak, the top of the 50-73% that
  arXiv 2307.08691 (abstract) measured on A100; GEMMs from a published A100 SXM microbenchmark
  (fivefold.published_kernels: its rate and surface). The unfused attention of Megatron-LM
  2021 is the stack's (fivefold.planner.stack.attention_generation), not the profile's.
- Blackwell (B200, GB200): GEMMs from published microbenchmarks on each GPU
  (fivefold.published_kernels: B200 bf16 and fp8; GB200 bf16 and fp8, measured on a GB200);
  rowwise-scaled fp8 GEMMs at that fp8 rate (no rowwise table published there);
  attention at cuDNN 9.13's fused-attention rate on B200, which FlashAttention-4 beats by up
  to 1.3x at up to 1613 TFLOP/s, 71% of the bf16 peak (Zadouri, Hoehnerbach, Shah, Liu,
  Thakkar and Dao, "FlashAttention-4: Algorithm and Kernel Pipelining Co-Design for
  Asymmetric Hardware Scaling", abstract): 0.71 / 1.3; no element-wise measurement: those
  terms are fivefold.kernel_tables.NEUTRAL.
- Volta (V100): GEMMs from a published V100 SXM2 fp16 microbenchmark
  (fivefold.published_kernels); no attention or element-wise measurement: NEUTRAL.
- cpu: the development machine, measured by `fivefold calibrate` (which writes a profile file
  that `cluster.gpu = PATH` accepts); rerun it for another machine.

The host side (`HostTier`, ZeRO-Offload's and ZeRO-Infinity's tiers, arXiv 2101.06840 and
2104.07857): the host<->device link per GPU (PCIe Gen3/4/5 x16, or NVLink-C2C on Grace
superchips), one host's memory and its bandwidth, its NVMe read and write bandwidth, the
GPUs that share that host, and the host's CPU AdamW rate, which the ranks stepping on it at
once share. For the GPU profiles these are datasheet figures of the reference system (DGX /
HGX, stated per profile); the CPU Adam rate is the host's memory bandwidth at STREAM_EFF
over the ADAM_BYTES a fp32 AdamW step moves per element (the step is memory bound on a
host's many cores). The cpu profile's are measured by
`fivefold calibrate`. The planner's offload model (fivefold.planner.offload) reads them.

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
from fivefold.kernel_tables import (FLASH2_RATE_H100, GB, NEUTRAL, Efficiency, GemmSurface,
                                    h200_surfaces)
from fivefold.published_kernels import (A100_BF16, B200_BF16, B200_FP8, GB200_BF16, GB200_FP8,
                                        V100_FP16, published_gemm_terms)


# DRAM traffic per element of a CPU AdamW step: the fp32 master, gradient and two moments
# read (16 B), master and moments written (12 B). A fused kernel (torch's fused CPU AdamW,
# DeepSpeed's CPU Adam: ZeRO-Offload, arXiv 2101.06840, Sec. 5.1) moves just that; so does
# fivefold's offload step (fivefold.memory.offload: torch's foreach ops over cache-sized
# pieces, whose temporaries stay in cache). Over the host's DRAM bandwidth this is the rate
# of a step that uses all its cores, a ceiling: one stepping thread on a many-core host
# stays below it, which `fivefold calibrate` on that host measures.
ADAM_BYTES = 28
# The share of a host's theoretical DRAM bandwidth a streaming kernel reaches (STREAM triad
# on two-socket servers typically reaches 70-80%); the datasheet CPU Adam rate uses it.
STREAM_EFF = 0.75


@dataclass(frozen=True)
class HostTier:
    """The host side of one device: what offload (fivefold.planner.offload) moves state to.

    link_GBps        host<->device bandwidth per device, one direction (PCIe x16 or C2C)
    link_eff         fraction of it pinned-memory copies reach
    memory_bytes     host memory of one host (DRAM of its CPU sockets)
    memory_GBps      that memory's bandwidth (all channels, theoretical)
    nvme_read_GBps   sequential read bandwidth of one host's local NVMe drives together
    nvme_write_GBps  the same for writes
    gpus             devices that share one host (its memory, drives and CPU)
    adam_elems_per_s fp32 AdamW elements per second the whole host steps; the ranks that
                     step on it at once share it evenly
    source           where the figures come from
    """

    link_GBps: float = 31.5
    link_eff: float = 0.8
    memory_bytes: int = 512 * GB
    memory_GBps: float = 204.8
    nvme_read_GBps: float = 7.0
    nvme_write_GBps: float = 3.8
    gpus: int = 8
    adam_elems_per_s: float = 204.8e9 * STREAM_EFF / ADAM_BYTES
    source: str = ("generic default (a profile file without host figures): one PCIe Gen4 "
                   "x16 link per GPU, one socket of DDR4-3200, one Gen4 NVMe drive, 8 GPUs")

    @property
    def link_Bps(self) -> float:
        """Bytes per second one device reaches to or from its host."""
        return self.link_GBps * 1e9 * self.link_eff


def datasheet_host(link_GBps: float, memory_bytes: int, memory_GBps: float, drives: int,
                   drive_read_GBps: float, drive_write_GBps: float, gpus: int,
                   source: str) -> HostTier:
    """A host from datasheet figures: `drives` NVMe drives striped (RAID-0, their bandwidths
    add), the CPU Adam rate from the memory bandwidth (module docstring)."""
    return HostTier(link_GBps, 0.8, memory_bytes, memory_GBps, drives * drive_read_GBps,
                    drives * drive_write_GBps, gpus,
                    memory_GBps * 1e9 * STREAM_EFF / ADAM_BYTES, source)


PCIE3, PCIE4, PCIE5 = 15.75, 31.5, 63.0  # GB/s per direction of an x16 link (PCI-SIG)
# Gen4 U.2 data-centre drives of these systems (e.g. Samsung PM1733 3.84 TB datasheet: 7.0
# GB/s sequential read, 3.8 GB/s write)
U2_READ, U2_WRITE = 7.0, 3.8
DGX1 = datasheet_host(PCIE3, 512 * 2**30, 2 * 4 * 19.2, 4, 0.53, 0.5, 8,
                      "NVIDIA DGX-1 (V100) datasheet: 2x Xeon E5-2698 v4 (4 channels of "
                      "DDR4-2400 each: 153.6 GB/s), 512 GB, 4x 1.92 TB SATA SSD in RAID-0 "
                      "(about 0.53 / 0.5 GB/s each); PCIe Gen3 x16 per GPU")
DGX_A100_320 = datasheet_host(PCIE4, 1 * 2**40, 2 * 8 * 25.6, 4, U2_READ, U2_WRITE, 8,
                              "NVIDIA DGX A100 320GB datasheet: 2x AMD EPYC 7742 (8 channels "
                              "of DDR4-3200 each: 409.6 GB/s), 1 TB, 15 TB internal = 4x "
                              "3.84 TB U.2 NVMe (Gen4 drive figures); PCIe Gen4 x16 per GPU")
DGX_A100_640 = datasheet_host(PCIE4, 2 * 2**40, 2 * 8 * 25.6, 8, U2_READ, U2_WRITE, 8,
                              "NVIDIA DGX A100 640GB datasheet: 2x AMD EPYC 7742 (409.6 GB/s "
                              "DDR4-3200), 2 TB, 30 TB internal = 8x 3.84 TB U.2 NVMe (Gen4 "
                              "drive figures); PCIe Gen4 x16 per GPU")
DGX_H100 = datasheet_host(PCIE5, 2 * 2**40, 2 * 8 * 38.4, 8, U2_READ, U2_WRITE, 8,
                          "NVIDIA DGX H100/H200 datasheet: 2x Xeon Platinum 8480C (8 channels "
                          "of DDR5-4800 each: 614.4 GB/s), 2 TB, 30 TB internal = 8x 3.84 TB "
                          "U.2 NVMe (Gen4 drive figures); PCIe Gen5 x16 per GPU")
DGX_B200 = datasheet_host(PCIE5, 2 * 2**40, 2 * 8 * 44.8, 8, U2_READ, U2_WRITE, 8,
                          "NVIDIA DGX B200 datasheet: 2x Xeon Platinum 8570 (8 channels of "
                          "DDR5-5600 each: 716.8 GB/s), 2 TB, 30 TB internal = 8x 3.84 TB "
                          "U.2 NVMe (Gen4 drive figures); PCIe Gen5 x16 per GPU")
# Grace superchips: the GPUs reach host memory over NVLink-C2C (900 GB/s total per
# superchip, shared by its two B200s: 225 GB/s per GPU and direction); a compute tray is two
# superchips, each Grace with up to 480 GB LPDDR5X at up to 512 GB/s
GB200_TRAY = datasheet_host(225.0, 960 * GB, 2 * 512.0, 4, 12.0, 5.0, 4,
                            "NVIDIA GB200 NVL72 datasheet: per compute tray 2 Grace CPUs "
                            "(480 GB LPDDR5X at 512 GB/s each) and 4 B200s, NVLink-C2C 900 "
                            "GB/s per superchip; drives assumed 4 E1.S Gen5 NVMe (12 / 5 GB/s "
                            "each, not on the datasheet)")

# The development machine's host tier, `fivefold calibrate --ranks 2` (2026-12-01, while other
# sessions loaded the machine: its copy rate per rank was 0.19 of the idle one above). Host
# and device are one machine there, so the "link" is a copy between host buffers.
CPU_HOST = HostTier(3.79, 1.0, 24 * 2**30, 15.1, 0.774, 0.274, 2, 1.51e8,
                    "`fivefold calibrate --ranks 2` on the 2-core development machine under "
                    "load: host copy 3.79 GB/s per rank, offload's AdamW step (foreach, in "
                    "64Ki pieces) 75 M elements/s per rank (torch's fused kernel: 273 M), a "
                    "scratch file under /tmp: write + fsync 0.274 GB/s, read 0.774 GB/s")


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
    host: HostTier = field(default_factory=HostTier)  # the host and disk tiers (offload)
    architecture: str = "unknown"  # ampere | hopper | blackwell | volta | cpu | unknown
    kernel_source: str = "no kernel measurements: fivefold.kernel_tables.NEUTRAL"
    kernels_measured: bool = False  # its kernel tables were measured on this architecture
    gemm_surfaces: dict[str, GemmSurface] = field(default_factory=dict)  # by dtype
    attention_generations: tuple[tuple[str, float], ...] = (("fa2", 1.0),)

    def peak_flops(self, precision: str) -> float:
        return self.peak_tflops.get(precision, self.peak_tflops["fp32"]) * 1e12

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Hopper: GEMM, attention and copy terms fitted to one H200's measurements (h200_measured.json:
# 30 + 5 bf16 GEMM shapes, 4 causal SDPA shapes, 5 fp8 GEMMs with tensorwise and with rowwise
# scales, a copy) by fivefold.planner.calibrate_fit.fit_h200_reference. Eager element-wise
# passes (3) from that file's HF Llama-1B step: 0.313 s predicted eager, 0.346 s measured
# (compiled, one pass: 0.272 s vs 0.281 s). Latencies: NCCL's per-hop figures on NVLink and
# NDR. H100-SXM, H800 and the power-capped H100-96GB-500W are the same die: the same kernel
# terms, their own datasheet figures (peak, HBM bandwidth, memory).
HOPPER = Efficiency(gemm_eff=0.722, gemm_fp8_eff=0.672, gemm_fp8_rowwise_eff=0.641,
                    gemm_mem_eff=1.0, attn_eff=0.678, attn_score_s=0.0, attn_row_s=3.49e-10,
                    mem_eff=0.883, eltwise_passes=3.0, kernel_overhead_s=9.7e-6,
                    comm_intra_eff=0.80, comm_inter_eff=0.80,
                    latency_intra_s=1.5e-6, latency_inter_s=6e-6, overlap_eff=0.85,
                    reserved_bytes=3 * GB)
H200_SOURCE = ("one H200 measured (docs/reference/h200_measured.json, torch 2.11, 2026-11-29): "
               "GEMM roofline and surface from 35 bf16 and 5 fp8 shapes (tensorwise and "
               "rowwise scales, a rate and surface each), attention terms from 4 causal "
               "SDPA shapes (FlashAttention-3-class), copy rate; "
               "FlashAttention-2-class kernels at 0.565 of it (arXiv 2407.08608 Figs. 5-6, "
               "H100)")

HOPPER_KERNELS = dict(architecture="hopper", kernel_source=H200_SOURCE, kernels_measured=True,
                      gemm_surfaces=h200_surfaces(HOPPER),
                      attention_generations=(("fa2", FLASH2_RATE_H100), ("fa3", 1.0)))
# Ampere (A100). GEMMs: fivefold.published_kernels.A100_BF16 (its rate, 0.869 of peak, and
# surface; fp8 runs at the bf16 rate: no fp8 units). attn_eff: FlashAttention-2 on A100, up to
# 73% of peak (arXiv 2307.08691, abstract: 50-73%); its per-shape fall-off not modelled (no
# per-shape figures). Link efficiencies, overlap and NIC aggregation are
# fivefold.planner.fitted's (the values here are overridden).
A100_PEAK = {"bf16": 312, "fp16": 312, "fp8": 312, "fp32": 19.5}
AMPERE_BASE = Efficiency(gemm_mem_eff=1.0, attn_eff=0.73, attn_score_s=0.0, attn_row_s=0.0,
                         mem_eff=0.80, eltwise_passes=1.0, kernel_overhead_s=6e-6,
                         comm_intra_eff=0.90, comm_inter_eff=0.85, latency_intra_s=1.5e-6,
                         latency_inter_s=6e-6, overlap_eff=0.70, nic_aggregation=0.06,
                         reserved_bytes=3 * GB)
AMPERE, A100_40GB_SURFACES = published_gemm_terms((A100_BF16,), A100_PEAK, 1555, AMPERE_BASE)
A100_80GB_SURFACES = published_gemm_terms((A100_BF16,), A100_PEAK, 2039, AMPERE_BASE)[1]
AMPERE_KERNELS = dict(
    architecture="ampere", kernels_measured=True, attention_generations=(("fa2", 1.0),),
    kernel_source="published: FlashAttention-2 at 73% of peak on A100 (arXiv 2307.08691, "
                  "abstract); GEMMs: " + A100_BF16.source)
# Blackwell: attention from FlashAttention-4's abstract (module docstring): cuDNN 9.13 at up to
# 1.3x below FA4's 71% of peak; GEMMs published per GPU (fivefold.published_kernels); no
# element-wise measurement: NEUTRAL's terms.
B200_PEAK = {"bf16": 2250, "fp16": 2250, "fp8": 4500, "fp32": 75}
GB200_PEAK = {"bf16": 2500, "fp16": 2500, "fp8": 5000, "fp32": 80}
BLACKWELL_BASE = dataclasses.replace(NEUTRAL, attn_eff=0.71 / 1.3)
B200_EFF, B200_SURFACES = published_gemm_terms((B200_BF16, B200_FP8), B200_PEAK, 8000,
                                               BLACKWELL_BASE)
GB200_EFF, GB200_SURFACES = published_gemm_terms((GB200_BF16, GB200_FP8), GB200_PEAK, 8000,
                                                 BLACKWELL_BASE)


def blackwell_kernels(gemms: str, surfaces: dict[str, GemmSurface]) -> dict:
    return dict(
        architecture="blackwell", kernels_measured=False, attention_generations=(("fa3", 1.0),),
        gemm_surfaces=surfaces,
        kernel_source="GEMMs published: " + gemms + "; attention published: cuDNN 9.13 fused "
                      "attention on B200 at 0.71 / 1.3 of peak (FlashAttention-4, Zadouri et "
                      "al.: up to 1613 TFLOP/s, 71%, up to 1.3x over cuDNN 9.13; abstract); no "
                      "element-wise kernel measurements: fivefold.kernel_tables.NEUTRAL; no "
                      "FlashAttention-2-class figure on Blackwell, so every generation runs at "
                      "that rate; no rowwise-scaled fp8 GEMM table published: rowwise-scaled "
                      "fp8 GEMMs run at the fp8 table's rate and surface")


V100_PEAK = {"fp16": 125, "bf16": 125, "fp32": 15.7}
VOLTA, V100_SURFACES = published_gemm_terms((V100_FP16,), V100_PEAK, 900, NEUTRAL)
VOLTA_KERNELS = dict(architecture="volta", kernels_measured=False, gemm_surfaces=V100_SURFACES,
                     kernel_source="GEMMs published: " + V100_FP16.source + "; no attention or "
                                   "element-wise kernel measurements: "
                                   "fivefold.kernel_tables.NEUTRAL")

# Device memory as the device reports it: a datasheet's "80 GB" of HBM is binary-sized.
# nvidia-smi's totals, collected across GPU types in modal-labs/modal-client PR #2797
# (2025-01): H100 80GB 81,559 MiB (85.5e9 bytes), A100 80GB 81,920 MiB, A100 40GB 40,960 MiB;
# the H800 carries the H100's memory. For the other GPUs no reported total is at hand: their
# datasheet figure is taken in GiB (the H100 reports 0.4% less than its 80 GiB).
MIB, GIB = 2**20, 2**30
H100_MIB, A100_80GB_MIB, A100_40GB_MIB = 81559, 81920, 40960

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in [
    HardwareProfile("V100-32GB", V100_PEAK, 32 * GIB, 900, 150,
                    12.5, "NVIDIA V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor (no bf16 units;"
                    " the fp16 rate is used), 900 GB/s HBM2, NVLink2 300 GB/s total; one "
                    "100 Gb/s EDR NIC per GPU", VOLTA, host=DGX1, **VOLTA_KERNELS),
    HardwareProfile("A100-40GB", A100_PEAK,
                    A100_40GB_MIB * MIB, 1555, 300, 25, "NVIDIA A100 SXM4 datasheet: 312 TFLOP/s bf16, "
                    "1555 GB/s HBM2, NVLink3 600 GB/s total; DGX A100: one 200 Gb/s HDR NIC "
                    "per GPU (no fp8 units: fp8 runs at the bf16 rate)", AMPERE,
                    host=DGX_A100_320, gemm_surfaces=A100_40GB_SURFACES, **AMPERE_KERNELS),
    HardwareProfile("A100-80GB", A100_PEAK,
                    A100_80GB_MIB * MIB, 2039, 300, 25, "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s "
                    "bf16, 2039 GB/s HBM2e, NVLink3 600 GB/s total; DGX A100: one 200 Gb/s "
                    "HDR NIC per GPU", AMPERE, host=DGX_A100_640, gemm_surfaces=A100_80GB_SURFACES,
                    **AMPERE_KERNELS),
    HardwareProfile("H100-SXM", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67},
                    H100_MIB * MIB, 3350, 450, 50, "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 1979 "
                    "fp8, 3.35 TB/s HBM3, NVLink4 900 GB/s total; DGX H100: one 400 Gb/s NDR "
                    "NIC per GPU", HOPPER, host=DGX_H100, **HOPPER_KERNELS),
    HardwareProfile("H100-96GB-500W", {"bf16": 912, "fp16": 912, "fp8": 1824, "fp32": 62},
                    96 * GIB, 2400, 450, 50, "Meta Grand Teton H100 (the torchtitan paper's "
                    "runs, arXiv 2410.06511): 96 GB HBM2e at 2.4 TB/s, TDP capped at 500 W, "
                    "whose sustained peak the paper places between H100 SXM (989 TFLOP/s bf16 "
                    "dense) and H100 NVL (835): taken as the midpoint, 912; NVLink4 900 GB/s "
                    "total; one 400 Gb/s NIC per GPU (host: DGX H100's figures, assumed)", HOPPER,
                    host=DGX_H100, **HOPPER_KERNELS),
    HardwareProfile("H800", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67},
                    H100_MIB * MIB, 3350, 200, 50, "NVIDIA H800 SXM5: H100 compute and memory, NVLink cut to 400 GB/s "
                    "total; 400 Gb/s IB per GPU (DeepSeek-V3 report, arXiv 2412.19437 Sec. "
                    "3.2); host: the HGX H100 platform's (DGX H100 figures)", HOPPER,
                    host=DGX_H100, **HOPPER_KERNELS),
    HardwareProfile("H200", {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}, 141 * GIB,
                    4800, 450, 50, "NVIDIA H200 SXM datasheet: H100 compute, 141 GB HBM3e at "
                    "4.8 TB/s, NVLink4 900 GB/s total; 400 Gb/s NDR NIC per GPU", HOPPER,
                    host=DGX_H100, **HOPPER_KERNELS),
    HardwareProfile("B200", B200_PEAK, 180 * GIB,
                    8000, 900, 50, "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s bf16 dense, 4.5 fp8, "
                    "180 GB HBM3e at 8 TB/s, NVLink5 1.8 TB/s total; DGX B200: one 400 Gb/s "
                    "NIC per GPU", B200_EFF, host=DGX_B200,
                    **blackwell_kernels(B200_BF16.source + "; " + B200_FP8.source,
                                        B200_SURFACES)),
    HardwareProfile("GB200", GB200_PEAK, 186 * GIB,
                    8000, 900, 50, "NVIDIA GB200 NVL72 datasheet: per GPU 2.5 PFLOP/s bf16 "
                    "dense, 5 fp8, 186 GB HBM3e at 8 TB/s, NVLink5 1.8 TB/s total in a 72-GPU "
                    "domain; compute tray: 4 GPUs, 4 ConnectX-7 400 Gb/s NICs", GB200_EFF, 72,
                    host=GB200_TRAY,
                    **blackwell_kernels(GB200_BF16.source + "; " + GB200_FP8.source,
                                        GB200_SURFACES)),
    HardwareProfile("cpu", {"fp32": 0.1055, "bf16": 0.0009, "fp16": 0.0009}, 24 * 2**30, 38.1,
                    1.54, 1.54, "`fivefold calibrate` on the idle 2-core development machine "
                    "(one thread, 2026-11-30; no bf16 units: a bf16 matmul ran at 0.9 GFLOP/s); rerun "
                    "it on your machine",
                    Efficiency(gemm_eff=0.975, gemm_fp8_eff=0.975, gemm_mem_eff=1.0,
                               attn_eff=1.0, attn_score_s=1.58e-9, mem_eff=1.0,
                               eltwise_passes=3.0, kernel_overhead_s=9.16e-5,
                               comm_intra_eff=1.0, comm_inter_eff=1.0, latency_intra_s=7.1e-4,
                               latency_inter_s=7.1e-4, overlap_eff=0.0, reserved_bytes=0),
                    2, 2, CPU_HOST, architecture="cpu", kernels_measured=True,
                    kernel_source="`fivefold calibrate` on this machine (GEMM, SDPA, copy, "
                                  "exp of -inf and gloo probes)"),
]}


def profile_from_dict(data: dict, where: str = "profile") -> HardwareProfile:
    """A profile from its JSON form (what `fivefold calibrate` writes, or a profile's
    `to_dict`); ConfigError if bad. A file without kernel fields is an unknown architecture
    whose kernel_source says where its Efficiency came from only if the file does."""
    try:
        eff = Efficiency(**data.get("eff", {}))
        host = HostTier(**data.get("host", {}))  # files from before the host tier: defaults
        fields = {k: v for k, v in data.items()
                  if k not in ("eff", "host", "gemm_surfaces", "attention_generations")}
        surfaces = {dtype: GemmSurface(tuple(tuple(p) for p in s["points"]), s["source"])
                    for dtype, s in data.get("gemm_surfaces", {}).items()}
        generations = tuple(tuple(g) for g in data.get("attention_generations", [("fa2", 1.0)]))
        profile = HardwareProfile(**fields, eff=eff, host=host, gemm_surfaces=surfaces,
                                  attention_generations=generations)
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

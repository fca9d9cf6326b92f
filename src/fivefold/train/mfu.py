"""Model FLOPs utilization (MFU, PaLM, arXiv 2204.02311, appendix B): the model's FLOPs per
second over the peak of the profile a figure is measured against, and which profile that is.

On a GPU the peak is that GPU's profile (fivefold.hardware, detected, or `cluster.gpu`). On
the CPU a built-in figure would describe some other machine (the cpu profile is the
development machine's), so MFU is measured only against a profile file the user calibrated on
this machine (`fivefold calibrate --out FILE`, then `cluster.gpu = FILE`), and not at all
otherwise. Every figure carries its profile's label (`mfu_profile` in metrics.jsonl).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fivefold.hardware import PROFILES
from fivefold.train.dist import detect_profile


@dataclass(frozen=True)
class MfuPeak:
    flops: float  # the peak FLOP/s of all ranks together
    profile: str  # which profile: its name, or "cpu-calibrated: FILE"


def mfu_peak(device: torch.device, cluster_gpu: str | None, precision: str,
             world_size: int) -> MfuPeak | None:
    """The peak MFU is measured against on `device`, or None where there is none to trust."""
    calibrated = cluster_gpu is not None and cluster_gpu not in PROFILES
    if device.type == "cpu" and not calibrated:
        return None
    profile = detect_profile(device, cluster_gpu)
    if profile is None:
        return None
    # one device per GPU rank; on the CPU the profile's rate is per core (one thread per
    # rank), and the ranks share the machine's cores
    devices = world_size if device.type == "cuda" else (os.cpu_count() or 1)
    label = (f"{'cpu-' if device.type == 'cpu' else ''}calibrated: {cluster_gpu}" if calibrated
             else profile.name)
    return MfuPeak(profile.peak_flops(precision) * devices, label)


def mfu_note(peak: MfuPeak | None, device: torch.device) -> str | None:
    """The start-up note on what MFU is measured against, or None when it is a GPU's own."""
    if peak is None and device.type == "cpu":
        return ("mfu: not measured on the CPU without a profile of this machine (`fivefold "
                "calibrate --out FILE`, then --set cluster.gpu=FILE)")
    if peak is None:
        return "mfu: not measured (no profile for this GPU; name one with cluster.gpu)"
    return None

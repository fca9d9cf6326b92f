"""Process-group set-up: one `Runtime` per rank says who it is and where it computes.

Ranks are started by `torch.distributed.run` (locally through `fivefold train --nproc N`, or
with `torchrun` on many nodes), which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
address. The backend is NCCL when the rank has a GPU and gloo otherwise. Every collective
carries the configured timeout, so a rank that dies or hangs fails the others instead of
leaving them waiting forever. A single process without those variables runs with no process
group at all (world size 1).

`detect_profile` asks torch which device this is and looks its hardware profile up
(fivefold.hardware, which stays torch-free for the planner). A CPU rank keeps its freed memory
in its heap for the next step (fivefold.host_heap).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.config import ConfigError
from fivefold.hardware import HardwareProfile, device_profile, load_profile
from fivefold.host_heap import keep_host_heap


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(choice: str, local_rank: int) -> torch.device:
    """"auto" takes this rank's GPU when there is one, else the CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device = 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def detect_profile(device: torch.device, name: str | None = None) -> HardwareProfile | None:
    """The named profile (or profile file), or the one matching this device; None if unknown."""
    if name is not None:
        try:
            return load_profile(name)
        except ConfigError:
            return None
    if device.type == "cpu":
        return device_profile("cpu")
    return device_profile(torch.cuda.get_device_name(device),
                          torch.cuda.get_device_properties(device).total_memory)


def init_runtime(device: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Join the process group the launcher described (if any) and pick the device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        keep_host_heap()
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return Runtime(rank, world_size, local_rank, dev)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

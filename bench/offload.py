"""Optimizer offload on this machine: device-resident bytes and step time for offload none /
cpu / nvme on one fixed model, and the CPU Adam kernels side by side.

    OMP_NUM_THREADS=1 python bench/offload.py [--steps 6] [--elements 16777216]
        [--deepspeed-python /tmp/ds-venv/bin/python]

Part 1, one rank, ZeRO stage 1 (so every run takes the data-parallel engine), the built-in
corpus, fp32: per offload tier and CPU kernel (`parallel.offload_kernel`) the ledger's
model-state bytes (device total, host, disk) after a step, the median `Trainer.train_step`
wall time after two warm-up steps, and `fivefold.planner.simulate`'s predicted step time of
the same config on the built-in "cpu" profile, printed as simulate returns it (whether it
models offload is the planner's business). On a CPU-only machine "device" and "host" are the
same memory: the device column says what a GPU would no longer hold, the time says what the
host-side step and copies cost, not what PCIe would.

Part 2, one AdamW update of `--elements` fp32 parameters, median of 5 after a warm-up:
fivefold's offloaded step (fivefold.memory.offload.chunked_adamw_: torch's foreach kernel in
pieces of 65,536 elements, bit for bit the in-memory engine's AdamW), torch's single-tensor
("for-loop") and fused CPU AdamW, the same update streamed through the disk tier
(fivefold.memory.nvme_store, chunked reads and writes on threads, files in a temporary
directory), and DeepSpeed's CPU Adam (DeepSpeedCPUAdam, adamw_mode) when
`--deepspeed-python` names an interpreter where it imports, run there as a child process (its
extension builds on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile

import torch

import harness
from fivefold.config import TrainConfig, load_config
from fivefold.memory.nvme_store import NvmeStore
from fivefold.memory.offload import chunked_adamw_, cpu_adamw_
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import prepare
from fivefold.train.data import prepare_data
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

BASE = ["data.tokenizer_sample_mib=0.5", "train.tensorboard=false", "train.sample_tokens=0",
        "parallel.global_batch=8", "parallel.zero_stage=1", "model.layers=8",
        "model.hidden=384", "model.heads=6", "model.kv_heads=2", "model.ffn_hidden=1024"]
CPU = Runtime(0, 1, 0, torch.device("cpu"))
DEEPSPEED = """
import statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
n = int(sys.argv[1])
p = torch.nn.Parameter(torch.randn(n) * 0.02)
p.grad = torch.randn(n) * 1e-3
opt = DeepSpeedCPUAdam([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                       adamw_mode=True)
opt.step()
times = []
for _ in range(5):
    start = time.perf_counter(); opt.step(); times.append(time.perf_counter() - start)
print(statistics.median(times))
"""


def tiers(steps: int, nvme_dir: str) -> list[dict]:
    out = []
    for offload, kernel in (("none", "foreach"), ("cpu", "foreach"), ("cpu", "fused"),
                            ("nvme", "foreach"), ("nvme", "fused")):
        sets = BASE + [f"parallel.offload={offload}", f"parallel.offload_path='{nvme_dir}'",
                       f"parallel.offload_kernel={kernel}"]
        cfg = load_config(None, sets)
        prepare_data(cfg)
        trainer = Trainer(cfg, CPU, tempfile.mkdtemp())
        times = [trainer.train_step(s).step_time_s for s in range(steps)]
        trainer.engine.wait_updates()
        states = trainer.ledger.model_state_bytes
        spec = prepare(load_config(None, sets + ["cluster.gpu='cpu'", "cluster.gpus=1",
                                                 "cluster.gpus_per_node=1"]))
        out.append({"offload": offload if offload == "none" else f"{offload} ({kernel})",
                    "device_bytes": states["total"],
                    "host_bytes": states.get("host", 0), "disk_bytes": states.get("disk", 0),
                    "step_time_s": statistics.median(times[2:]),
                    "predicted_step_time_s": simulate(spec).step_time_s})
    return out


def adam_kernels(n: int, deepspeed_python: str | None) -> dict[str, float | str]:
    train = TrainConfig(lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    master, grad = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out: dict[str, float | str] = {
        "fivefold cpu tier (torch foreach, 64Ki chunks)": harness.median_seconds(
            lambda: chunked_adamw_(master, grad, exp_avg, exp_avg_sq, 1, 1e-3, train, []))}
    param = torch.nn.Parameter(master.clone())
    param.grad = grad.clone()
    for name, kwargs in (("torch AdamW single-tensor", {"foreach": False}),
                         ("torch AdamW foreach", {"foreach": True}),
                         ("torch AdamW fused (CPU)", {"fused": True})):
        opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.0, **kwargs)
        out[name] = harness.median_seconds(opt.step)
    with tempfile.TemporaryDirectory() as directory:
        store = NvmeStore(directory, [("unit", n)])

        def streamed():
            store.update_unit("unit", lambda a, b, avg, avg_sq: cpu_adamw_(
                master[a:b], grad[a:b], avg, avg_sq, 1, 1e-3, train, []))
            store.commit(store.updates + 1)
        out["fivefold nvme tier (streamed, fsync)"] = harness.median_seconds(streamed)
        store.close()
    if deepspeed_python:
        proc = subprocess.run([deepspeed_python, "-c", DEEPSPEED, str(n)], capture_output=True,
                              text=True, env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin",
                                              "OMP_NUM_THREADS": str(torch.get_num_threads())})
        out["DeepSpeed CPU Adam"] = (float(proc.stdout.split()[-1]) if proc.returncode == 0
                                     else f"failed: {proc.stderr.strip().splitlines()[-1]}")
    else:
        out["DeepSpeed CPU Adam"] = "not run (--deepspeed-python)"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--elements", type=int, default=1 << 24)
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as nvme_dir:
        rows = tiers(args.steps, nvme_dir)
    kernels = adam_kernels(args.elements, args.deepspeed_python)
    if args.json:
        print(json.dumps({"tiers": rows, "adam_s": kernels, "threads": torch.get_num_threads()}))
        return
    print(f"torch threads: {torch.get_num_threads()}")
    print("| offload | device MiB | host MiB | disk MiB | step s (measured) | step s (simulate) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['offload']} | {r['device_bytes'] / 2**20:.2f} | {r['host_bytes'] / 2**20:.2f}"
              f" | {r['disk_bytes'] / 2**20:.2f} | {r['step_time_s']:.3f} | "
              f"{r['predicted_step_time_s']:.3f} |")
    print(f"\n| AdamW update of {args.elements} fp32 parameters | s | vs fivefold |")
    print("|---|---:|---:|")
    ours = kernels["fivefold cpu tier (torch foreach, 64Ki chunks)"]
    for name, value in kernels.items():
        ratio = f"{value / ours:.2f}x" if isinstance(value, float) else "-"
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"| {name} | {shown} | {ratio} |")


if __name__ == "__main__":
    main()

"""`fivefold calibrate`: measure this machine and write a hardware profile file.

Measures, on the local device (CPU by default, or this rank's GPU):
- GEMM rates over a grid of shapes (each GEMM with its weight out of the caches and its
  activation in them, as in a training step), then fits the compute model's GEMM roofline
  (fivefold.planner.compute.gemm_time: peak * gemm_eff, HBM * gemm_mem_eff, a fixed
  kernel overhead) to them by least squares on log time (`fit_gemm`), and writes the
  measured time over that roofline per shape as the profile's GEMM surface
  (fivefold.kernel_tables.GemmSurface);
- causal fused attention (SDPA) forward and forward+backward, fitted to the attention model
  (`attn_eff`, the per-score and per-row costs, `fit_attention`);
- memory bandwidth (a large tensor copy) for element-wise ops and the optimizer, and the
  extra cost of exp on -inf inputs (`masked_exp_s`: fp32 rows half masked against ordinary
  ones);
- all-reduce bandwidth and latency across `--ranks` local gloo processes (the "intra-node"
  link of this machine), and on a CPU each other collective's rate against the ring model at
  that bandwidth (`reduce_scatter_eff`, `all_gather_eff`, `all_to_all_eff`:
  fivefold.planner.comm);
- the host and disk tiers of offload (fivefold.hardware.HostTier): the host<->device copy
  rate (pinned host to GPU and back; on a CPU a copy between two host buffers), torch's CPU
  AdamW on a flat fp32 buffer as fivefold.memory.offload runs it (foreach ops piece by
  piece; the fused CPU kernel's rate, where it runs, goes into the source line), and file
  write + fsync and read bandwidth of a scratch file under `--offload-path` (else the
  system's temporary directory), dropped from the page cache before it is read back
  (posix_fadvise DONTNEED), so the read comes from the drive (`measure_storage`).
The GEMM, attention and copy probes run in interleaved sweeps, each one's time the median
over them (`_sweeps`). On a CPU with one thread per rank (as every multi-rank CPU run has)
each probe is timed in the process's CPU time, what it takes while it runs, and the rates
are then multiplied by the share of its core the process held over the sweeps (CPU time
over wall time): ranks time-sliced on shared cores, or beside other jobs, sustain only that
share over a training step, while a probe's wall time catches a slice at full speed or not
by chance (fivefold.planner.calibrate_fit.slowed_profile). On a CPU the `--ranks` processes
measure all at once, one thread each, so the rates are what each rank of a `--nproc` run
gets on this machine (shared memory bus, caches and cores); the profile's `cores` says for
how many ranks they hold (more ranks split them evenly).
The profile file (JSON of fivefold.hardware.HardwareProfile) is accepted by
`--set cluster.gpu=PATH`. The fits live in fivefold.planner.calibrate_fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from fivefold.hardware import Efficiency, HardwareProfile, HostTier, device_profile
from fivefold.kernel_tables import gemm_surface, roofline_gemm_s
from fivefold.planner.calibrate_fit import _lstsq_pos, fit_attention, fit_gemm, slowed_profile

GEMM_SHAPES_CPU = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (256, 1024, 256),
                   (2048, 256, 704), (2048, 704, 256), (512, 256, 8192), (1024, 2048, 512)]
GEMM_SHAPES_GPU = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 2048, 2048),
                   (16384, 4096, 14336), (16384, 14336, 4096), (2048, 1024, 1024),
                   (8192, 4096, 1024), (16384, 8192, 28672)]
ATTN_SHAPES_CPU = [(2, 4, 256, 32), (1, 8, 512, 32), (4, 8, 128, 64)]
ATTN_SHAPES_GPU = [(8, 16, 2048, 128), (4, 32, 4096, 128), (1, 32, 16384, 128),
                   (16, 16, 2048, 64)]
EVICT_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}  # above the last-level cache


# ------------------------------------------------------------------ measuring

def _timeit(fn, sync, repeat: int, before=None, clock=None) -> float:
    """Median seconds of `fn` over `repeat` calls after one warm-up, by `clock` (default the
    wall clock); `before`, when given, runs untimed ahead of each call."""
    clock = clock or time.perf_counter
    fn()
    sync()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
            sync()
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return sorted(times)[len(times) // 2]


def _sweeps(probes: dict, sync, repeat: int, passes: int, clock=None) -> dict:
    """Each probe's median time over `passes` sweeps through all the probes (a sweep's value
    for a probe is the median of `repeat` calls). A shared machine's speed moves by tens of
    percent within seconds (on the 2-core development machine one 1024^3 GEMM on each of two
    ranks ran between 68 and 92 GFLOP/s over 20 s), so measuring each shape at one moment
    makes the fitted curve a snapshot of that moment; sweeping spreads every shape's samples
    over the whole run. A probe is `(fn, before)`, `before` (or None) run untimed ahead of
    each call."""
    times: dict = {key: [] for key in probes}
    for _ in range(passes):
        for key, (fn, before) in probes.items():
            times[key].append(_timeit(fn, sync, repeat, before, clock))
    return {key: statistics.median(t) for key, t in times.items()}


def measure_device(device_type: str = "cpu", threads: int | None = None,
                   repeat: int = 5, passes: int = 5) -> dict:
    """Raw measurements of this device: GEMMs, attention, copy bandwidth, op overhead; the
    GEMM, attention and copy probes in `passes` interleaved sweeps (`_sweeps`), each GEMM
    with its weight operand out of the caches and its activation operand in them."""
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device_type)
    dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    # a training step's GEMM meets its activation just written by the op before it and its
    # weight, last touched a block ago, out of the caches; a loop over one product finds
    # both in cache, and on this CPU the tiny preset's block GEMMs ran 0-20% (mostly 10-15%)
    # faster that way than with both evicted. So each GEMM runs after a write over a buffer
    # larger than the last-level cache and then a write of its activation operand.
    flush = torch.empty(EVICT_BYTES[device_type] // 4, device=dev)
    probes = {}
    gemm_shapes = GEMM_SHAPES_CPU if device_type == "cpu" else GEMM_SHAPES_GPU
    for M, K, N in gemm_shapes:
        a = torch.randn(M, K, device=dev, dtype=dtype)
        b = torch.randn(K, N, device=dev, dtype=dtype)
        probes["gemm", M, K, N] = (lambda a=a, b=b: a @ b,
                                   lambda a=a: (flush.add_(1.0), a.mul_(1.0)))
    attn_shapes = ATTN_SHAPES_CPU if device_type == "cpu" else ATTN_SHAPES_GPU
    for shape in attn_shapes:
        q, k, v = (torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        probes["fwd", *shape] = (lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), None)
        probes["both", *shape] = (lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True).sum().backward(), None)
    n = (64 if device_type == "cpu" else 1024) * 2**20
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    probes["copy"] = (lambda: y.copy_(x), None)
    # exp over fp32 rows whose second half is -inf (a causal block's masked scores) against
    # exp over ordinary values: the extra cost per masked element
    scores = torch.randn(1024, 2048, device=dev)
    masked = scores.clone()
    masked[:, 1024:] = float("-inf")
    out = torch.empty_like(scores)
    probes["exp"] = (lambda: torch.exp(scores, out=out), None)
    probes["exp_masked"] = (lambda: torch.exp(masked, out=out), None)
    # one thread on a CPU: each probe timed in the process's CPU time, what it takes while it
    # runs, and the share of the core it held over the sweeps measured apart (module docstring)
    sliced = device_type == "cpu" and torch.get_num_threads() == 1
    clock = time.process_time if sliced else None
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    t = _sweeps(probes, sync, repeat, passes, clock)
    cpu_share = min(1.0, (time.process_time() - cpu_start)
                    / (time.perf_counter() - wall_start)) if sliced else 1.0
    masked_exp_s = max(0.0, (t["exp_masked"] - t["exp"]) / (masked.numel() / 2))
    gemms = [(M, K, N, t["gemm", M, K, N]) for M, K, N in gemm_shapes]
    attn = [(*shape, t["fwd", *shape], t["both", *shape]) for shape in attn_shapes]
    small = torch.ones(8, device=dev)
    op_s = _timeit(lambda: [small.add_(1.0) for _ in range(100)], sync, repeat,
                   clock=clock) / 100
    adam, adam_fused = measure_cpu_adam(repeat), measure_cpu_adam(repeat, "fused")
    host_copy, host_link = measure_host_copies(device_type, sync, repeat)
    name = torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu"
    return {"device": device_type, "device_name": name, "threads": torch.get_num_threads(),
            "elem_bytes": torch.finfo(dtype).bits // 8, "gemms": gemms, "attention": attn,
            "cpu_share": cpu_share,
            "copy_Bps": 2 * n / t["copy"], "op_overhead_s": op_s, "masked_exp_s": masked_exp_s,
            "host_copy_Bps": host_copy, "host_link_Bps": host_link,
            "adam_elems_per_s": adam, "adam_fused_elems_per_s": adam_fused}


def measure_host_copies(device_type: str, sync, repeat: int) -> tuple[float, float]:
    """(host memory traffic of a copy between two host buffers, read + write bytes per
    second; host<->device bytes per second, the slower direction between pinned host memory
    and the GPU, or on a CPU the host copy itself: what offload's transfers become there)."""
    import torch

    n = 64 * 2**20
    x, y = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    host_s = _timeit(lambda: y.copy_(x), lambda: None, repeat)
    if device_type == "cpu":
        return 2 * n / host_s, n / host_s
    pinned = x.pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=device_type)
    up = _timeit(lambda: dev.copy_(pinned, non_blocking=True), sync, repeat)
    down = _timeit(lambda: pinned.copy_(dev, non_blocking=True), sync, repeat)
    return 2 * n / host_s, n / max(up, down)


ADAM_PIECE = 1 << 16  # elements per piece of the offload step (fivefold.memory.offload)


def measure_cpu_adam(repeat: int, kernel: str = "foreach", numel: int = 4 * 2**20
                     ) -> float | None:
    """Elements per second of an AdamW step on one flat fp32 CPU buffer of `numel` elements:
    "foreach" as fivefold.memory.offload runs it (the decoupled decay multiply, then torch's
    foreach Adam, piece by piece of ADAM_PIECE elements), "fused" torch's fused CPU kernel
    over the whole buffer; None where this torch has no such kernel."""
    import torch
    from torch.optim.adam import adam

    master, grad = torch.zeros(numel), torch.full((numel,), 1e-3)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    if kernel == "foreach":
        def step():
            for start in range(0, numel, ADAM_PIECE):
                piece = slice(start, start + ADAM_PIECE)
                master[piece].mul_(1.0 - 1e-5)
                adam([master[piece]], [grad[piece]], [exp_avg[piece]], [exp_avg_sq[piece]],
                     [], [torch.tensor(1.0)], foreach=True, amsgrad=False, beta1=0.9,
                     beta2=0.95, lr=1e-3, weight_decay=0.0, eps=1e-8, maximize=False)

        return numel / _timeit(step, lambda: None, repeat)
    param = torch.nn.Parameter(master)
    param.grad = grad
    try:
        opt = torch.optim.AdamW([param], lr=1e-3, **{kernel: True})
        opt.step()
    except (RuntimeError, TypeError):
        return None
    return numel / _timeit(opt.step, lambda: None, repeat)


def measure_storage(directory: str | None, nbytes: int = 128 * 2**20) -> tuple[float, float]:
    """(write + fsync, read) bytes per second of one scratch file in `directory` (default:
    the system's temporary directory), written and read in 8 MiB blocks; the file is dropped
    from the page cache before the read and deleted after."""
    import tempfile

    block = os.urandom(8 * 2**20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="fivefold-calibrate-") as f:
        fd = f.fileno()
        start = time.perf_counter()
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, len(block)):
            pass
        read_s = time.perf_counter() - start
    return nbytes / write_s, nbytes / read_s


def _measure_worker(rt, threads: int | None) -> dict:
    return measure_device("cpu", threads)


def _collective_worker(rt, sizes: list[int], repeat: int) -> dict[str, list[float]]:
    """Mean seconds of gloo's all-reduce over `sizes` (bytes) and of its reduce-scatter,
    all-gather and all-to-all on the largest, after one warm-up call each (ledger byte
    convention: the full input of a reduce-scatter, the full output of an all-gather)."""
    import torch
    import torch.distributed as dist

    from fivefold.comm.collectives import _all_gather_flat, _reduce_scatter_flat

    n = dist.get_world_size()

    def timed(call) -> float:
        call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeat):
            call()
        return (time.perf_counter() - start) / repeat

    out = {"all_reduce": [timed(lambda x=torch.ones(b // 4): dist.all_reduce(x))
                          for b in sizes]}
    part = torch.empty(sizes[-1] // 4 // n)  # whole: n parts (gloo checks; any rank count)
    whole, other = torch.ones(part.numel() * n), torch.empty(part.numel() * n)
    out["reduce_scatter"] = [timed(lambda: _reduce_scatter_flat(part, whole))]
    out["all_gather"] = [timed(lambda: _all_gather_flat(other, part))]
    out["all_to_all"] = [timed(lambda: dist.all_to_all_single(other, whole))]
    return out


def measure_collectives(ranks: int, repeat: int = 5) -> tuple[float, float, dict[str, float]]:
    """(bytes/s, per-hop latency s) of gloo ring all-reduce across `ranks` local processes,
    and the reduce-scatter's, all-gather's and all-to-all's bandwidth over what the ring
    model (fivefold.planner.comm) gives them at that rate, on 16 MiB."""
    from fivefold import local_ranks
    from fivefold.host_heap import keep_host_heap

    sizes = [4096, 1 << 20, 16 << 20]
    times = local_ranks.run_local(_collective_worker, ranks, sizes, repeat,
                                  prepare=keep_host_heap)[0]
    hops, factor = 2 * (ranks - 1), 2 * (ranks - 1) / ranks
    # t = factor * bytes / bw + hops * latency: two unknowns from the small and large sizes
    inv_bw, lat = _lstsq_pos([[factor * s, hops] for s in sizes], times["all_reduce"])
    bw = 1.0 / max(inv_bw, 1e-15)
    ring = (ranks - 1) / ranks * sizes[-1] / bw  # each op's bandwidth term in the model
    effs = {op: ring / max(times[op][0] - (ranks - 1) * lat, 0.05 * ring)
            for op in ("reduce_scatter", "all_gather", "all_to_all")}
    return bw, lat, effs


def profile_from_measurements(name: str, m: dict, link: tuple[float, float, dict] | None,
                              memory_bytes: int, cores: int, host_memory_bytes: int,
                              storage: tuple[float, float]) -> HardwareProfile:
    peak = max(2 * M * K * N / t for M, K, N, t in m["gemms"])
    hbm = m["copy_Bps"]
    e, mem_e, overhead = fit_gemm(m["gemms"], peak, hbm, m["elem_bytes"])
    ae, score, row = fit_attention(m["attention"], peak)
    bw, lat, op_effs = link or (hbm / 4, 5e-5, {})
    if m["device"] != "cpu":  # the local ranks measured gloo; a GPU's collectives are NCCL's
        op_effs = {}
    precision = "fp32" if m["elem_bytes"] == 4 else "bf16"
    peaks = {"fp32": peak / 1e12} if precision == "fp32" else {
        "bf16": peak / 1e12, "fp16": peak / 1e12, "fp32": peak / 8e12}
    eff = Efficiency(gemm_eff=min(1.0, e), gemm_fp8_eff=min(1.0, e), gemm_mem_eff=mem_e,
                     attn_eff=min(1.0, ae), attn_score_s=score, attn_row_s=row,
                     mem_eff=1.0,
                     eltwise_passes=3.0, kernel_overhead_s=max(overhead, m["op_overhead_s"]),
                     comm_intra_eff=1.0, comm_inter_eff=1.0, latency_intra_s=lat,
                     latency_inter_s=lat, overlap_eff=0.0 if m["device"] == "cpu" else 0.85,
                     masked_exp_s=m["masked_exp_s"],
                     **{f"{op}_eff": eff for op, eff in op_effs.items()},
                     reserved_bytes=0)
    write_Bps, read_Bps = storage
    host = HostTier(link_GBps=m["host_link_Bps"] / 1e9, link_eff=1.0,
                    memory_bytes=host_memory_bytes,
                    memory_GBps=m["host_copy_Bps"] * max(cores, 1) / 1e9,  # all ranks
                    nvme_read_GBps=read_Bps / 1e9, nvme_write_GBps=write_Bps / 1e9,
                    gpus=max(cores, 1),  # the ranks measured at once: the host's rate
                    adam_elems_per_s=m["adam_elems_per_s"] * max(cores, 1),
                    source=f"measured by `fivefold calibrate`: host copies, a scratch file's "
                           f"write + fsync and read, torch's foreach CPU AdamW (offload's "
                           f"kernel; fused: {_rate(m['adam_fused_elems_per_s'])} per rank) "
                           f"with {m['threads']} thread(s)")
    surface = gemm_surface(m["gemms"], lambda M, K, N: roofline_gemm_s(
        M, K, N, peak, hbm, eff, m["elem_bytes"], False), f"`fivefold calibrate`, {precision}")
    known = device_profile(m.get("device_name", m["device"]), memory_bytes)
    prof = HardwareProfile(name, peaks, memory_bytes, hbm / 1e9, bw / 1e9, bw / 1e9,
                           f"measured by `fivefold calibrate` on {m['device']} with "
                           f"{m['threads']} thread(s)", eff, cores or 8, cores, host,
                           architecture=known.architecture if known else "unknown",
                           kernel_source=f"`fivefold calibrate` on this {m['device']}: "
                                         f"{len(m['gemms'])} GEMM shapes (roofline and "
                                         f"surface), {len(m['attention'])} SDPA shapes, a "
                                         "copy", kernels_measured=True,
                           gemm_surfaces={precision: surface})
    share = m.get("cpu_share", 1.0)
    return prof if share >= 1.0 else slowed_profile(
        prof, 1.0 / share, f"rates x {share:.2f}, the CPU time each rank got over the wall "
                           "time of its probes (time-sliced cores)")


def _rate(elems_per_s: float | None) -> str:
    return "not available" if elems_per_s is None else f"{elems_per_s / 1e6:.0f} M elements/s"


def calibrate(out: str | Path, device_type: str = "cpu", ranks: int = 2,
              threads: int | None = None, offload_path: str | None = None) -> HardwareProfile:
    """Measure, fit and write the profile. On a CPU, `threads` defaults to 1: what each rank
    of a multi-rank run gets (torch.distributed.run sets OMP_NUM_THREADS=1); calibrate a
    single-process run with --threads set to the core count. `offload_path`: the directory
    whose drive the disk tier's figures describe (parallel.offload_path)."""
    if device_type == "cpu" and threads is None:
        threads = 1
    import torch

    if device_type == "cpu" and ranks > 1:  # every rank measures at once: shared caches,
        from fivefold import local_ranks  # memory bus and cores, as in training
        from fivefold.host_heap import keep_host_heap

        m = local_ranks.run_local(_measure_worker, ranks, threads, prepare=keep_host_heap)[0]
    else:
        m = measure_device(device_type, threads)
    link = measure_collectives(ranks) if ranks > 1 else None
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device_type == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        cores = 0
    else:
        memory = host_memory
        cores = max(ranks, 1)  # ranks that ran at once at the measured rates
    prof = profile_from_measurements(f"calibrated-{device_type}", m, link, memory, cores,
                                     host_memory, measure_storage(offload_path))
    Path(out).write_text(json.dumps(dataclasses.asdict(prof), indent=1) + "\n")
    return prof


def summary(prof: HardwareProfile) -> str:
    e, h = prof.eff, prof.host
    peak = max(prof.peak_tflops.values())
    return (f"{prof.name}: GEMM peak {peak * 1e3:.1f} GFLOP/s (efficiency curve "
            f"{e.gemm_eff:.2f}, memory term {e.gemm_mem_eff:.2f}, overhead "
            f"{e.kernel_overhead_s * 1e6:.1f} us), attention {e.attn_eff:.2f} of peak + "
            f"{e.attn_score_s * 1e12:.2f} ps/score, exp of -inf +{e.masked_exp_s * 1e9:.1f} ns, "
            f"memory {prof.hbm_GBps:.1f} GB/s, "
            f"ranks link {prof.intra_node_GBps:.2f} GB/s + {e.latency_intra_s * 1e6:.0f} us/hop"
            f" (of the ring model's rate: reduce-scatter {e.reduce_scatter_eff:.2f}, all-gather "
            f"{e.all_gather_eff:.2f}, all-to-all {e.all_to_all_eff:.2f}); host: link "
            f"{h.link_GBps:.2f} GB/s, memory {h.memory_GBps:.1f} GB/s, CPU AdamW "
            f"{h.adam_elems_per_s / 1e6:.0f} M elements/s per host, disk write "
            f"{h.nvme_write_GBps:.2f} / read {h.nvme_read_GBps:.2f} GB/s")

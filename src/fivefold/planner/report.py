"""Plain-text output of `fivefold simulate` and `fivefold plan` (the JSON is Estimate.to_json
with `context_json`'s stack and profile).

Both texts open with the software stack the prediction assumes (the default, this runtime,
explained with how to plan for another) and name the hardware profile with where it comes
from (built-in or a calibrated file); simulate's peak is the one of the run's precision.

`plan_text` ends with the `fivefold train` command that runs the winning layout: every
searched field as a `--set`, including the planner's block split (`parallel.stage_layers`),
the blocks whose activations it offloads and the offload tier the layout needed (nvme also
needs a directory: `offload_path`),
launched with torchrun across nodes when the layout needs more than one. Under offload both
texts add a line: the host bytes per host against its memory, the disk bytes per device and
the CPU step (fivefold.planner.offload).
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.hardware import PROFILES, HardwareProfile
from fivefold.planner.bands import step_time_band
from fivefold.planner.estimate import BREAKDOWN_FIELDS, MEMORY_FIELDS, Estimate
from fivefold.planner.stack import STACKS

GiB = 2**30
SEARCHED = ("tp", "pp", "cp", "ep", "dp", "vpp", "schedule", "zero_stage", "micro_batch",
            "recompute", "sequence_parallel", "stage_layers")


def layout_line(p: dict) -> str:
    sched = f" {p['schedule']}" + (f" vpp={p['vpp']}" if p["vpp"] > 1 else "") if p["pp"] > 1 \
        else ""
    sp = " sp" if p["sequence_parallel"] else ""
    ep = f" ep={p['ep']}" if p["ep"] > 1 else ""
    offload = ""
    if p.get("offload", "none") != "none":
        fraction = p["offload_fraction"]
        offload = f" offload={p['offload']}" + (f"x{fraction:g}" if fraction < 1 else "")
    if p.get("offload_activations"):
        offload += f" offload_activations={p['offload_activations']}"
    return (f"tp={p['tp']}{sp} pp={p['pp']}{sched} cp={p['cp']} dp={p['dp']}{ep} "
            f"zero={p['zero_stage']} mb={p['micro_batch']} recompute={p['recompute']} "
            f"{p['precision']}{offload}")


def offload_line(est: Estimate) -> str | None:
    """Where the offloaded state lives and what its step costs; None without offload."""
    o = est.offload
    if o is None:
        return None
    disk = (f", disk {o['disk_bytes_per_gpu'] / GiB:.2f} GiB per device"
            if o["disk_bytes_per_gpu"] else "")
    return (f"offload    {o['tier']} x{o['fraction']:g}: host {o['host_bytes_per_host'] / GiB:.2f}"
            f" of {o['host_memory_bytes'] / GiB:.0f} GiB per host "
            f"({'fits' if o['host_fits'] else 'does NOT fit'}){disk}; gradients down "
            f"{o['download_s']:.3g} s, clipping {o['clip_s']:.3g} s, CPU step "
            f"{o['cpu_step_s']:.3g} s, disk {o['disk_s']:.3g} s, parameters up "
            f"{o['upload_s']:.3g} s: {o['exposed_s']:.3g} s exposed")


def activation_offload_line(est: Estimate) -> str | None:
    """Where the offloaded activations live and what their copies cost (the rank where they
    are largest); None without activation offload. Under vpp the count is each chunk's."""
    a = est.activation_offload
    if a is None:
        return None
    unit = "model chunk" if est.layout.vpp > 1 else "stage"
    return (f"activations offloaded: the first {a['blocks_per_stage']} blocks of each {unit}, "
            f"host {a['host_bytes_per_host'] / GiB:.2f} of {a['host_memory_bytes'] / GiB:.0f} "
            f"GiB per host ({'fits' if a['host_fits'] else 'does NOT fit'}); "
            f"{a['bytes_each_way_per_micro_batch'] / GiB:.2f} GiB each way per micro-batch: "
            f"forward +{a['forward_copy_s_per_micro_batch']:.3g} s, backward waits "
            f"{a['backward_wait_s_per_micro_batch']:.3g} s")


def stack_line(cfg: Config) -> str:
    """The software stack the prediction assumes (fivefold.planner.stack), as the first line
    of `simulate` and `plan`: the default one is explained with how to plan for another."""
    t = cfg.train
    if t.stack == "fivefold":
        return ('stack: fivefold (this runtime; default: set train.stack = "megatron" with '
                'train.stack_release to plan for Megatron-Core, or "torchtitan", "deepspeed")')
    release = t.stack_release or "newest"
    return f"stack: {t.stack} {release} ({STACKS[t.stack].source})"


def profile_origin(cfg: Config) -> str:
    """Where the hardware profile comes from: "built-in" or the calibrated file's path."""
    return "built-in" if cfg.cluster.gpu in PROFILES else f"file {cfg.cluster.gpu}"


def context_json(cfg: Config, prof: HardwareProfile) -> dict:
    """The `stack` and `profile` fields `--json` adds to each estimate (run_spec.md)."""
    t = cfg.train
    return {"stack": {"name": t.stack, "release": t.stack_release,
                      "source": STACKS[t.stack].source},
            "profile": {"name": prof.name, "from": profile_origin(cfg),
                        "source": prof.source}}


def band_text(cfg: Config | None, step_time_s: float) -> str:
    """"80% band lo-hi s (rows)" from the cross-validated residuals (fivefold.planner.bands)."""
    got = step_time_band(cfg, step_time_s) if cfg is not None else None
    if got is None:
        return ""
    (lo, hi), rows = got
    return f"   80% band {lo:.4g}-{hi:.4g} s ({rows})"


def estimate_text(est: Estimate, prof: HardwareProfile, cfg: Config) -> str:
    mem, bd = est.memory_per_gpu_bytes, est.breakdown_s
    precision = est.parallel["precision"]
    lines = [stack_line(cfg),
             f"layout     {layout_line(est.parallel)}",
             f"profile    {prof.name} ({profile_origin(cfg)}; peak "
             f"{prof.peak_flops(precision) / 1e12:g} TFLOP/s {precision}, "
             f"{prof.memory_bytes / GiB:.0f} GiB)",
             f"step       {est.step_time_s:.4g} s   {est.tokens_per_s:,.0f} tokens/s   "
             f"MFU {100 * est.mfu:.1f}%   HFU {100 * est.hfu:.1f}%"
             + band_text(cfg, est.step_time_s),
             "time       " + "   ".join(f"{k} {bd[k]:.4g} s" for k in BREAKDOWN_FIELDS),
             "memory     " + "   ".join(f"{k} {mem[k] / GiB:.2f}" for k in MEMORY_FIELDS)
             + f" GiB   ({'fits' if est.fits else 'does NOT fit'} in "
               f"{prof.memory_bytes / GiB:.0f} GiB)"]
    if len(est.stage_layers) > 1:
        lines.append(f"stages     blocks per virtual stage {est.stage_layers}")
    for extra in (offload_line(est), activation_offload_line(est)):
        if extra:
            lines.append(extra)
    return "\n".join(lines)


def plan_text(result, cfg: Config, prof: HardwareProfile, spec_path: str) -> str:
    lines = [stack_line(cfg), f"profile: {prof.name} ({profile_origin(cfg)})",
             f"{'#':>2} {'step s':>9} {'tok/s':>11} {'MFU':>6}  {'mem GiB':>8}  "
             f"{'compute':>8} {'comm':>7} {'bubble':>7} {'optim':>6}  layout"]
    for i, est in enumerate(result.best, 1):
        bd = est.breakdown_s
        lines.append(f"{i:2d} {est.step_time_s:9.4g} {est.tokens_per_s:11,.0f} "
                     f"{100 * est.mfu:5.1f}%  {est.memory_per_gpu_bytes['total'] / GiB:8.1f}  "
                     f"{bd['compute']:8.3g} {bd['exposed_comm']:7.3g} {bd['bubble']:7.3g} "
                     f"{bd['optimizer']:6.3g}  {layout_line(est.parallel)}")
    lines.append(f"\nscored {result.scored} layouts ({result.fitting} fit in memory) in "
                 f"{result.seconds:.1f} s on {prof.name} x {cfg.cluster.gpus}")
    if not result.best:
        lines.append("no layout fits: add devices, shorten the sequence or lower the batch")
        return "\n".join(lines)
    best = result.best[0]
    got = step_time_band(cfg, best.step_time_s)
    if got is not None:
        (lo, hi), rows = got
        same = sum(1 for e in result.best[1:] if step_time_band(cfg, e.step_time_s)[0][0] <= hi)
        lines.append(f"best step {best.step_time_s:.4g} s, 80% band {lo:.4g}-{hi:.4g} s (the "
                     f"cross-validated residuals of {rows} rows); {same} of the other "
                     f"{len(result.best) - 1} shown overlap it: not distinguishable by the "
                     "simulator")
    mem = best.memory_per_gpu_bytes
    lines.append("best layout memory per device: " + ", ".join(
        f"{k} {mem[k] / GiB:.2f} GiB" for k in MEMORY_FIELDS))
    if offload_line(best):
        lines.append(f"it fits with {best.offload['tier']} offload; " + offload_line(best)
                     .removeprefix("offload    "))
    hosted = activation_offload_line(best)
    if hosted:
        lines.append("it fits with its " + hosted)
    lines.append("\nrun it:\n  " + train_command(best, cfg, spec_path))
    return "\n".join(lines)


def train_command(est: Estimate, cfg: Config, spec_path: str) -> str:
    p = est.parallel
    sets = []
    for key in SEARCHED:
        value = p.get(key)
        if value is None or (key == "stage_layers" and p["pp"] * p["vpp"] == 1):
            continue
        text = str(value).lower() if isinstance(value, bool) else (
            value if isinstance(value, str) else str(value).replace(" ", ""))
        sets.append(f"--set parallel.{key}={text}")
    if p.get("offload_activations"):
        sets.append(f"--set parallel.offload_activations={p['offload_activations']}")
    if p.get("offload", "none") != "none":
        sets += [f"--set parallel.offload={p['offload']}",
                 f"--set parallel.offload_fraction={p['offload_fraction']:g}"]
        if p["offload"] == "nvme" and not p.get("offload_path"):
            sets.append("--set parallel.offload_path=DIR")  # a directory on a local NVMe
    gpn = min(cfg.cluster.gpus_per_node, cfg.cluster.gpus)
    nodes = cfg.cluster.gpus // gpn
    head = (f"fivefold train {spec_path} --nproc {gpn}" if nodes == 1 else
            f"torchrun --nnodes {nodes} --nproc-per-node {gpn} -m fivefold train {spec_path}")
    return " ".join([head] + sets)

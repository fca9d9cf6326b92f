"""Collective algorithms on the documented topologies: modeled all-gather time of ring,
hierarchical and synthesized schedules against the bandwidth bound, and synthesis time
(docs/collectives.md); with --measure, measured times on CPU gloo ranks whose links are
slowed by delayed sends, ranked against the modeled ones.

    PYTHONPATH=src python bench/collectives.py                 # the table (Markdown)
    PYTHONPATH=src python bench/collectives.py --measure       # + measured on gloo ranks
    PYTHONPATH=src python bench/collectives.py --write-schedule DIR   # synthesized JSONs
    ... --json FILE                                            # everything as JSON

The topologies and sketches are configs/comm/<name>.topology.toml / .sketch.toml; the
message is 64 MiB (the full all-gather output). --measure emulates each topology with every
link `SLOWDOWN` times slower (bandwidth / SLOWDOWN, latency x SLOWDOWN): before each step a
rank sleeps its slowest send's alpha-beta time, so the emulated step lasts what the model says
plus what gloo really spends; the modeled time of the emulated run is SLOWDOWN x the table's
at the measured message size. Timing is reported, never asserted (tests check the order in a
slow-marked test only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fivefold.comm.algorithms.registry import schedule_for  # noqa: E402
from fivefold.comm.bound import all_gather_bound  # noqa: E402
from fivefold.comm.schedule import modeled_time_s  # noqa: E402
from fivefold.comm.synthesize import load_sketch, synthesize_all_gather  # noqa: E402
from fivefold.comm.topology import load_topology  # noqa: E402

CONFIGS = ROOT / "configs" / "comm"
TOPOLOGIES = ("2x4", "4x2", "2x2_slow")
NBYTES = 64 * 2 ** 20
SLOWDOWN = 2000.0
MEASURE_NBYTES = 2 * 2 ** 20  # int64 elements: 256 Ki in the all-gather output


def schedules(name: str) -> tuple:
    topo = load_topology(CONFIGS / f"{name}.topology.toml")
    start = time.perf_counter()
    synth = synthesize_all_gather(topo, load_sketch(CONFIGS / f"{name}.sketch.toml"))
    synthesis_s = time.perf_counter() - start
    out = {alg: schedule_for("all_gather", alg, topo.ranks, topo.per_node)
           for alg in ("ring", "hierarchical")}
    out["synthesized"] = synth
    return topo, out, synthesis_s


def table() -> list[dict]:
    rows = []
    for name in TOPOLOGIES:
        topo, scheds, synthesis_s = schedules(name)
        bound = all_gather_bound(topo, NBYTES).bound_s
        row = {"topology": name, "ranks": topo.ranks, "bound_ms": bound * 1e3,
               "synthesis_s": synthesis_s, "chunks_per_rank": scheds["synthesized"].chunks_per_rank,
               "synthesized_steps": len(scheds["synthesized"].steps)}
        for alg, s in scheds.items():
            t = modeled_time_s(s, topo, NBYTES)
            row[f"{alg}_ms"], row[f"{alg}_vs_bound"] = t * 1e3, t / bound
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| topology | ring ms (x bound) | hierarchical ms (x bound) | synthesized ms "
             "(x bound) | bound ms | chunks/rank, steps | synthesis s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{r[f'{a}_ms']:.3f} ({r[f'{a}_vs_bound']:.3f})"
                 for a in ("ring", "hierarchical", "synthesized")]
        lines.append(f"| {r['topology']} | " + " | ".join(cells) + f" | {r['bound_ms']:.3f} | "
                     f"{r['chunks_per_rank']}, {r['synthesized_steps']} | "
                     f"{r['synthesis_s']:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- measured on gloo ranks

def _measure(rt, topo, scheds: dict, repeats: int) -> dict:
    """On each rank: time each schedule's all-gather with every link's delay emulated."""
    import torch
    import torch.distributed as dist

    from fivefold.comm import collectives as C
    from fivefold.comm import executor
    from fivefold.comm.ledger import Ledger

    def delay(src: int, dst: int, nbytes: int) -> float:
        link = topo.link(src, dst)
        return SLOWDOWN * (link.latency_s + nbytes / link.bandwidth_Bps)

    n, me = topo.ranks, dist.get_rank()
    axis = C.Axis("world", None, n, me, Ledger())
    numel = MEASURE_NBYTES // 8 // n
    inp = torch.arange(numel, dtype=torch.int64) + me * numel
    out = torch.empty(numel * n, dtype=torch.int64)
    times: dict[str, list[float]] = {alg: [] for alg in scheds}
    for _ in range(repeats):
        for alg, s in scheds.items():
            dist.barrier()
            start = time.perf_counter()
            executor.all_gather(out, inp, axis, "bench", s, link_delay_s=delay)
            dist.barrier()
            times[alg].append(time.perf_counter() - start)
            assert torch.equal(out, torch.arange(numel * n, dtype=torch.int64))
    return {alg: statistics.median(t) for alg, t in times.items()}


def measure(names=TOPOLOGIES, repeats: int = 3) -> list[dict]:
    from fivefold.testing import run_on_ranks

    rows = []
    for name in names:
        topo, scheds, _ = schedules(name)
        measured = run_on_ranks(_measure, topo.ranks, topo, scheds, repeats, timeout_s=600)[0]
        modeled = {alg: SLOWDOWN * modeled_time_s(s, topo, MEASURE_NBYTES)
                   for alg, s in scheds.items()}
        order_measured = sorted(measured, key=measured.get)
        order_modeled = sorted(modeled, key=modeled.get)
        rows.append({"topology": name, "measured_s": measured, "modeled_s": modeled,
                     "order_measured": order_measured, "order_modeled": order_modeled,
                     "same_order": order_measured == order_modeled})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="topologies to measure")
    ap.add_argument("--write-schedule", metavar="DIR")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    result: dict = {}
    if args.write_schedule:
        out = Path(args.write_schedule)
        out.mkdir(parents=True, exist_ok=True)
        for name in TOPOLOGIES:
            _, scheds, _ = schedules(name)
            (out / f"{name}.all_gather.json").write_text(scheds["synthesized"].to_json())
        print(f"wrote {len(TOPOLOGIES)} schedules to {out}")
    if not args.measure or args.json:
        rows = table()
        result["table"] = rows
        print(markdown(rows))
    if args.measure:
        rows = measure(tuple(args.only) if args.only else TOPOLOGIES)
        result["measured"] = rows
        print(f"\nmeasured on gloo ranks, links {SLOWDOWN:g}x slower, "
              f"{MEASURE_NBYTES / 2 ** 20:g} MiB all-gather (median of 3):")
        print("| topology | " + " | ".join(f"{a} measured / modeled s" for a in
                                          ("ring", "hierarchical", "synthesized")) +
              " | same order |")
        print("| --- | --- | --- | --- | --- |")
        for r in rows:
            cells = [f"{r['measured_s'][a]:.3f} / {r['modeled_s'][a]:.3f}"
                     for a in ("ring", "hierarchical", "synthesized")]
            print(f"| {r['topology']} | " + " | ".join(cells) + f" | {r['same_order']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

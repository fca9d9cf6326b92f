"""The ZeRO / ZeRO++ ledger of one step: for each ZeRO stage and each ZeRO++ switch, one
fivefold training step on 4 gloo ranks with `cluster.gpus_per_node = 2`, and the bytes per
step of every collective (logical and on the wire) and the model-state bytes that rank 0's
ledger records (the table of docs/data_parallel.md). Run it as
`python bench/data_parallel.py --ledger` (the setup is that bench's: bench_config).
"""

from __future__ import annotations

import sys
import tempfile

from data_parallel import (GLOBAL_BATCH, PRESET, SEQ_LEN, bench_config, ledger_report,
                           peer_versions)
from harness import machine_info


LEDGER_WORLD = 4
LEDGER_LAYOUTS = {
    "stage 0": ("parallel.zero_stage=0",),
    "stage 1": ("parallel.zero_stage=1",),
    "stage 2": ("parallel.zero_stage=2",),
    "stage 3": ("parallel.zero_stage=3",),
    "stage 3 + qwZ": ("parallel.zero_stage=3", "parallel.qwz=true"),
    "stage 3 + hpZ": ("parallel.zero_stage=3", "parallel.hpz=true"),
    "stage 3 + qgZ": ("parallel.zero_stage=3", "parallel.qgz=true"),
    "stage 3 + qwZ+hpZ+qgZ": ("parallel.zero_stage=3", "parallel.qwz=true", "parallel.hpz=true",
                              "parallel.qgz=true"),
}


def _ledger_step(rt, layouts: dict) -> dict:
    """On each rank: one training step per layout; its collectives and model-state bytes."""
    from fivefold.train.trainer import Trainer

    out = {}
    for label, sets in layouts.items():
        cfg = bench_config(0, rt.world_size, ("cluster.gpus_per_node=2", *sets))
        with tempfile.TemporaryDirectory(prefix="bench-dp-ledger-") as tmp:
            trainer = Trainer(cfg, rt, tmp)
            trainer.train_step(0)
        out[label] = ledger_report(trainer.ledger)
    return out


def run_ledger() -> dict:
    from fivefold.testing import run_on_ranks
    from fivefold.train.data import prepare_data

    prepare_data(bench_config(0, LEDGER_WORLD), log=lambda text: print(text, file=sys.stderr))
    layouts = run_on_ranks(_ledger_step, LEDGER_WORLD, LEDGER_LAYOUTS, timeout_s=900)[0]
    return {"config": {"preset": PRESET, "precision": "fp32", "world": LEDGER_WORLD,
                       "gpus_per_node": 2, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN},
            "machine": machine_info(**peer_versions()), "layouts": layouts}


def print_ledger(res: dict) -> None:
    c = res["config"]
    print(f"{c['preset']} preset, {c['precision']}, {c['world']} ranks, {c['gpus_per_node']} per "
          f"node; one step, bytes on this rank (rank 0)")
    base = res["layouts"]["stage 3"]
    base_total = sum(r["wire_bytes"] for r in base["comm"] if r["purpose"] in ("grads", "params"))
    for label, layout in res["layouts"].items():
        state = layout["model_state_bytes"]
        print(f"{label}: model states {state['total']:,} B (params {state['params']:,}, grads "
              f"{state['grads']:,}, optimizer {state['optimizer']:,})")
        total = 0
        for r in layout["comm"]:
            print(f"  {r['op']:<15}{r['mesh_dim']:<24}{r['purpose']:<10}{r['bytes']:>14,} B"
                  f"{r['wire_bytes']:>14,} B on the wire")
            total += r["wire_bytes"] if r["purpose"] in ("grads", "params") else 0
        print(f"  grads + params on the wire: {total:,} B ({total / base_total:.3f} of stage 3)")

"""Losses and gradient norms, bit for bit, of 4 steps of 22 layouts: a refactoring's check.

    python scripts/loss_fingerprint.py record REF.json   # on the commit before the change
    python scripts/loss_fingerprint.py compare REF.json  # on the changed code, same machine

Each layout trains the tiny test model (tests/conftest.py's sizes) on 60 standard-library
modules, on one rank and on 2 gloo ranks in one process start (ZeRO 0-3, tp, cp, pp with a
synchronous schedule and PipeDream-2BW, LOMO, GaLore, SGD, Muon, fp16, offload); `compare`
prints IDENTICAL or the differing values per layout. CPU float results differ between CPU
models, so a reference is only meaningful on the machine that recorded it. Issue 34's
one-update-path refactor was checked this way: every layout identical before and after.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from fivefold.config import load_config
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
        "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32"]
STEPS = 4
ONE_RANK = [("plain", []), ("plain_mb", ["parallel.micro_batch=2"]),
            ("zero1_1r", ["parallel.zero_stage=1"]), ("lomo", ["train.optimizer=lomo"]),
            ("galore", ["train.optimizer=galore"]),
            ("galore_z1", ["train.optimizer=galore", "parallel.zero_stage=1"]),
            ("sgd", ["train.optimizer=sgd"]), ("muon", ["train.optimizer=muon"]),
            ("fp16", ["parallel.precision=fp16"]), ("offload", ["parallel.offload=cpu"]),
            ("skip", ["train.on_nonfinite=skip"])]
TWO_RANKS = [(f"z{z}", [f"parallel.zero_stage={z}", "parallel.micro_batch=2"])
             for z in range(4)] + [
    ("tp2", ["parallel.tp=2"]), ("pp2", ["parallel.pp=2", "parallel.micro_batch=2"]),
    ("pp2bw", ["parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=2"]),
    ("lomo2", ["train.optimizer=lomo"]),
    ("lomo2z1", ["train.optimizer=lomo", "parallel.zero_stage=1"]),
    ("galore2", ["train.optimizer=galore"]), ("cp2", ["parallel.cp=2"])]


def overrides(root: Path) -> list[str]:
    return TINY + [f"data.source='{root}/corpus'", f"data.cache_dir='{root}/cache'",
                   "data.val_fraction=0.1", "data.tokenizer_sample_mib=0.5",
                   "parallel.global_batch=8", "train.tensorboard=false",
                   "train.sample_tokens=0", "train.log_every=1000", "train.lr=1e-2",
                   "train.warmup_steps=2"]


def run(rt: Runtime, base: list[str], cases) -> dict[str, list[list[str]]]:
    """Per case: [loss, grad norm] of each step as float.hex strings."""
    out = {}
    for name, extra in cases:
        with tempfile.TemporaryDirectory() as d:
            trainer = Trainer(load_config(None, base + extra), rt, d)
            results = [trainer.train_step(s) for s in range(STEPS)]
        out[name] = [[r.loss.hex(), float(r.grad_norm).hex()] for r in results]
    return out


def main(mode: str, path: str) -> int:
    root = Path(tempfile.gettempdir()) / "fivefold_loss_fingerprint"
    if not (root / "corpus").exists():
        (root / "corpus").mkdir(parents=True)
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]:
            shutil.copy(f, root / "corpus" / f.name)
    base = overrides(root)
    prepare_data(load_config(None, base))
    got = {"1": run(Runtime(0, 1, 0, torch.device("cpu")), base, ONE_RANK),
           "2": run_on_ranks(run, 2, base, TWO_RANKS, timeout_s=1200)[0]}
    if mode == "record":
        Path(path).write_text(json.dumps(got, indent=1))
        return 0
    ref, differ = json.loads(Path(path).read_text()), 0
    for world, cases in ref.items():
        for name, want in cases.items():
            same = got[world].get(name) == want
            differ += not same
            print(world, name, "IDENTICAL" if same else
                  f"DIFF reference {want} got {got[world].get(name)}")
    print("ALL IDENTICAL" if not differ else f"{differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

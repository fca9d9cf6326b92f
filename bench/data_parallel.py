"""Data-parallel throughput and peak memory: fivefold's DDP and ZeRO stages next to PyTorch's
DDP and FSDP2 and DeepSpeed's ZeRO stages, on the same model, ranks and batch, in one run.

Every side trains the same fixed setup: the `tiny` preset, fp32 on the CPU, `--nproc` ranks
(default 2) joined in one gloo process group, a global batch of 8 sequences x 256 tokens
(8 / nproc per rank, no gradient accumulation), AdamW with fivefold's default
hyper-parameters (decay on matrices only, warm-up + cosine learning rate), gradient clipping
at 1.0, on the built-in corpus.

* fivefold-k (k = 0 DDP, 1, 2, 3 ZeRO): `Trainer.train_step(step)` with
  `parallel.zero_stage = k`, so fivefold's own engine (fivefold.parallel.data_parallel), sampler
  and optimizer; no checkpoints, evaluation or metrics.
* torch-ddp: `torch.nn.parallel.DistributedDataParallel` around the model definition.
* torch-fsdp2: `torch.distributed.fsdp.fully_shard` on each block, then on the root.
* deepspeed-k (k = 1, 2, 3): `deepspeed.initialize` with a config dict (`zero_optimization.
  stage = k`, fp32, DeepSpeed's default buckets and overlap, every parameter sharded at
  stage 3) and a client `torch.optim.AdamW`; runs with
  `DS_ACCELERATOR=cpu` on the same gloo group. Skipped, with the reason printed, when
  DeepSpeed is not importable (it is the `bench` extra: `pip install -e '.[bench]'`).

The peer sides (bench/peer_sides.py) use none of fivefold's trainer, engine, sampler or
optimizer construction; their model is `fivefold.models.llama.Transformer`, a plain `nn.Module`
with no parallel code, so every side runs the same forward/backward math and the comparison
isolates the data-parallel machinery. Their batches are cut at numpy random offsets from the
same token array, and their loss is the per-rank token mean (each wrapper averages gradients
over ranks, so the update is the global-mean gradient, as fivefold's).

Each rank of each side is its own process (this script re-invoked with `--side`, the rank in
its environment as `torch.distributed.run` would set it), so its peak resident set (`VmHWM`)
is one rank's: interpreter, libraries, model states, activations, communication buffers.
Every side is started once and kept alive; the driver runs untimed warm-up steps per side,
then `--rounds` rounds of timed steps, interleaved side after side (the order rotated each
round), so machine noise hits every side alike. A timed run starts and ends on a barrier;
its time is the slowest rank's. Reported per side: median tokens/s over the rounds, the
peak RSS of the largest rank, and the growth of each rank's peak over its peak after imports
and process-group set-up (the largest rank's), each with its ratio to
fivefold's matching stage (torch-ddp / fivefold-0, torch-fsdp2 / fivefold-3,
deepspeed-k / fivefold-k).

`--ledger` instead records one fivefold training step on 4 gloo ranks with
`cluster.gpus_per_node = 2` for each ZeRO stage and each ZeRO++ switch, and prints the bytes
per step of every collective (bench/zero_ledger.py; the table of docs/data_parallel.md).

    python bench/data_parallel.py                  # 30 timed steps per side, 5 rounds of 6
    python bench/data_parallel.py --quick          # smoke test: 2 steps, 1 round
    python bench/data_parallel.py --sides fivefold-0,torch-ddp --json out.json
    python bench/data_parallel.py --ledger         # ZeRO / ZeRO++ bytes per collective
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from harness import (SPEED_MEMORY_HEADER, TrainerSide, add_timing_args, machine_info,
                     memory_summary, rotated, rss_mib, speed_memory_cells, speed_memory_ratios,
                     split_rounds, write_json)
from peer_sides import PeerSide, import_side

FIVEFOLD_SIDES = ("fivefold-0", "fivefold-1", "fivefold-2", "fivefold-3")
TORCH_SIDES = ("torch-ddp", "torch-fsdp2")
DEEPSPEED_SIDES = ("deepspeed-1", "deepspeed-2", "deepspeed-3")
SIDES = FIVEFOLD_SIDES + TORCH_SIDES + DEEPSPEED_SIDES
REFERENCE = {"torch-ddp": "fivefold-0", "torch-fsdp2": "fivefold-3",
             "deepspeed-1": "fivefold-1", "deepspeed-2": "fivefold-2",
             "deepspeed-3": "fivefold-3"}
GLOBAL_BATCH = 8
SEQ_LEN = 256
PRESET = "tiny"
REPLY_TIMEOUT_S = 900.0


def bench_config(zero_stage: int, world: int, extra: tuple[str, ...] = ()):
    """The fixed fivefold config (imported lazily: peer workers never load fivefold's config)."""
    from fivefold.config import load_config
    from fivefold.validate import validate_for_training

    cfg = load_config(None, [f'model.preset="{PRESET}"', f"model.seq_len={SEQ_LEN}",
                             f"parallel.global_batch={GLOBAL_BATCH}", 'parallel.precision="fp32"',
                             f"parallel.zero_stage={zero_stage}", 'train.device="cpu"',
                             "train.compile=false", "train.tensorboard=false",
                             "train.sample_tokens=0", *extra])
    validate_for_training(cfg, world)
    return cfg


def ledger_report(ledger) -> dict:
    """A step's collectives (bytes and wire bytes by op, axis, purpose) and model-state bytes."""
    wire = ledger.totals("wire_bytes")
    return {"model_state_bytes": dict(ledger.model_state_bytes),
            "comm": [{"op": op, "mesh_dim": dim, "purpose": purpose, "bytes": nbytes,
                      "wire_bytes": wire[(op, dim, purpose)]}
                     for (op, dim, purpose), nbytes in sorted(ledger.totals().items())]}


# ------------------------------------------------------------------ the sides (one rank each)

class FivefoldSide(TrainerSide):
    """fivefold's Trainer with its data-parallel engine at ZeRO stage k."""

    def __init__(self, spec: dict, rank: int, world: int):
        super().__init__(bench_config(int(spec["side"].split("-")[1]), world),
                         spec["total_steps"], rank, world)

    def report(self) -> dict:
        return ledger_report(self.trainer.ledger)


def worker(side: str) -> None:
    """One rank. Line protocol on stdin/stdout: a spec, then {"steps": n}, then {"quit": 1}."""
    import traceback

    proto = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print stays off the protocol channel
    # FSDP2 and DeepSpeed call torch 2.13's deprecated all_gather_into_tensor: once per rank
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = json.loads(sys.stdin.readline())
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec["threads"])
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        import_side(side)
        base_rss = rss_mib("VmHWM")  # not VmRSS: idle file pages may be reclaimed
        runner = (FivefoldSide if side.startswith("fivefold") else PeerSide)(spec, rank, world)
        reply({"ready": True, "threads": torch.get_num_threads(), "base_rss_mib": base_rss})
        for line in sys.stdin:
            cmd = json.loads(line)
            if "quit" in cmd:
                break
            dist.barrier()
            start = time.perf_counter()
            loss = runner.run(cmd["steps"])
            dist.barrier()
            reply({"seconds": time.perf_counter() - start, "loss": loss})
        reply({"peak_rss_mib": rss_mib("VmHWM"), "report": runner.report()})
        dist.destroy_process_group()
    except BaseException:  # the driver drops this side and says why
        reply({"error": traceback.format_exc()})


class Side:
    """The ranks of one side, driven in lock step over their stdin/stdout pipes."""

    def __init__(self, side: str, spec: dict, nproc: int, store: str):
        self.name, self.error = side, None
        env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--side", side],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                      for r in range(nproc)]
        self.send(dict(spec, side=side, store=store))

    def send(self, obj: dict) -> None:
        for p in self.procs:
            p.stdin.write(json.dumps(obj) + "\n")
            p.stdin.flush()

    def receive(self) -> list[dict] | None:
        """One reply per rank; on a rank's error or exit, stop the side and keep the reason."""
        sel = selectors.DefaultSelector()
        for r, p in enumerate(self.procs):
            sel.register(p.stdout, selectors.EVENT_READ, r)
        replies: dict[int, dict] = {}
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        try:
            while len(replies) < len(self.procs) and self.error is None:
                events = sel.select(timeout=max(0.0, deadline - time.monotonic()))
                if not events:
                    self.error = f"no reply within {REPLY_TIMEOUT_S:.0f} s"
                for key, _ in events:
                    line = key.fileobj.readline()
                    out = json.loads(line) if line else {"error": "rank exited"}
                    if "error" in out:
                        self.error = f"rank {key.data}: {out['error'].strip()}"
                        break
                    replies[key.data] = out
                    sel.unregister(key.fileobj)
        finally:
            sel.close()
        if self.error:
            self.kill()
            return None
        return [replies[r] for r in range(len(self.procs))]

    def ask(self, obj: dict) -> list[dict] | None:
        self.send(obj)
        return self.receive()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def free_port() -> int:
    with socket.socket() as s:  # for libraries that read MASTER_PORT; the group uses a file
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the driver

def peer_versions() -> dict:
    if importlib.util.find_spec("deepspeed") is None:
        return {}
    from importlib.metadata import version
    return {"deepspeed": version("deepspeed")}


def chosen_sides(names: str | None) -> tuple[list[str], dict[str, str]]:
    """The sides to run, and the reason for each side left out."""
    sides = SIDES if names is None else tuple(n.strip() for n in names.split(",") if n.strip())
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    skipped = {}
    if any(s in DEEPSPEED_SIDES for s in sides) and not importlib.util.find_spec("deepspeed"):
        for s in sides:
            if s in DEEPSPEED_SIDES:
                skipped[s] = ("DeepSpeed is not installed (it is the bench extra: "
                              "pip install -e '.[bench]')")
    return [s for s in sides if s not in skipped], skipped


def run_bench(sides: list[str], skipped: dict[str, str], nproc: int, steps: int, rounds: int,
              warmup: int, threads: int) -> dict:
    import dataclasses

    from fivefold.train.data import prepare_data

    if GLOBAL_BATCH % nproc:
        raise SystemExit(f"--nproc ({nproc}) must divide the global batch of {GLOBAL_BATCH}")
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    load_before = os.getloadavg()
    cfg = bench_config(0, nproc)
    data = prepare_data(cfg, log=lambda text: print(text, file=sys.stderr))  # build the cache once
    per_round = split_rounds(steps, rounds)
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "moe"}
    spec = {"model": model, "total_steps": warmup + steps, "threads": threads,
            "global_batch": GLOBAL_BATCH,
            "train": dataclasses.asdict(cfg.train), "train_tokens": str(data.train.filename)}
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    running: dict[str, Side] = {}
    ready: dict[str, list[dict]] = {}

    def drop(name: str) -> None:
        skipped[name] = running.pop(name).error
        print(f"dropping {name}: {skipped[name]}", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        try:
            print(f"starting {len(sides)} side(s) x {nproc} ranks ...", file=sys.stderr)
            for name in sides:  # all start together; set-up overlaps
                running[name] = Side(name, spec, nproc, os.path.join(tmp, f"store-{name}"))
            for name in sides:
                out = running[name].receive()
                if out is None:
                    drop(name)
                else:
                    ready[name] = out
            for name in list(running):
                print(f"{name}: {warmup} warm-up step(s)", file=sys.stderr)
                if warmup and running[name].ask({"steps": warmup}) is None:
                    drop(name)
            rates = {name: [] for name in running}
            losses = {}
            for r, n in enumerate(per_round):
                for name in rotated(list(running), r):
                    out = running[name].ask({"steps": n})
                    if out is None:
                        drop(name)
                        continue
                    rates[name].append(n * tokens_per_step / max(o["seconds"] for o in out))
                    losses[name] = out[0]["loss"]
                    print(f"round {r + 1}/{rounds} {name:>12}: {n} steps, "
                          f"{rates[name][-1]:,.0f} tokens/s, loss {losses[name]:.3f}",
                          file=sys.stderr)
            finals = {}
            for name in list(running):
                out = running[name].ask({"quit": 1})
                if out is None:
                    drop(name)
                else:
                    finals[name] = out
                    running[name].kill()
        finally:
            for side in running.values():
                side.kill()
    result = {"config": {"preset": PRESET, "precision": "fp32", "device": "cpu",
                         "backend": "gloo", "nproc": nproc, "threads_per_rank": threads,
                         "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
                         "tokens_per_step": tokens_per_step, "timed_steps": steps,
                         "rounds": rounds, "steps_per_round": per_round, "warmup_steps": warmup},
              "machine": dict(machine_info(**peer_versions()), load_average_before=load_before),
              "sides": {}, "skipped": skipped}
    for name in sides:
        if name not in finals:
            continue
        peaks = [o["peak_rss_mib"] for o in finals[name]]
        bases = [o["base_rss_mib"] for o in ready[name]]
        result["sides"][name] = {
            "tokens_per_s": statistics.median(rates[name]), "tokens_per_s_best": max(rates[name]),
            "tokens_per_s_rounds": rates[name], **memory_summary(peaks, bases),
            "last_loss": losses[name], "threads_per_rank": ready[name][0]["threads"],
            **finals[name][0]["report"]}
    result["ratios"] = ratios(result["sides"])
    return result


def ratios(sides: dict) -> dict:
    """Each peer over fivefold's matching stage, where both ran."""
    out = {}
    for peer, ref in REFERENCE.items():
        if peer in sides and ref in sides:
            out[peer] = {"reference": ref, **speed_memory_ratios(sides[peer], sides[ref])}
    return out


def print_table(res: dict) -> None:
    c, m = res["config"], res["machine"]
    print(f"{c['preset']} preset, {c['precision']} on {c['device']} ({c['backend']}), "
          f"{c['nproc']} ranks x {c['threads_per_rank']} thread(s), batch {c['global_batch']} x "
          f"{c['seq_len']} tokens, {c['timed_steps']} timed steps per side in {c['rounds']} "
          f"round(s) (+{c['warmup_steps']} warm-up); {m['cpu_count']} CPUs, torch {m['torch']}"
          + (f", deepspeed {m['deepspeed']}" if "deepspeed" in m else ""))
    print(f"{'side':<13}{SPEED_MEMORY_HEADER}  vs")
    for name, s in res["sides"].items():
        r = res["ratios"].get(name)
        print(f"{name:<13}{speed_memory_cells(s, r)}  {r['reference'] if r else ''}")
    for name, reason in res["skipped"].items():
        print(f"{name}: not run: {reason.splitlines()[-1]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks per side (default 2)")
    add_timing_args(ap, steps=30, rounds=5, warmup=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: CPUs / nproc, at least 1)")
    ap.add_argument("--sides", metavar="A,B,...",
                    help=f"comma-separated subset of: {', '.join(SIDES)} (default all)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 steps, 1 round, 1 warm-up")
    ap.add_argument("--ledger", action="store_true",
                    help="print the ZeRO / ZeRO++ bytes per collective of one step on 4 ranks")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: one rank
    args = ap.parse_args(argv)
    if args.side:
        return worker(args.side)
    if args.ledger:
        from zero_ledger import print_ledger, run_ledger
        res = run_ledger()
        print_ledger(res)
    else:
        if args.quick:
            args.steps, args.rounds, args.warmup = 2, 1, 1
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
        sides, skipped = chosen_sides(args.sides)
        res = run_bench(sides, skipped, args.nproc, args.steps, args.rounds, args.warmup,
                        threads)
        print_table(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()

"""Tensor-parallel throughput on CPU ranks: tp 1, 2 and 4, with and without sequence
parallelism, side by side, and the per-layer formulas they follow; writes docs/tensor_parallel.md.

Every layout trains the same fixed setup with fivefold's `Trainer.train_step`: the `tiny`
preset (4 layers, width 256, 8 heads / 4 kv heads, MLP 704, vocabulary 8192, tied
embeddings), fp32 on the CPU, a global batch of 8 sequences x 256 tokens (2,048 tokens per
step, no gradient accumulation), on the built-in corpus. tp t runs on t gloo ranks started by
fivefold.testing.run_on_ranks (one intra-op thread per rank), all ranks of one tensor-parallel
group, so tp 1 is the single-process reference path. Each layout: `--warmup` untimed steps,
then `--rounds` rounds of `--steps / --rounds` timed steps, each round starting on a barrier
and timed on rank 0 (every step ends in collectives, so rank 0's time is the group's). The
headline is the median tokens/s over the rounds. Also recorded per layout: the bytes of the
last step's collectives on the tp axis from the ledger (with the analytic volume next to
them), each rank's peak resident set, and the per-layer activation bytes by the formula of
fivefold.parallel.tensor (`activation_bytes_per_layer`, checked against saved-tensor hooks in
tests/test_tensor_parallel.py).

On a 2-core machine tp 4 puts 4 single-threaded ranks on 2 cores, and every collective of gloo
goes through the loopback network stack, so on the CPU tensor parallelism trades speed for
memory; the numbers say how much.

    python bench/tensor_parallel.py                # 6 timed steps per layout in 3 rounds
    python bench/tensor_parallel.py --quick        # smoke test: 2 steps, 1 round, no docs
    python bench/tensor_parallel.py --json out.json --no-docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import add_timing_args, machine_info, rss_mib, split_rounds, write_json

LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]  # (tp, sequence parallel)
GLOBAL_BATCH = 8
SEQ_LEN = 256
PRESET = "tiny"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "tensor_parallel.md"


def bench_config(tp: int, sp: bool):
    from fivefold.config import load_config
    from fivefold.validate import validate_for_training

    cfg = load_config(None, [f'model.preset="{PRESET}"', f"model.seq_len={SEQ_LEN}",
                             f"parallel.global_batch={GLOBAL_BATCH}", f"parallel.tp={tp}",
                             f"parallel.sequence_parallel={str(sp).lower()}",
                             'parallel.precision="fp32"', 'train.device="cpu"',
                             "train.tensorboard=false"])  # the default 200-step schedule
    validate_for_training(cfg, tp)
    return cfg


def analytic_tp_bytes(cfg, sp: bool) -> int:
    """Bytes on the tp axis per step (one micro-batch): 4L + 2 activation all-reduces of
    (b, s, h), or as many all-gathers and reduce-scatters plus 2L re-gathers and the norm
    gains' all-reduce, plus the vocabulary statistics and the gradient norm."""
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return 0
    tokens = GLOBAL_BATCH * m.seq_len
    act, L = 4 * tokens * m.hidden, m.layers
    fixed = tp * 3 * tokens * 4 + 4
    if not sp:
        return (4 * L + 2) * act + fixed
    return 2 * (4 * L + 2) * act + 2 * L * act + (2 * L + 1) * 4 * m.hidden + fixed


def _rank(rt, tp, sp, warmup, per_round, data_dir):
    """One layout on this rank: warm-up, timed rounds; rank 0 returns the record."""
    import torch.distributed as dist

    from fivefold.train.data import prepare_data
    from fivefold.train.trainer import Trainer

    cfg = bench_config(tp, sp)
    trainer = Trainer(cfg, rt, data_dir, prepare_data(cfg, log=lambda text: None))
    step = 0
    for _ in range(warmup):
        trainer.train_step(step)
        step += 1
    rates, loss = [], float("nan")
    for n in per_round:
        if rt.distributed:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            loss = trainer.train_step(step).loss
            step += 1
        rates.append(n * GLOBAL_BATCH * SEQ_LEN / (time.perf_counter() - start))
    tp_records = [r for r in trainer.ledger.records if r.mesh_dim == "tp"]
    return {"tokens_per_s_rounds": rates, "loss": loss,
            "tp_bytes_per_step": sum(r.bytes for r in tp_records),
            "tp_wire_bytes_per_step": sum(r.wire_bytes for r in tp_records),
            "peak_rss_mib": rss_mib(), "collective_ms": _collective_ms(trainer, cfg)}


def _collective_ms(trainer, cfg, reps: int = 10) -> dict[str, float]:
    """Mean time of one all-reduce of a layer's (b, s, h) activations on the tp axis, and of
    the all-gather + reduce-scatter pair that replaces it under sequence parallelism."""
    import torch
    import torch.distributed as dist

    from fivefold.comm import collectives as C
    from fivefold.comm.collectives import Axis
    from fivefold.comm.ledger import Ledger

    tp = trainer.tp_axis
    if tp.size == 1:
        return {}
    axis = Axis("tp", tp.group, tp.size, tp.rank, Ledger())  # not the trainer's ledger
    full = torch.randn(GLOBAL_BATCH * SEQ_LEN * cfg.model.hidden)
    part = torch.empty(full.numel() // tp.size)
    ops = {"all_reduce": lambda: C.all_reduce(full, axis, "bench"),
           "all_gather": lambda: C.all_gather(full, part, axis, "bench"),
           "reduce_scatter": lambda: C.reduce_scatter(part, full, axis, "bench")}
    out = {}
    for name, op in ops.items():
        op()
        dist.barrier(group=tp.group)
        start = time.perf_counter()
        for _ in range(reps):
            op()
        out[name] = (time.perf_counter() - start) / reps * 1e3
    return out


def run_bench(steps: int, rounds: int, warmup: int) -> dict:
    from fivefold.parallel.tensor import activation_bytes_per_layer
    from fivefold.testing import run_on_ranks
    from fivefold.train.data import prepare_data

    per_round = split_rounds(steps, rounds)
    prepare_data(bench_config(1, False), log=lambda text: print(text, file=sys.stderr))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:  # never written
        for tp, sp in LAYOUTS:
            print(f"tp {tp}{' + sp' if sp else ''}: {tp} rank(s), {warmup} warm-up + {steps} "
                  "timed steps ...", file=sys.stderr)
            per_rank = run_on_ranks(_rank, tp, tp, sp, warmup, per_round, tmp, timeout_s=1800)
            cfg = bench_config(tp, sp)
            rec = per_rank[0]
            rec.update(tp=tp, sequence_parallel=sp,
                       tokens_per_s=statistics.median(rec["tokens_per_s_rounds"]),
                       peak_rss_mib=max(r["peak_rss_mib"] for r in per_rank),
                       tp_bytes_analytic=analytic_tp_bytes(cfg, sp),
                       activation_bytes_per_layer=activation_bytes_per_layer(
                           cfg.model, GLOBAL_BATCH, SEQ_LEN, tp, sp))
            results.append(rec)
            print(f"  {rec['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    base = results[0]["tokens_per_s"]
    for rec in results:
        rec["ratio_to_tp1"] = rec["tokens_per_s"] / base
    return {"config": {"preset": PRESET, "precision": "fp32", "device": "cpu",
                       "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
                       "tokens_per_step": GLOBAL_BATCH * SEQ_LEN, "timed_steps": steps,
                       "rounds": rounds, "warmup_steps": warmup, "threads_per_rank": 1},
            "machine": machine_info(),
            "layouts": results}


def table(res: dict) -> str:
    lines = ["| layout | ranks | tokens/s (median) | vs tp 1 | tp bytes / step: ledger | "
             "analytic | on the wire / rank | activation bytes / layer / rank | "
             "peak RSS / rank (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["layouts"]:
        name = f"tp {r['tp']}" + (" + sp" if r["sequence_parallel"] else "")
        lines.append(f"| {name} | {r['tp']} | {r['tokens_per_s']:,.0f} | {r['ratio_to_tp1']:.2f}"
                     f" | {r['tp_bytes_per_step']:,} | {r['tp_bytes_analytic']:,} | "
                     f"{r['tp_wire_bytes_per_step']:,} | {r['activation_bytes_per_layer']:,} | "
                     f"{r['peak_rss_mib']:,.0f} |")
    lines += ["", "| tp ranks | all-reduce (ms) | all-gather (ms) | reduce-scatter (ms) |",
              "|---:|---:|---:|---:|"]
    for r in res["layouts"]:
        ms = r["collective_ms"]
        if ms and not r["sequence_parallel"]:
            lines.append(f"| {r['tp']} | {ms['all_reduce']:.2f} | {ms['all_gather']:.2f} | "
                         f"{ms['reduce_scatter']:.2f} |")
    return "\n".join(lines)


DOC = """# Tensor parallelism and sequence parallelism

`parallel.tp = t` splits every block of the model over the t ranks of the mesh's innermost
axis (`src/fivefold/parallel/tensor.py`; collectives in `tensor_comm.py`, the loss in
`vocab_parallel_loss.py`), after Megatron-LM (arXiv 1909.08053, Sec. 3; 2104.04473,
Sec. 2.3): wq, wk, wv split by query and key/value heads (grouped-query attention included: a
group's query heads sit with their kv head), wo by the matching input columns; w1 and w3 by
MLP columns, w2 by rows; the embedding and the output head by vocabulary rows, with a
vocabulary-parallel cross-entropy that never gathers the logits. Norm gains are replicated.
`parallel.sequence_parallel = true` (2205.05198, Sec. 4.2.2) also splits the residual stream,
the norms and the inputs of the column-parallel linears along the sequence. Data parallelism
of any ZeRO stage composes with it: the engine flattens each rank's shards and runs over the
dp axes, the ranks of one tp group draw the same batch, and the clipped gradient norm sums
the shards over tp as well (replicated gains counted once).

    fivefold train --nproc 4 --set parallel.tp=2 --set parallel.sequence_parallel=true \\
        --set parallel.zero_stage=1          # tp 2 x dp 2

Rejected before any rank starts: tp not dividing `model.heads`, `model.kv_heads` or
`model.ffn_hidden`, and sequence parallelism with `model.seq_len` not divisible by tp. The
vocabulary needs nothing: it is padded to a multiple of tp with zero rows that no token
indexes and the loss leaves out (never predicted; they stay zero).

## Communication per layer

Per layer and micro-batch of b sequences of s tokens, width h, in bytes of the activation
dtype, on the tp axis (Megatron's f and g, each an all-reduce of b·s·h):

| | forward | backward |
|---|---|---|
| tp | 2 all-reduces | 2 all-reduces |
| tp + sp | 2 all-gathers + 2 reduce-scatters | 2 reduce-scatters + 2 all-gathers + 2 re-gathers |

An all-gather plus a reduce-scatter moves what one all-reduce moves, so sequence parallelism
costs no extra bandwidth except the 2 backward re-gathers of the column-parallel inputs
(each rank keeps only its sequence shard of them; 2205.05198 overlaps these with the weight
gradient). Around the layers: the embedding's reduction, the head's f (or all-gather), the
vocabulary statistics of the loss (3 floats per token per rank, one all-gather) and, with sp,
the all-reduce of the norm gains' gradients (partial sums over the rank's tokens). The tests
(`tests/test_tensor_parallel.py`) hold the ledger to these volumes exactly, for every layout.

## Activation memory per layer

Bytes kept for backward by one block on one rank, fp32, a heads of width e (h' = a·e), MLP
width f (4bsf for SwiGLU: w1 and w3 outputs, the silu output and their product; 2bsf for
GELU), derived in the docstring of `tensor.py` from what each operation saves:

| | bytes per layer per rank | 2205.05198 (16-bit, GELU MLP, s x s scores) |
|---|---|---|
| no tp | 4(6bsh + 5bsh' + 4bsf + 2bs + bas) | sbh(34 + 5as/h) |
| tp t | 4(6bsh + 2bs + (5bsh' + 4bsf + bas)/t) | sbh(10 + 24/t + 5as/(ht)) |
| tp t + sp | 4(6bsh + 5bsh' + 4bsf + 2bs + bas)/t | sbh/t (34 + 5as/h) |

The differences from the paper's constants: fp32 instead of 16-bit, no dropout masks, RMSNorm
(keeps its normalized input and 1/rms), SwiGLU, and the fused SDPA attention kernel (also on
the CPU), which keeps a logsumexp (b·a·s floats) instead of the s x s scores, softmax and
dropout mask. With one head per rank the wo input is a view of the attention output, one
b·s·h'/t less. The tests measure the saved tensors with `saved_tensors_hooks` and find these
values exactly (asserted within 2%).

## Measured throughput on CPU ranks

`bench/tensor_parallel.py`: the `tiny` preset (4 layers, width 256, 8 heads / 4 kv heads,
vocabulary 8192, tied embeddings), fp32, global batch {batch} x {seq} tokens, one thread per
rank, {warmup} warm-up and {steps} timed steps per layout in {rounds} rounds (median);
{cpus} CPUs, torch {torch}, {date}.

{table}

The ledger's bytes are logical buffers (an all-reduce counts its tensor once, an all-gather
its output, a reduce-scatter its input), so sequence parallelism shows twice the bytes of
plain tp plus the re-gathers; on the wire per rank (ring algorithms) an all-gather plus a
reduce-scatter equals one all-reduce, and only the re-gathers are extra. The second table
times one all-reduce of a layer's activations (b·s·h fp32) on the tp ranks and the all-gather
and reduce-scatter that replace it under sequence parallelism: {pair_sentence}
Each rank runs one thread, so on the CPU tp also brings more cores to the step while the
collectives take their share; with tp 4 four ranks share {cpus} cores. What tensor parallelism
buys on any hardware is memory: parameters, gradients and optimizer states divide by t (all
but the norm gains), and activations by the formulas above.

Regenerate with `.venv/bin/python bench/tensor_parallel.py` (this file is written by it).
"""


def pair_sentence(res: dict) -> str:
    """The measured cost of sequence parallelism's all-gather + reduce-scatter, in words."""
    parts = []
    for r in res["layouts"]:
        ms = r["collective_ms"]
        if ms and not r["sequence_parallel"]:
            ratio = (ms["all_gather"] + ms["reduce_scatter"]) / ms["all_reduce"]
            parts.append(f"{ratio:.1f}x at tp {r['tp']}")
    return (f"on gloo over loopback the pair took {' and '.join(parts)} the time of the "
            "all-reduce, which the sp rows pay (with the re-gathers) for their memory.")


def write_docs(res: dict) -> None:
    c, m = res["config"], res["machine"]
    DOCS.write_text(DOC.format(batch=c["global_batch"], seq=c["seq_len"], warmup=c["warmup_steps"],
                               steps=c["timed_steps"], rounds=c["rounds"], cpus=m["cpu_count"],
                               torch=m["torch"], date=m["date"][:10], table=table(res),
                               pair_sentence=pair_sentence(res)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(ap, steps=6, rounds=3, warmup=2, what="layout")
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 round, 1 warm-up, no docs")
    ap.add_argument("--no-docs", action="store_true", help=f"do not rewrite {DOCS.name}")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup, args.no_docs = 2, 1, 1, True
    res = run_bench(args.steps, args.rounds, args.warmup)
    print(table(res))
    write_json(args.json, res)
    if not args.no_docs:
        write_docs(res)
        print(f"wrote {DOCS}")


if __name__ == "__main__":
    main()

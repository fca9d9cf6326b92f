"""One-GPU training speed of the 1B preset: fivefold's trainer next to transformers' Llama.

Both sides train the same model, the `1B` preset (hidden 2048, 16 layers, 32 heads, 8 kv
heads, ffn 8192, vocabulary 128256, tied embeddings; 1.24B parameters), on one GPU at a
micro-batch of 8 x 2048 tokens, fp32 weights under bf16 autocast, fused AdamW, torch.compile,
on random tokens (speed does not depend on the data):

* fivefold: `fivefold.train.trainer.Trainer.train_step(step)`, exactly what `fivefold train`
  runs per step: each block compiled (`train.compile`), flash attention through SDPA with the
  grouped kv heads read in place, the head and loss a chunk of tokens at a time without fp32
  logits for the whole batch (fivefold.train.loss), fused AdamW, gradient clipping, and its
  learning-rate schedule.
* transformers: `LlamaForCausalLM` of the same shape (its config made by fivefold's exporter,
  fivefold.models.hf, and its parameter count checked against fivefold's), SDPA attention,
  `torch.compile(model)`, the loss from `labels` (transformers' own), `torch.optim.AdamW(
  fused=True)` with the same hyper-parameters, `clip_grad_norm_(1.0)`.

Each side runs in its own process, one after the other, so that peak memory
(`torch.cuda.max_memory_allocated` over warm-up and timed steps) is its own. Both sides read
the loss and the gradient norm back to the host once per step, after the step. A side first
runs `--warmup` untimed steps (compilation happens there), then `--steps` timed steps between
two `torch.cuda.synchronize()`. tokens/s = timed steps x 8 x 2048 / seconds. MFU = model FLOPs
per token (fivefold.models.flops: 6 x matrix parameters + 12 x layers x seq x heads x
head_dim, the convention of docs/reference/h200_measured.json) x tokens/s / the GPU's
dense bf16 peak (fivefold.hardware; H200 989 TFLOP/s; `--peak-tflops` for others).
Reported: both sides, the ratio fivefold / transformers of tokens/s and of peak memory, the
GPU, the torch and transformers versions. If the fivefold side fails while compiled, it is
run once more eagerly (marked so), so that one run always yields a number.

Run it from the source tree with torch and transformers installed (nothing else is needed;
without transformers only the fivefold side is measured, and the report says so):

    PYTHONPATH=src python bench/gpu_llama1b.py --json gpu_llama1b.json   # about 3-5 min
    python bench/gpu_llama1b.py --tiny          # CPU smoke test of the same code path

`--tiny` swaps in a 2-layer, 64-wide model at micro-batch 2 x 64 tokens in fp32 on the CPU,
one thread per side (uncompiled unless `--compile`); its numbers only show that the script
works.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import machine_info, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # the source tree's fivefold, with or without PYTHONPATH

SIDES = ("fivefold", "transformers")
BUDGET_S = 290  # the whole run, both sides; each is expected to take 1.5-2 minutes on an H200
FULL = {"preset": "1B", "micro_batch": 8, "seq_len": 2048, "precision": "bf16",
        "device": "cuda", "compile": True}
TINY = {"preset": "tiny", "micro_batch": 2, "seq_len": 64, "precision": "fp32",
        "device": "cpu", "compile": False,
        "model": ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
                  "model.ffn_hidden=128", "model.vocab=512"]}


def bench_config(spec: dict):
    """The fivefold Config both sides' shapes and hyper-parameters come from."""
    from fivefold.config import load_config
    from fivefold.validate import validate_for_training

    sets = [f'model.preset="{spec["preset"]}"', f"model.seq_len={spec['seq_len']}",
            *spec.get("model", []), f"parallel.global_batch={spec['micro_batch']}",
            f"parallel.micro_batch={spec['micro_batch']}",
            f'parallel.precision="{spec["precision"]}"', f'train.device="{spec["device"]}"',
            f"train.compile={'true' if spec['compile'] else 'false'}",
            f"train.steps={spec['warmup'] + spec['steps']}", "train.warmup_steps=1",
            "train.tensorboard=false", "train.sample_tokens=0"]
    cfg = load_config(None, sets)
    validate_for_training(cfg, 1)
    return cfg


# ------------------------------------------------------------------ the two sides

def _device_setup(spec: dict):
    import torch

    if spec["device"] == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible; run with --tiny on a CPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def fivefold_side(spec: dict) -> dict:
    """Trainer.train_step on random tokens; returns losses and per-step times."""
    import numpy as np

    from fivefold.models.flops import param_count
    from fivefold.train.data import TokenData
    from fivefold.train.dist import Runtime
    from fivefold.train.trainer import Trainer

    device = _device_setup(spec)
    cfg = bench_config(spec)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab, size=64 * cfg.model.seq_len, dtype=np.uint32)
    data = TokenData(tokens[: 48 * cfg.model.seq_len], tokens[48 * cfg.model.seq_len:], None)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as run_dir:  # never written
        trainer = Trainer(cfg, Runtime(0, 1, 0, device), run_dir, data)
        step = lambda i: trainer.train_step(i).loss  # noqa: E731
        out = _timed(step, spec, device)
    out["params"] = param_count(cfg.model)
    out["compiled"] = cfg.train.compile
    return out


def transformers_side(spec: dict) -> dict:
    """transformers' LlamaForCausalLM, compiled, with fused AdamW, on random tokens."""
    import torch

    try:
        import transformers
    except ImportError as err:
        return {"error": f"transformers is not installed ({err}); `pip install transformers` "
                         "to measure the baseline"}
    from fivefold.models.flops import param_count
    from fivefold.models.hf import hf_config_from_model

    device = _device_setup(spec)
    cfg = bench_config(spec)
    m, t = cfg.model, cfg.train
    hf_config = transformers.LlamaConfig.from_dict(hf_config_from_model(m, torch.float32))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config,
                                                              attn_implementation="sdpa")
    params = sum(p.numel() for p in model.parameters())
    if params != param_count(m):
        raise RuntimeError(f"transformers' model has {params} parameters, fivefold's "
                           f"{param_count(m)}: the two sides would not train the same model")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=t.lr,
                                  betas=(t.beta1, t.beta2), eps=t.eps,
                                  fused=device.type == "cuda")
    forward = torch.compile(model) if spec["compile"] else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=spec["precision"] == "bf16")
    gen = torch.Generator(device).manual_seed(0)

    def step(_: int) -> float:
        x = torch.randint(0, m.vocab, (spec["micro_batch"], m.seq_len), device=device,
                          generator=gen)
        model.train()
        with autocast:
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        grad_norm.item()
        return loss.item()

    out = _timed(step, spec, device)
    out["params"] = params
    out["compiled"] = spec["compile"]
    out["transformers"] = transformers.__version__
    return out


def _timed(step, spec: dict, device) -> dict:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    losses = [step(i) for i in range(spec["warmup"])]
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_s = []
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        losses.append(step(i))  # each side reads its loss back: the step has finished
        step_s.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_max_rss"
    tokens = spec["micro_batch"] * spec["seq_len"]
    return {"tokens_per_s": tokens * len(step_s) / sum(step_s),
            "step_s_median": statistics.median(step_s), "step_s": step_s,
            "warmup_s": warmup_s, "peak_mem_bytes": peak, "peak_mem_kind": kind,
            "first_loss": losses[0], "last_loss": losses[-1]}


def worker(side: str, spec_json: str) -> None:
    """Run one side and print its result as one JSON line (last line of stdout)."""
    spec = json.loads(spec_json)
    run = fivefold_side if side == "fivefold" else transformers_side
    try:
        result = run(spec)
    except Exception as err:  # reported by the parent, which may retry eagerly
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------ the driver

def run_side(side: str, spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, json.dumps(spec)]
    print(f"[{side}] starting ({'compiled' if spec['compile'] else 'eager'}) ...",
          file=sys.stderr, flush=True)
    if timeout_s < 10:
        return {"error": "no time left in the run's budget (--budget-s)"}
    env = dict(os.environ)
    if spec["device"] == "cpu":  # a smoke test: one thread keeps it quick on a busy machine
        env["OMP_NUM_THREADS"] = "1"
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout_s,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"worker exited with code {proc.returncode} and no result; see above"}


def gpu_info(device: str) -> dict:
    """The machine, plus the GPU and the transformers version of the peer side."""
    import torch

    try:
        import transformers
        info = {"transformers": transformers.__version__}
    except ImportError:
        info = {"transformers": None}
    cuda = device == "cuda" and torch.cuda.is_available()
    info["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    info["cuda"] = torch.version.cuda if cuda else None
    return machine_info(**info)


def peak_flops(spec: dict, override_tflops: float | None) -> float | None:
    import torch

    from fivefold.train.dist import detect_profile

    if override_tflops:
        return override_tflops * 1e12
    device = torch.device(spec["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    profile = detect_profile(device)
    return profile.peak_flops(spec["precision"]) if profile else None


def run_bench(spec: dict, override_tflops: float | None = None,
              budget_s: float = BUDGET_S) -> dict:
    from fivefold.models.flops import flops_per_token

    cfg = bench_config(spec)  # fails here, before any worker, on a bad spec
    fpt = flops_per_token(cfg.model)
    peak = peak_flops(spec, override_tflops)
    result = {"config": {**{k: v for k, v in spec.items() if k != "model"},
                         "model": {k: v for k, v in vars(cfg.model).items() if k != "moe"},
                         "tokens_per_step": spec["micro_batch"] * spec["seq_len"],
                         "flops_per_token": fpt, "peak_flops": peak},
              "machine": gpu_info(spec["device"])}
    deadline = time.monotonic() + budget_s
    for side in SIDES:
        reserve = 0.45 * budget_s if side == "fivefold" else 0.0  # left for the baseline
        out = run_side(side, spec, deadline - reserve - time.monotonic())
        left = deadline - reserve - time.monotonic()
        if side == "fivefold" and "error" in out and spec["compile"] and left > 30:
            print(f"[fivefold] compiled run failed ({out['error']}); running it eagerly",
                  file=sys.stderr)
            out = {**run_side(side, {**spec, "compile": False}, left),
                   "compiled_error": out["error"]}
        if "tokens_per_s" in out:
            out["mfu"] = fpt * out["tokens_per_s"] / peak if peak else None
            out["peak_mem_gib"] = out["peak_mem_bytes"] / 2**30
        result[side] = out
    f, h = result["fivefold"], result["transformers"]
    if "tokens_per_s" in f and "tokens_per_s" in h:
        result["ratio"] = {"tokens_per_s": f["tokens_per_s"] / h["tokens_per_s"],
                           "peak_mem": f["peak_mem_bytes"] / h["peak_mem_bytes"]}
    else:
        result["ratio"] = None
    return result


def print_report(res: dict) -> None:
    c, m = res["config"], res["machine"]
    where = m["gpu"] or f"CPU ({m['cpu_count']} cores)"
    print(f"{c['model']['preset']} preset ({c['model']['layers']} layers, hidden "
          f"{c['model']['hidden']}, vocab {c['model']['vocab']}), micro-batch "
          f"{c['micro_batch']} x {c['seq_len']} tokens, {c['precision']}, "
          f"{c['steps']} timed steps after {c['warmup']} warm-up; {where}, torch {m['torch']}, "
          f"transformers {m['transformers'] or 'not installed'}")
    rows = [("tokens/s", "tokens_per_s", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
            ("peak memory (GiB)", "peak_mem_gib", "{:.2f}"),
            ("median step (s)", "step_s_median", "{:.4f}"), ("first loss", "first_loss", "{:.3f}"),
            ("compiled", "compiled", "{}")]
    print(f"{'':<20}{'fivefold':>14}{'transformers':>14}{'ratio':>9}")
    for label, key, fmt in rows:
        cells = []
        for side in SIDES:
            value = res[side].get(key)
            cells.append("—" if value is None else fmt.format(value))
        ratio = {"tokens_per_s": "tokens_per_s", "peak_mem_gib": "peak_mem"}.get(key)
        r = res["ratio"][ratio] if res["ratio"] and ratio else None
        print(f"{label:<20}{cells[0]:>14}{cells[1]:>14}{'' if r is None else f'{r:.3f}':>9}")
    for side in SIDES:
        if "error" in res[side]:
            print(f"{side}: {res[side]['error']}")
    if res["config"]["peak_flops"] is None:
        print("MFU not computed: unknown device peak; pass --peak-tflops")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side (default 10)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first, compilation included (default 3)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile both sides (default: on for the GPU run, off for --tiny)")
    ap.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: detected)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"wall-clock limit of the whole run, both sides (default {BUDGET_S})")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: worker mode
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        worker(args.side, args.spec)
        return 0
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    spec = dict(TINY if args.tiny else FULL, steps=args.steps, warmup=args.warmup)
    if args.compile is not None:
        spec["compile"] = args.compile
    res = run_bench(spec, args.peak_tflops, args.budget_s)
    print_report(res)
    write_json(args.json, res)
    return 0 if "tokens_per_s" in res["fivefold"] else 1


if __name__ == "__main__":
    sys.exit(main())

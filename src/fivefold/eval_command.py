"""`fivefold eval`: the loss and perplexity of a checkpoint on held-out data.

    fivefold eval RUN_DIR [--data PATH] [--batches N] [--set key=value]... [--nproc N] [--json]

RUN_DIR is a run directory (its latest complete checkpoint is taken) or one checkpoint step
folder. The model, data and seed are the run's own (its meta.json config), so by default the
loss is that of the run's validation pass: the same `train.eval_batches` global batches of
the validation split (`--batches N` for another count), and on the run's layout it equals the
last `val_loss` of metrics.jsonl. `--data` evaluates a text/JSONL file or folder instead, all
of it held out and tokenized with the run's tokenizer (cached like the training data), or a
raw token-id file; the windows are drawn as the validation pass draws them.

Any layout: the weights are read whole from the checkpoint (as `--init-from` reads them,
fivefold.train.checkpoint_export) and split by this run's layout, so one process
(`--nproc 1`, the default: the run's precision, global batch and micro-batch on a plain
layout) evaluates a checkpoint of any layout, and `--nproc N` runs the run's own layout (or,
with `--set parallel.*`, another) on N local ranks. Perplexity is exp(loss), the loss being
the mean token cross-entropy in nats.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
from pathlib import Path

from fivefold.config import Config, ConfigError, config_from_raw
from fivefold.models.presets import PRESETS

# what a one-process evaluation keeps of the run's parallel table: the batches and numerics
ONE_PROCESS_KEYS = ("global_batch", "micro_batch", "precision", "fp8_emulate", "fp8_recipe",
                    "fp8_tensors")


def add_parser(sub) -> None:
    """`fivefold eval`'s arguments, on the command line's subparsers."""
    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint on held-out data")
    p.add_argument("run", metavar="RUN_DIR",
                   help="a run directory (its latest checkpoint) or a checkpoint step folder")
    p.add_argument("--data", metavar="PATH",
                   help="text/JSONL file or folder, or raw token-id file, to evaluate on "
                        "(default: the run's validation split)")
    p.add_argument("--batches", type=int, metavar="N",
                   help="global batches to evaluate (default: the run's train.eval_batches)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override one key of the run's config")
    p.add_argument("--nproc", type=int, default=1,
                   help="local ranks (default 1: one process, whatever the run's layout)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def eval_config(meta: dict, overrides: list[str], batches: int | None,
                one_process: bool) -> Config:
    """The run's config (from a checkpoint's `meta`) for evaluation: with `one_process`, its
    parallel table cut to the batches and numerics; then `--batches` and `--set`."""
    raw = copy.deepcopy(meta.get("config") or {})
    model = raw.get("model", {})
    if model.get("preset") not in PRESETS:  # every shape key is saved: a custom model
        model.pop("preset", None)
    if one_process:
        parallel = raw.get("parallel", {})
        raw["parallel"] = {key: parallel[key] for key in ONE_PROCESS_KEYS if key in parallel}
    if batches is not None:
        if batches < 1:
            raise ConfigError("--batches", f"must be at least 1, got {batches}")
        overrides = [*overrides, f"train.eval_batches={batches}"]
    return config_from_raw(raw, overrides)


def held_out_data(cfg: Config, path: str | None, log):
    """The token data to evaluate on: the run's (validation split), or all of `path`
    tokenized with the run's tokenizer (or read as raw ids) as the held-out stream."""
    from dataclasses import replace

    from fivefold.train.corpus import detect_format, load_documents
    from fivefold.train.data import (TokenData, cache_dir, check_data, load_tokens_file,
                                     prepare_data, tokenized_splits)

    if path is None:
        return prepare_data(cfg, log)
    if not Path(path).exists():
        raise ConfigError("--data", f"path {path!r} does not exist")
    one = replace(cfg.data, source=str(path), format="auto", sources=None)
    tok = None
    if detect_format(one) == "tokens":  # the run's data is not needed
        tokens = load_tokens_file(replace(cfg, data=replace(one, val_fraction=0.0))).train
    else:
        run_data = prepare_data(cfg, log)  # cached since the run
        tok, special = run_data.tokenizer, run_data.special
        if tok is None:
            raise ConfigError("--data", "the run trained on token ids without a tokenizer; "
                                        "give a token-id file (.bin or .tokens)")
        docs = load_documents(one)
        hasher = hashlib.sha256(tok.to_str().encode() + repr(special).encode())
        for doc in docs:
            hasher.update(doc.name.encode() + b"\0" + doc.text.encode() + b"\0")
        stem = cache_dir(cfg.data) / f"heldout-{hasher.hexdigest()[:16]}"
        # every document held out: one stream, cached as the "train" half of a split
        tokens, _ = tokenized_splits(tok, special, docs, [], stem, cfg.model.vocab, log)
    data = TokenData(tokens, tokens, tok)
    check_data(cfg, data, "--data")
    return data


def rank_args(args: argparse.Namespace) -> list[str]:
    """The command line each launched rank runs: this one without `--nproc`."""
    return ["eval", args.run, *(["--data", args.data] if args.data else []),
            *(["--batches", str(args.batches)] if args.batches is not None else []),
            *(arg for assignment in args.overrides for arg in ("--set", assignment)),
            *(["--json"] if args.json else [])]


def run(args: argparse.Namespace) -> int:
    """Evaluate, on this process or on `--nproc` launched ranks; rank 0 prints the result."""
    from fivefold.parallel.fp8.linear import has_fp8_units
    from fivefold.parallel.plan import training_plan
    from fivefold.train.checkpoint_export import checkpoint_step
    from fivefold.train.dist import init_runtime, pick_device, shutdown
    from fivefold.train.launch import launch_local, launched_by_torchrun
    from fivefold.train.trainer import Trainer

    if args.nproc < 1:
        raise ConfigError("--nproc", f"must be at least 1, got {args.nproc}")
    under_launcher = launched_by_torchrun()
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher else args.nproc
    step = checkpoint_step(Path(args.run))
    meta = json.loads((step / "meta.json").read_text())
    cfg = eval_config(meta, args.overrides, args.batches, one_process=world_size == 1)
    try:
        device = pick_device(cfg.train.device, 0)
    except RuntimeError as err:
        raise ConfigError("train.device", str(err)) from None
    plan = training_plan(cfg, world_size, device.type, has_fp8_units(device.type))
    data = held_out_data(cfg, args.data, lambda text: print(text, file=sys.stderr))
    if world_size > 1 and not under_launcher:  # checked and tokenized once, here
        return launch_local(args.nproc, rank_args(args))
    rt = init_runtime(cfg.train.device, cfg.train.timeout_s)
    try:
        trainer = Trainer(cfg, rt, step.parent.parent, data=data, init_from=step, plan=plan)
        loss = trainer.evaluate()
    finally:
        shutdown()
    if rt.is_main:
        result = {"loss": loss, "perplexity": math.exp(loss),
                  "tokens": cfg.train.eval_batches * trainer.global_tokens,
                  "step": meta["step"], "checkpoint": str(step),
                  "data": args.data or "validation split"}
        print(json.dumps(result) if args.json else
              f"eval {step} (step {meta['step']}) on {result['data']}: loss "
              f"{loss:.4f}, perplexity {result['perplexity']:.2f} over {result['tokens']} "
              f"tokens ({cfg.train.eval_batches} batches of {plan.global_batch} x "
              f"{cfg.model.seq_len})", flush=True)
    return 0

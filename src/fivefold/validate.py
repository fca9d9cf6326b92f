"""Every value check and every cross-field check of a `Config`, in one place.

`validate(cfg)` checks what holds for any use (plan, simulate, train); `validate_for_training`
adds what the runtime of today can execute, given the number of ranks it will launch: the
values and divisibility it needs, here, and the pairs of features it does not run together,
from the one table in fivefold.compositions. The `[parallel]` section's checks are in
fivefold.validate_parallel, the runtime's per-feature needs in fivefold.validate_runtime.
Each failure raises `ConfigError` naming the key and the fix; nothing here touches torch.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.cluster_groups import validate_groups
from fivefold.compositions import REFUSALS, check_compositions
from fivefold.config import Config, ConfigError
from fivefold.data_sources import DATA_FORMATS, TOKEN_DTYPES, validate_sources
from fivefold.lr_schedule import validate_schedule
from fivefold.models.validate_model import FFN_TYPES  # noqa: F401 (the config fuzz reads it here)
from fivefold.models.validate_model import check_model, choice as _choice, positive as _positive
from fivefold.validate_parallel import FP8_TENSORS  # noqa: F401 (planner.compute reads it here)
from fivefold.validate_parallel import validate_parallel
from fivefold.validate_runtime import (validate_context_parallel, validate_fp8_runtime,
                                       validate_tensor_parallel)

OPTIMIZERS = ("adamw", "muon", "sgd", "lomo", "galore")
STACKS = ("fivefold", "megatron", "torchtitan", "deepspeed")  # fivefold.planner.stack
DEVICES = ("auto", "cpu", "cuda")
MAX_TIMEOUT_S = 1e9  # about 30 years: a collective timeout beyond it overflows timedelta


def validate_model(cfg: Config) -> None:
    check_model(cfg.model)  # fivefold.models.validate_model: what Hugging Face import checks too


def validate_stack_release(stack: str, release) -> None:
    if stack == "fivefold":
        raise ConfigError("train.stack_release", "fivefold is this runtime, at this version; "
                                                 "drop train.stack_release or name another "
                                                 "train.stack")
    ok = (isinstance(release, str) and len(release) == 7 and release[4] == "-"
          and release[:4].isdigit() and release[5:].isdigit() and 1 <= int(release[5:]) <= 12)
    if not ok:
        raise ConfigError("train.stack_release", f"{release!r} is not a \"YYYY-MM\" release "
                                                 "date (e.g. \"2025-11\" for a 25.11 "
                                                 "container)")


def validate_train(cfg: Config) -> None:
    t = cfg.train
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    _choice("train.stack", t.stack, STACKS)
    if t.stack_release is not None:
        validate_stack_release(t.stack, t.stack_release)
    _choice("train.device", t.device, DEVICES)
    _choice("train.on_nonfinite", t.on_nonfinite, ("stop", "skip"))
    _positive("train.steps", t.steps)
    _positive("train.lr", t.lr)
    _positive("train.eps", t.eps)
    _positive("train.timeout_s", t.timeout_s)
    if t.timeout_s > MAX_TIMEOUT_S:  # torch's timedelta overflows beyond
        raise ConfigError("train.timeout_s", f"{t.timeout_s} s is beyond any wait; use at most "
                                             f"{MAX_TIMEOUT_S:.0e} s")
    _positive("train.seed", t.seed, allow_zero=True)  # numpy's generators take no negatives
    _positive("train.checkpoint_minutes", t.checkpoint_minutes)
    _positive("train.galore_update_gap", t.galore_update_gap)
    _positive("train.galore_scale", t.galore_scale)
    _choice("train.galore_svd", t.galore_svd, ("exact", "randomized"))
    _choice("train.galore_reduce", t.galore_reduce, ("full", "projected"))
    if t.galore_reduce == "projected" and t.grad_clip:
        raise ConfigError("train.galore_reduce", "'projected' reduces each matrix's projected "
                                                 "gradient, from which the full gradient's "
                                                 "global norm cannot be had, so clipping by "
                                                 "it is not possible: set train.grad_clip = 0 "
                                                 "or galore_reduce = 'full'")
    for key in ("weight_decay", "grad_clip", "sample_tokens"):
        _positive(f"train.{key}", getattr(t, key), allow_zero=True)
    for key in ("eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
                "log_every"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("beta1", "beta2", "muon_momentum", "min_lr_ratio"):
        value = getattr(t, key)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"train.{key}", f"must lie in [0, 1], got {value}")
    validate_schedule(t)


def validate_data(cfg: Config) -> None:
    d = cfg.data
    _choice("data.format", d.format, DATA_FORMATS)
    _choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    if not 0.0 < d.val_fraction < 0.5:
        raise ConfigError("data.val_fraction", f"must lie in (0, 0.5), got {d.val_fraction}")
    _positive("data.tokenizer_sample_mib", d.tokenizer_sample_mib)
    if d.source != "stdlib" and not Path(d.source).exists():
        raise ConfigError("data.source", f"path {d.source!r} does not exist; give an existing "
                                         "text/JSONL/token file or folder, or 'stdlib'")
    if d.tokenizer is not None and not Path(d.tokenizer).is_file():
        raise ConfigError("data.tokenizer", f"file {d.tokenizer!r} does not exist")
    if d.format == "tokens" and d.token_dtype == "uint16" and cfg.model.vocab > 65536:
        raise ConfigError("data.token_dtype", f"uint16 cannot hold ids of a {cfg.model.vocab}-"
                                              "token vocabulary; use 'uint32'")
    if d.format == "tokens" and (d.source == "stdlib" or Path(d.source).is_dir()):
        raise ConfigError("data.format", f"'tokens' reads one raw token-id file, and "
                                         f"{d.source!r} is not a file; give data.source a .bin "
                                         "or .tokens file, or use format 'auto'")
    validate_sources(cfg)  # [[data.sources]]


def validate_cluster(cfg: Config) -> None:
    for key in ("gpus", "gpus_per_node", "intra_node_GBps", "inter_node_GBps"):
        _positive(f"cluster.{key}", getattr(cfg.cluster, key))
    validate_groups(cfg)  # [[cluster.groups]], prices, failure rates: fivefold.cluster_groups


def validate_comm(cfg: Config) -> None:
    """The `[comm]` section: known algorithms per collective, and readable topology, sketch
    and schedule files (a topology whose links connect every rank, a schedule that covers
    every chunk); "synthesized" needs a topology or a schedule."""
    from fivefold.comm.choice import algorithm_table
    from fivefold.comm.schedule import load_schedule
    from fivefold.comm.topology import load_topology

    c = cfg.comm
    table = algorithm_table(c.algorithm)
    if c.topology is not None:
        load_topology(c.topology)
    if c.sketch is not None:
        from fivefold.comm.synthesize import load_sketch
        load_sketch(c.sketch)
    if c.schedule is not None:
        load_schedule(c.schedule)
    if "synthesized" in table.values() and c.topology is None and c.schedule is None:
        raise ConfigError("comm.algorithm", "\"synthesized\" needs comm.topology (and "
                                            "optionally comm.sketch) or a comm.schedule file; "
                                            "set one, or choose \"hierarchical\"")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every value and combination that any use of the config relies on."""
    validate_model(cfg)
    validate_comm(cfg)
    validate_cluster(cfg)  # before parallel, which divides by cluster.gpus
    validate_parallel(cfg, world_size if world_size is not None else cfg.cluster.gpus)
    validate_train(cfg)
    validate_data(cfg)


def validate_for_training(cfg: Config, world_size: int, fp8_units: bool = False) -> None:
    """`validate`, then reject what the runtime cannot execute yet (each says what to use);
    `fp8_units`: whether the device runs fp8 GEMMs (fivefold.train.dist.has_fp8_units)."""
    validate(cfg, world_size)
    p = cfg.parallel
    if cfg.train.stack != "fivefold":
        raise ConfigError("train.stack", f"{cfg.train.stack!r} names another software stack, "
                                         "which plan and simulate predict but fivefold does not"
                                         " run; set train.stack = \"fivefold\" to train")
    validate_tensor_parallel(cfg)
    validate_context_parallel(cfg)
    if p.ep > 1 and cfg.model.moe is None:
        raise ConfigError("parallel.ep", "expert parallelism needs model.moe (a dense model "
                                         "has no experts to place); set it to 1")
    if p.precision == "fp8":
        validate_fp8_runtime(cfg, fp8_units)
    check_compositions(cfg, world_size // (p.tp * p.pp * p.cp), REFUSALS)  # the pairs


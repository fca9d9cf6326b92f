"""Every value check and every cross-field check of a `Config`, in one place.

`validate(cfg)` checks what holds for any use (plan, simulate, train); `validate_for_training`
adds what the runtime of today can execute, given the number of ranks it will launch: the
values and divisibility it needs, here, and the pairs of features it does not run together,
from the one table in fivefold.compositions. Each failure raises `ConfigError` naming the key
and the fix; nothing here touches torch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from fivefold.batch_shares import check_batch_split
from fivefold.cluster_groups import validate_groups
from fivefold.compositions import ANY_USE, REFUSALS, check_compositions
from fivefold.config import Config, ConfigError
from fivefold.expert_grid import validate_expert_grid
from fivefold.data_sources import DATA_FORMATS, TOKEN_DTYPES, validate_sources
from fivefold.lr_schedule import validate_schedule
from fivefold.models.validate_model import FFN_TYPES  # noqa: F401 (the config fuzz reads it here)
from fivefold.models.validate_model import (check_model, choice as _choice,
                                            divisors as _divisors, positive as _positive)

CP_MODES = ("ulysses", "ring", "hybrid")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "pipedream-2bw",
             "terapipe")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank in a V (pipeline.schedules_v)
RECOMPUTE = ("none", "selective", "full")
OFFLOADS = ("none", "cpu", "nvme")  # fivefold.memory.offload
OFFLOAD_KERNELS = ("foreach", "fused")
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
FP8_RECIPES = ("tensorwise", "rowwise")  # fivefold.parallel.fp8.recipe
FP8_TENSORS = ("input", "weight", "grad_output")  # the tensor classes a recipe rounds to fp8
OPTIMIZERS = ("adamw", "muon", "sgd", "lomo", "galore")
STACKS = ("fivefold", "megatron", "torchtitan", "deepspeed")  # fivefold.planner.stack
DEVICES = ("auto", "cpu", "cuda")
MAX_TIMEOUT_S = 1e9  # about 30 years: a collective timeout beyond it overflows timedelta


def validate_model(cfg: Config) -> None:
    check_model(cfg.model)  # fivefold.models.validate_model: what Hugging Face import checks too


def validate_parallel(cfg: Config, world_size: int | None) -> None:
    p = cfg.parallel
    for key in ("tp", "pp", "cp", "ep", "etp", "vpp", "global_batch"):
        _positive(f"parallel.{key}", getattr(p, key))
    _positive("parallel.dp", p.dp)
    _positive("parallel.micro_batch", p.micro_batch)
    _positive("parallel.zero_group", p.zero_group)
    _positive("parallel.cp_ulysses", p.cp_ulysses)
    _choice("parallel.cp_mode", p.cp_mode, CP_MODES)
    _choice("parallel.schedule", p.schedule, SCHEDULES)
    _choice("parallel.recompute", p.recompute, RECOMPUTE)
    validate_offload(cfg)
    if p.precision is not None:
        _choice("parallel.precision", p.precision, PRECISIONS)
    _choice("parallel.fp8_recipe", p.fp8_recipe, FP8_RECIPES)
    for name in p.fp8_tensors:
        _choice("parallel.fp8_tensors", name, FP8_TENSORS)
    if len(set(p.fp8_tensors)) != len(p.fp8_tensors):
        raise ConfigError("parallel.fp8_tensors", f"{p.fp8_tensors} names a class twice; list "
                                                  "each of input, weight, grad_output once")
    if p.reduce_dtype is not None:
        _choice("parallel.reduce_dtype", p.reduce_dtype, ("fp32", "bf16", "fp16"))
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero_stage", f"{p.zero_stage} is not a ZeRO stage; use 0 "
                                                 "(plain data parallel), 1, 2 or 3")
    model_ranks = p.tp * p.pp * p.cp
    if world_size is not None:
        if world_size % model_ranks:
            raise ConfigError("parallel.tp", f"tp*pp*cp = {model_ranks} does not divide the "
                                             f"{world_size} ranks")
        dp = world_size // model_ranks
        if p.dp is not None and p.dp != dp:
            raise ConfigError("parallel.dp", f"{p.dp} ranks of data parallelism, but {world_size}"
                                             f" ranks / (tp*pp*cp = {model_ranks}) = {dp}; omit "
                                             "parallel.dp or make the product match")
    else:
        dp = p.dp or 1
    if p.zero_group is not None and dp % p.zero_group:
        raise ConfigError("parallel.zero_group", f"{p.zero_group} does not divide the "
                                                 f"data-parallel degree {dp}; choose one of "
                                                 f"{_divisors(dp)}")
    check_batch_split(p, dp, world_size is not None or p.dp is not None, cfg.train.optimizer)
    check_compositions(cfg, dp, ANY_USE)
    if p.hpz or p.qgz:
        shard = p.zero_group or dp
        per_node = ranks_per_node(cfg.cluster.gpus_per_node, p.tp, p.cp, shard)
        if shard % per_node:
            raise ConfigError("cluster.gpus_per_node", f"{per_node} data-parallel ranks per node"
                                                       f" do not divide the shard group of "
                                                       f"{shard}; choose gpus_per_node so they "
                                                       "do")
    validate_expert_grid(cfg, dp)
    moe = cfg.model.moe
    if moe is not None and moe.experts % p.ep:
        raise ConfigError("parallel.ep", f"{p.ep} does not divide model.moe.experts = "
                                         f"{moe.experts}: every ep rank holds the same number "
                                         f"of experts; choose one of {_divisors(moe.experts)}")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel", "needs parallel.tp > 1")
    if p.vpp > 1 and p.schedule not in ("interleaved", *V_SCHEDULES):
        raise ConfigError("parallel.vpp", f"virtual stages need parallel.schedule = "
                                          f"'interleaved', 'zbv' or 'dualpipev', not "
                                          f"{p.schedule!r}")
    if p.schedule in V_SCHEDULES and (p.pp < 2 or p.vpp != 2):
        raise ConfigError("parallel.vpp" if p.pp >= 2 else "parallel.pp",
                          f"{p.schedule} places two chunks on each of at least two pipeline "
                          f"ranks (a V: down the ranks and back); set parallel.pp >= 2 and "
                          f"parallel.vpp = 2 (got pp = {p.pp}, vpp = {p.vpp})")
    validate_pipeline(cfg, dp)


def validate_offload(cfg: Config) -> None:
    """`parallel.offload` and its companions: a known tier and kernel, a fraction in (0, 1], and
    for "nvme" a directory that exists (or can be made) and is writable, checked here so
    that no rank finds out in its first optimizer step."""
    p = cfg.parallel
    _choice("parallel.offload", p.offload, OFFLOADS)
    _choice("parallel.offload_kernel", p.offload_kernel, OFFLOAD_KERNELS)
    if p.offload != "none" and p.offload_kernel == "fused" and cfg.train.optimizer == "sgd":
        raise ConfigError("parallel.offload_kernel", "\"fused\" is torch's fused CPU AdamW; "
                          "the offloaded SGD step has one kernel: set it to \"foreach\"")
    if not 0.0 < p.offload_fraction <= 1.0:  # also rejects NaN
        raise ConfigError("parallel.offload_fraction", f"must lie in (0, 1], got "
                                                       f"{p.offload_fraction}")
    if p.offload != "nvme":
        return
    if p.offload_path is None:
        raise ConfigError("parallel.offload_path", "offload = \"nvme\" needs a directory for "
                                                   "the optimizer-state files; set "
                                                   "parallel.offload_path")
    path = Path(p.offload_path)
    existing = next((q for q in (path, *path.parents) if q.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("parallel.offload_path", f"{p.offload_path!r} is not a writable "
                                                   "directory (nor can it be created in one); "
                                                   "give a directory on a local NVMe drive "
                                                   "that this user can write")


def validate_pipeline(cfg: Config, dp: int) -> None:
    """Stages, chunks, micro-batches and slices of pipeline parallelism (docs/pipeline.md)."""
    p, layers = cfg.parallel, cfg.model.layers
    stages = p.pp * p.vpp
    _positive("parallel.token_slices", p.token_slices)
    if p.pp > layers:
        raise ConfigError("parallel.pp", f"{p.pp} pipeline stages but model.layers = {layers}: "
                                         f"every stage needs at least one block; use pp <= "
                                         f"{layers}")
    if stages > layers:
        raise ConfigError("parallel.vpp", f"pp*vpp = {stages} virtual stages but model.layers ="
                                          f" {layers}: every chunk needs at least one block; "
                                          f"use vpp <= {layers // p.pp}")
    if p.stage_layers is not None:
        counts = p.stage_layers
        if len(counts) != stages or min(counts) < 1 or sum(counts) != layers:
            raise ConfigError("parallel.stage_layers", f"{counts} must list pp*vpp = {stages} "
                                                       f"block counts of at least 1 that sum to "
                                                       f"model.layers = {layers}")
    elif p.schedule == "interleaved" and p.vpp > 1 and layers % p.pp:
        raise ConfigError("parallel.vpp", f"interleaving cuts each stage into vpp equal chunks, "
                                          f"but model.layers = {layers} does not split evenly "
                                          f"over pp = {p.pp}; change one of them or list the "
                                          "blocks per chunk in parallel.stage_layers")
    elif p.schedule == "interleaved" and p.vpp > 1 and (layers // p.pp) % p.vpp:
        per_stage = layers // p.pp
        raise ConfigError("parallel.vpp", f"{p.vpp} does not divide the {per_stage} blocks per "
                                          f"stage (model.layers {layers} / pp {p.pp}); choose "
                                          f"one of {_divisors(per_stage)} or list the blocks per "
                                          "chunk in parallel.stage_layers")
    if p.token_slices is not None:
        if p.schedule != "terapipe":
            raise ConfigError("parallel.token_slices", "token slices are TeraPipe's; set "
                                                       "parallel.schedule = 'terapipe' or drop it")
        if p.token_slices > cfg.model.seq_len:
            raise ConfigError("parallel.token_slices", f"{p.token_slices} slices of a "
                                                       f"{cfg.model.seq_len}-token sequence leave"
                                                       " some empty; use at most model.seq_len")
    if p.weight_prediction and not (p.pp > 1 and p.schedule == "pipedream-2bw"):
        raise ConfigError("parallel.weight_prediction", "it offsets PipeDream-2BW's stale "
                                                        "gradients; use it with parallel.pp > 1 "
                                                        "and parallel.schedule = "
                                                        "'pipedream-2bw', or set it to false")
    if p.pp == 1:
        return
    per_rank = p.global_batch // dp
    micro = per_rank // (p.micro_batch or per_rank)
    if p.schedule == "interleaved" and micro > p.pp and micro % p.pp:
        raise ConfigError("parallel.micro_batch", f"the interleaved schedule sends micro-batches "
                                                  f"round the {p.pp} stages in groups of pp: "
                                                  f"{micro} per step ({per_rank} sequences per dp"
                                                  f" rank / micro_batch {p.micro_batch}) must be "
                                                  f"a multiple of {p.pp}, or at most {p.pp}")
    if p.schedule == "pipedream-2bw" and micro < p.pp:
        raise ConfigError("parallel.micro_batch", f"PipeDream-2BW needs at least pp = {p.pp} "
                                                  f"micro-batches per step, got {micro} "
                                                  f"({per_rank} sequences per dp rank / "
                                                  f"micro_batch {p.micro_batch or per_rank}); "
                                                  "lower parallel.micro_batch")


def ranks_per_node(gpus_per_node: int, tp: int, cp: int, shard: int) -> int:
    """Ranks of one data-parallel shard group on a node (tp and cp ranks fill a node first):
    ZeRO++'s hpZ and qgZ groups."""
    return max(1, min(shard, gpus_per_node // (tp * cp)))


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


def validate_tensor_parallel(cfg: Config) -> None:
    """What the tensor-parallel runtime (fivefold.parallel.tensor) needs: whole attention and
    key/value heads and whole MLP columns per rank, and with sequence parallelism an even split
    of the sequence. The vocabulary needs nothing: it is padded to a multiple of tp."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    common = _divisors(math.gcd(m.heads, m.n_kv_heads, m.ffn_hidden))
    for key, value, what in (("heads", m.heads, "attention heads"),
                             ("kv_heads", m.n_kv_heads, "key/value heads"),
                             ("ffn_hidden", m.ffn_hidden, "MLP columns")):
        if value % p.tp:
            raise ConfigError("parallel.tp", f"{p.tp} does not divide model.{key} = {value}: each "
                                             f"tensor-parallel rank needs whole {what}; choose "
                                             f"tp among {common}")
    if p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError("parallel.sequence_parallel", f"model.seq_len = {m.seq_len} does not "
                                                        f"split evenly over tp = {p.tp} ranks; "
                                                        f"use a multiple of {p.tp} or turn "
                                                        "sequence parallelism off")


def validate_context_parallel(cfg: Config) -> None:
    """What the context-parallel runtime (fivefold.parallel.context) needs; what it does not
    compose with is in fivefold.compositions. Ring attention's zigzag split cuts each
    sequence into 2 cp equal chunks; Ulysses gives each rank heads / (tp cp) query heads and
    needs a tp rank's key/value heads to split over cp too, or to be fewer and divide cp
    (each is then replicated to fit)."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    ring, ulysses = context_degrees(p.cp, p.cp_mode, p.cp_ulysses)
    key = "parallel.cp_ulysses" if p.cp_mode == "hybrid" else "parallel.cp"
    if ring > 1 and m.seq_len % (2 * p.cp):
        raise ConfigError("model.seq_len", f"ring attention's balanced (zigzag) split cuts "
                                           f"each sequence into 2 x ring = {2 * ring} equal "
                                           f"chunks, each over {ulysses} Ulysses rank(s), "
                                           f"but seq_len is {m.seq_len}; use a multiple of "
                                           f"{2 * p.cp}")
    if ulysses > 1:
        if m.seq_len % p.cp:
            raise ConfigError("model.seq_len", f"context parallelism splits each sequence into "
                                               f"cp = {p.cp} shards, but seq_len is "
                                               f"{m.seq_len}; use a multiple of {p.cp}")
        heads, kv_heads = m.heads // p.tp, m.n_kv_heads // p.tp  # a tp rank's
        if heads % ulysses:
            raise ConfigError(key, f"Ulysses gives each of its {ulysses} ranks heads / "
                                   f"{ulysses} query heads, but a tp rank holds {heads} "
                                   f"(model.heads {m.heads} / tp {p.tp}); choose a Ulysses "
                                   f"degree among {_divisors(heads)}")
        if kv_heads % ulysses and ulysses % kv_heads:
            raise ConfigError(key, f"Ulysses splits a tp rank's {kv_heads} key/value heads "
                                   f"over {ulysses} ranks, or replicates them when they are "
                                   "fewer and divide the degree; neither holds: choose a "
                                   "Ulysses degree dividing or divided by model.kv_heads / "
                                   "parallel.tp")


def context_degrees(cp: int, mode: str, cp_ulysses: int | None) -> tuple[int, int]:
    """(ring degree, Ulysses degree) of `cp` context-parallel ranks in `mode`; ConfigError for
    a hybrid whose Ulysses degree (`parallel.cp_ulysses`) is missing or does not divide cp."""
    if mode == "ring":
        return cp, 1
    if mode == "ulysses":
        return 1, cp
    if cp_ulysses is None or cp % cp_ulysses:
        raise ConfigError("parallel.cp_ulysses", f"the hybrid mode runs a Ulysses degree times a "
                                                 f"ring degree on cp = {cp} ranks: set "
                                                 f"cp_ulysses to one of {_divisors(cp)}, got "
                                                 f"{cp_ulysses}")
    return cp // cp_ulysses, cp_ulysses


def validate_fp8_runtime(cfg: Config, fp8_units: bool) -> None:
    """What fp8 training (fivefold.parallel.fp8) needs of the device: fp8 GEMM units unless
    emulated. What it needs of the other features (an optimizer that keeps fp32 master
    weights, activation scales over the one-process run's tokens; docs/fp8.md, "Layouts")
    are rows of fivefold.compositions.REFUSALS."""
    p = cfg.parallel
    if p.fp8_emulate is False and not fp8_units:
        raise ConfigError("parallel.fp8_emulate", "this device has no fp8 matrix units (they "
                                                  "need a GPU of compute capability 8.9 or "
                                                  "later: Ada, Hopper, Blackwell); set "
                                                  "parallel.fp8_emulate = true (or leave it "
                                                  "unset) to emulate fp8 in fp32")


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


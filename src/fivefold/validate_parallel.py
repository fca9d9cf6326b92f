"""The value and cross-field checks of the `[parallel]` section (fivefold.parallel_config):
degrees, ZeRO and its ZeRO++ groups, schedules and their virtual stages, micro-batches,
offload and precision, for any use of a config (plan, simulate, train). fivefold.validate
runs them with the other sections' checks; each failure raises `ConfigError` naming the
key and the fix. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from fivefold.batch_shares import check_batch_split, replica_rows
from fivefold.compositions import ANY_USE, check_compositions
from fivefold.config import Config, ConfigError
from fivefold.expert_grid import validate_expert_grid
from fivefold.models.validate_model import (choice as _choice, divisors as _divisors,
                                            positive as _positive)

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
    validate_activation_offload(cfg)
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
        shard = (p.zero_group or dp) * p.cp  # ZeRO shards over dp x cp
        per_node = ranks_per_node(cfg.cluster.gpus_per_node, p.tp, shard)
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


def validate_activation_offload(cfg: Config) -> None:
    """`parallel.offload_activations` (fivefold.memory.activation_offload): a count of blocks
    from 0 to model.layers, per pipeline stage or, under vpp, per model chunk (one with fewer
    blocks offloads all of them, as `fivefold plan` needs when it holds a spec's count across
    the splits it searches). What it does not compose with (recomputation, TeraPipe) is in
    fivefold.compositions."""
    n = cfg.parallel.offload_activations
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cfg.model.layers:
        raise ConfigError("parallel.offload_activations", f"{n!r} is not a block count: use an "
                          f"integer from 0 (off) to model.layers = {cfg.model.layers}")


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
    for per_rank in sorted(set(replica_rows(p.global_batch, dp, p.dp_batch_shares))):
        micro = per_rank // (p.micro_batch or per_rank)  # each replica's own schedule
        if p.schedule == "interleaved" and micro > p.pp and micro % p.pp:
            raise ConfigError("parallel.micro_batch", f"the interleaved schedule sends "
                              f"micro-batches round the {p.pp} stages in groups of pp: {micro}"
                              f" per step ({per_rank} sequences per dp rank / micro_batch "
                              f"{p.micro_batch}) must be a multiple of {p.pp}, or at most {p.pp}")
        if p.schedule == "pipedream-2bw" and micro < p.pp:
            raise ConfigError("parallel.micro_batch", f"PipeDream-2BW needs at least pp = "
                              f"{p.pp} micro-batches per step, got {micro} ({per_rank} "
                              f"sequences per dp rank / micro_batch {p.micro_batch or per_rank}"
                              "); lower parallel.micro_batch")


def ranks_per_node(gpus_per_node: int, stride: int, shard: int) -> int:
    """Ranks of one shard group on a node, its members `stride` ranks apart (the tp ranks
    between two data-parallel ranks fill a node first; an edp group's, ep x etp): ZeRO++'s
    hpZ and qgZ groups."""
    return max(1, min(shard, gpus_per_node // stride))

"""The composition table: the pairs of features `fivefold train` refuses, and why.

A feature is a named predicate over a config and its data-parallel degree ("tp>1",
"zero=3", "schedule=terapipe", "optimizer=lomo", ...; `FEATURES`, grouped by kind). A
`Refusal` is a pair of features that the runtime does not run together, with the config key
its error names and the message that says what to use instead; `when` narrows it to
configs that also have further features. `validate_for_training`
(fivefold.validate) raises `ConfigError(key, message)` for the first row of `REFUSALS` that
a config matches, after the checks of single values and of divisibility, which stay there
(and `validate`, for every command, for the first row of `ANY_USE`);
docs/reliability.md's composition matrix is generated from the same two tables
(scripts/composition_docs.py), each pair marked refused (with its message) or supported
(with the test that trains it, scripts/composition_tested.py's `TESTED`).

To refuse a new pair, add a row to `REFUSALS`; to name a new feature, add it to `FEATURES`;
then rerun `scripts/composition_docs.py --write`. Nothing here touches torch (the planner
imports it through fivefold.validate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from fivefold.config import Config, ConfigError

Predicate = Callable[[Config, int], bool]  # (config, data-parallel degree) -> has it


@dataclass(frozen=True)
class Feature:
    name: str
    kind: str  # the matrix's grouping: dimension, ZeRO, schedule, recompute, optimizer, ...
    has: Predicate
    one_of: str | None = None  # the key whose values these features are (they exclude each other)


def _schedule(name: str) -> Predicate:
    """A pipeline schedule is a feature only with pp > 1 (it is ignored otherwise)."""
    return lambda c, dp: c.parallel.pp > 1 and c.parallel.schedule == name


def _accumulates(c: Config, dp: int) -> bool:
    p = c.parallel
    return p.micro_batch is not None and p.micro_batch < p.global_batch // dp


FEATURES: dict[str, Feature] = {f.name: f for f in [
    Feature("dp>1", "dimension", lambda c, dp: dp > 1),
    Feature("tp>1", "dimension", lambda c, dp: c.parallel.tp > 1),
    Feature("sequence_parallel", "dimension", lambda c, dp: c.parallel.sequence_parallel),
    Feature("pp>1", "dimension", lambda c, dp: c.parallel.pp > 1),
    Feature("vpp>1", "dimension", lambda c, dp: c.parallel.vpp > 1),
    Feature("cp>1", "dimension", lambda c, dp: c.parallel.cp > 1),
    Feature("accumulation", "dimension", _accumulates),
    Feature("dp_batch_shares", "dimension", lambda c, dp: c.parallel.dp_batch_shares is not None),
    *(Feature(f"zero={z}", "ZeRO", (lambda z: lambda c, dp: c.parallel.zero_stage == z)(z),
              "parallel.zero_stage") for z in range(4)),
    Feature("zero_group", "ZeRO", lambda c, dp: c.parallel.zero_group is not None),
    Feature("qwz", "ZeRO", lambda c, dp: c.parallel.qwz),
    Feature("hpz", "ZeRO", lambda c, dp: c.parallel.hpz),
    Feature("qgz", "ZeRO", lambda c, dp: c.parallel.qgz),
    *(Feature(f"schedule={s}", "schedule", _schedule(s), "parallel.schedule")
      for s in ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "pipedream-2bw",
                "terapipe")),
    *(Feature(f"recompute={r}", "recompute",
              (lambda r: lambda c, dp: c.parallel.recompute == r)(r), "parallel.recompute")
      for r in ("full", "selective")),
    *(Feature(f"optimizer={o}", "optimizer",
              (lambda o: lambda c, dp: c.train.optimizer == o)(o), "train.optimizer")
      for o in ("adamw", "muon", "sgd", "lomo", "galore")),
    Feature("galore_reduce=projected", "optimizer",
            lambda c, dp: c.train.optimizer == "galore" and c.train.galore_reduce == "projected"),
    # an unset precision is the device's default: fp32 on the CPU, where the tests run
    Feature("fp32", "precision", lambda c, dp: (c.parallel.precision or "fp32") == "fp32",
            "parallel.precision"),
    Feature("bf16", "precision", lambda c, dp: c.parallel.precision == "bf16",
            "parallel.precision"),
    Feature("fp16", "precision", lambda c, dp: c.parallel.precision == "fp16",
            "parallel.precision"),
    Feature("fp8", "precision", lambda c, dp: c.parallel.precision == "fp8",
            "parallel.precision"),
    *(Feature(f"offload={o}", "memory",
              (lambda o: lambda c, dp: c.parallel.offload == o)(o), "parallel.offload")
      for o in ("cpu", "nvme")),
    Feature("offload_activations", "memory", lambda c, dp: c.parallel.offload_activations > 0),
    Feature("on_nonfinite=skip", "guard", lambda c, dp: c.train.on_nonfinite == "skip"),
    Feature("grad_clip=0", "guard", lambda c, dp: not c.train.grad_clip),
    Feature("moe", "model", lambda c, dp: c.model.moe is not None),
    Feature("ep>1", "model", lambda c, dp: c.parallel.ep > 1),
    Feature("etp>1", "model", lambda c, dp: c.parallel.etp > 1),
]}

SPLITS = ("dp>1", "tp>1", "pp>1", "cp>1")  # more than one rank
SHARDED = ("zero=1", "zero=2", "zero=3")


@dataclass(frozen=True)
class Refusal:
    """`a` with any of `b` is refused, naming `key`, where every feature of `when` holds.
    `{section.key}` in the message stands for that config value."""
    a: str
    b: tuple[str, ...]
    key: str
    message: str
    when: tuple[str, ...] = ()


# what no command accepts (fivefold.validate.validate: plan and simulate too)
ANY_USE: list[Refusal] = [
    *(Refusal(f"offload={o}", ("optimizer=lomo",), "parallel.offload",
              "LOMO keeps no optimizer state and no master weights (its update is fused into "
              "backward), so there is nothing to offload: set parallel.offload = 'none', or "
              "use train.optimizer = 'adamw' with offload") for o in ("cpu", "nvme")),
    Refusal("qwz", ("zero=0", "zero=1", "zero=2"), "parallel.qwz",
            "ZeRO++ weight communication applies to sharded parameters; set "
            "parallel.zero_stage = 3"),
    Refusal("hpz", ("zero=0", "zero=1", "zero=2"), "parallel.hpz",
            "ZeRO++ weight communication applies to sharded parameters; set "
            "parallel.zero_stage = 3"),
    Refusal("offload_activations", ("recompute=full", "recompute=selective"),
            "parallel.offload_activations",
            "not with parallel.recompute = '{parallel.recompute}': recomputation already keeps "
            "only each block's input (Megatron-Core refuses the pair too); set recompute = "
            "'none' or offload_activations = 0"),
    Refusal("qgz", ("zero=0",), "parallel.qgz",
            "quantized gradient reduce-scatter needs sharded gradients; set "
            "parallel.zero_stage to 1, 2 or 3"),
]

# what `fivefold train` does not run (fivefold.validate.validate_for_training)
REFUSALS: list[Refusal] = [
    *(Refusal(f"offload={o}", ("optimizer=muon", "optimizer=galore",
                               "schedule=pipedream-2bw"), "parallel.offload",
              "the offloaded optimizer step is AdamW's or SGD's on the data-parallel engine's "
              "flat master weights; use train.optimizer = 'adamw' or 'sgd' (and a synchronous "
              "schedule) with "
              "parallel.offload = '{parallel.offload}'") for o in ("cpu", "nvme")),
    Refusal("fp8", ("optimizer=lomo",), "train.optimizer",
            "LOMO updates the compute-dtype weights inside backward and keeps no fp32 master "
            "weights, which fp8 training rounds from; use 'adamw', 'muon', 'sgd' or 'galore' "
            "with precision 'fp8'"),
    Refusal("fp8", ("schedule=terapipe",), "parallel.schedule",
            "TeraPipe's token slices would give each slice its own activation scales; use "
            "another schedule with precision 'fp8'"),
    Refusal("fp8", ("schedule=zb", "schedule=zbv", "schedule=dualpipev"), "parallel.schedule",
            "the zero-bubble weight pass would re-run the fp8 linear's whole backward (and its "
            "tp scale exchange); use another schedule with precision 'fp8'"),
    Refusal("schedule=terapipe", ("zero=3",), "parallel.schedule",
            "TeraPipe's token slices reach back into earlier slices' keys and values, so a "
            "block's backward is not one pass that ZeRO-3 can gather and free around; use "
            "'gpipe', '1f1b', 'interleaved' or 'zb', or zero_stage 0, 1 or 2"),
    Refusal("schedule=pipedream-2bw", ("fp16",), "parallel.precision",
            "PipeDream-2BW steps each stage's optimizer inside its schedule, outside the "
            "loss-scaled update (fivefold.train.updaters); use 'bf16' (GPU) or 'fp32' with "
            "it, or a synchronous schedule with fp16"),
    Refusal("schedule=terapipe", ("tp>1",), "parallel.schedule",
            "TeraPipe's sliced attention runs outside the tensor-parallel regions; use "
            "parallel.tp = 1 or another schedule"),
    Refusal("schedule=pipedream-2bw", ("tp>1", *SHARDED), "parallel.schedule",
            "PipeDream-2BW keeps its own weight versions and optimizer: use it with "
            "parallel.tp = 1 and parallel.zero_stage = 0"),
    Refusal("cp>1", ("schedule=terapipe", "schedule=pipedream-2bw"), "parallel.schedule",
            "{parallel.schedule} with context parallelism is not built (TeraPipe's token "
            "slices are not combined with cp's token shards; 2BW's own update is not tested "
            "with cp); use 1f1b, gpipe, interleaved or zb with parallel.cp > 1"),
    Refusal("offload_activations", ("schedule=terapipe",), "parallel.offload_activations",
            "TeraPipe runs each token slice through a block's attention and MLP directly "
            "(fivefold.parallel.pipeline.terapipe), not through the block's forward that the "
            "offload wraps, so nothing would leave the device; use 'gpipe', '1f1b', "
            "'interleaved', 'zb', 'zbv', 'dualpipev' or 'pipedream-2bw', or "
            "offload_activations = 0"),
    Refusal("zero_group", ("zero=0",), "parallel.zero_group",
            "hierarchical sharding shards ZeRO state; set parallel.zero_stage to 1, 2 or 3, "
            "or drop zero_group"),
    *(Refusal(f"recompute={r}", ("schedule=terapipe", "schedule=pipedream-2bw"),
              "parallel.schedule",
              "parallel.recompute = '{parallel.recompute}' is not supported with "
              "{parallel.schedule}: it keeps per-pass state (key/value caches or weight "
              "versions) that recomputation would bypass; use recompute = 'none' with it, or "
              "1f1b") for r in ("full", "selective")),
    Refusal("optimizer=galore", ("cp>1", "ep>1", "etp>1", "zero_group", "qwz", "hpz", "qgz"),
            "train.optimizer",
            "GaLore runs with data, tensor and pipeline parallelism and ZeRO 0-3 "
            "(fivefold.memory.galore_dp, fivefold.memory.galore_units); context and expert "
            "splits, hierarchical sharding and ZeRO++ are not built for it: drop them, or use "
            "'adamw' here"),
    Refusal("galore_reduce=projected", ("tp>1", "pp>1", "zero=3"), "train.galore_reduce",
            "'projected' is the reduction of GaLore with data parallelism alone (ZeRO 0-2, "
            "fivefold.memory.galore_dp); with tp, pp or ZeRO-3 use 'full'"),
    Refusal("on_nonfinite=skip", ("schedule=pipedream-2bw",), "train.on_nonfinite",
            "PipeDream-2BW updates each stage inside its schedule, before any global norm is "
            "known, so a step cannot be skipped: use 'stop', or a synchronous schedule"),
    Refusal("on_nonfinite=skip", ("optimizer=lomo",), "train.on_nonfinite",
            "LOMO without clipping applies each gradient inside its only backward, before "
            "the norm is known: set train.grad_clip > 0 (two passes, the first measures) or "
            "use 'stop'", when=("grad_clip=0",)),
    Refusal("optimizer=lomo", ("tp>1", "pp>1", "cp>1", "ep>1", "etp>1", "zero=3", "zero_group",
                               "qgz"),
            "train.optimizer",
            "LOMO updates each parameter inside backward, right after its gradient's "
            "all-reduce (ZeRO-1/2: reduce-scatter) over the data-parallel ranks: it runs with "
            "data parallelism only, at parallel.zero_stage 0, 1 or 2, without zero_group or "
            "qgz"),
    Refusal("optimizer=lomo", ("accumulation",), "parallel.micro_batch",
            "LOMO applies the update during backward, so it cannot accumulate micro-batches: "
            "leave micro_batch unset or set it to {parallel.global_batch}"),
    Refusal("optimizer=lomo", ("fp16",), "train.grad_clip",
            "LOMO with fp16 loss scaling detects an overflow in the first of its two passes "
            "(the one that measures the gradient norm for clipping); without clipping each "
            "gradient is applied before an overflow could be known: set train.grad_clip > 0, "
            "or use bf16 or fp32", when=("grad_clip=0",)),
]


def features_of(cfg: Config, dp: int) -> set[str]:
    """The names of every feature `cfg` has, with `dp` data-parallel ranks."""
    return {name for name, f in FEATURES.items() if f.has(cfg, dp)}


def refusal_for(have: set[str], table: list[Refusal]) -> Refusal | None:
    """The first row of `table` that a config with features `have` matches."""
    for r in table:
        if r.a in have and have.intersection(r.b) and set(r.when) <= have:
            return r
    return None


def check_compositions(cfg: Config, dp: int, table: list[Refusal]) -> None:
    """ConfigError for the first pair of features of `table` that `cfg` (with `dp`
    data-parallel ranks) has."""
    refused = refusal_for(features_of(cfg, dp), table)
    if refused is not None:
        raise ConfigError(refused.key, filled(refused.message, cfg))


def filled(message: str, cfg: Config) -> str:
    """`message` with each `{section.key}` replaced by that value of `cfg`."""
    return re.sub(r"\{(\w+)\.(\w+)\}",
                  lambda m: str(getattr(getattr(cfg, m[1]), m[2])), message)

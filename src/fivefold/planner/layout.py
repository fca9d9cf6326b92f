"""One parallel layout as the planner scores it: every degree and switch resolved to a value.

`Layout` is the planner's view of `ParallelConfig` plus the cluster: dp filled in from the
device count, micro-batch and precision defaults applied, the ZeRO shard group resolved, and
the derived counts every model needs (micro-batches per step, sequences per rank). It keeps
the `ParallelConfig` it came from, so the `parallel` table of the output lists every field the
runtime reads, including ones this module does not model.

Rank order follows the runtime mesh (fivefold.parallel.mesh): pp outermost, then
dp_replicate, dp_shard, cp, tp innermost, so tp ranks are neighbours on a node, then cp, then
the data-parallel ranks. Expert parallelism reuses the dp x cp ranks (run_spec.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import Config, ConfigError, ModelConfig, ParallelConfig

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8 keeps bf16 activations


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    zero_group: int
    zero_stage: int
    vpp: int
    schedule: str
    micro_batch: int
    global_batch: int
    recompute: str
    sequence_parallel: bool
    precision: str
    cp_mode: str
    reduce_dtype: str
    optimizer: str
    source: ParallelConfig

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def per_rank_batch(self) -> int:
        """Sequences per data-parallel rank per optimizer step."""
        return self.global_batch // self.dp

    @property
    def micro_batches(self) -> int:
        return self.per_rank_batch // self.micro_batch

    @property
    def act_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def param_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return PRECISION_BYTES[self.reduce_dtype]

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.zero_group

    def parallel_table(self) -> dict:
        """The `parallel` table of the output: every ParallelConfig field, resolved."""
        resolved = dataclasses.replace(
            self.source, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp=self.dp,
            zero_group=self.zero_group, zero_stage=self.zero_stage, vpp=self.vpp,
            schedule=self.schedule, micro_batch=self.micro_batch,
            global_batch=self.global_batch, recompute=self.recompute,
            sequence_parallel=self.sequence_parallel, precision=self.precision,
            cp_mode=self.cp_mode, reduce_dtype=self.reduce_dtype)
        return dataclasses.asdict(resolved)

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)


def cluster_gpus(cfg: Config) -> int:
    """cluster.gpus, which plan and simulate need; ConfigError when it is missing."""
    if cfg.cluster.gpus is None:
        raise ConfigError("cluster.gpus", "plan and simulate need the number of devices; set "
                                          "cluster.gpus, e.g. --set cluster.gpus=64")
    return cfg.cluster.gpus


def layout_from_config(cfg: Config, precision_default: str = "bf16",
                       gpus: int | None = None) -> Layout:
    """The layout a validated config describes on `gpus` (default cluster.gpus) devices."""
    p, gpus = cfg.parallel, gpus or cluster_gpus(cfg)
    dp = p.dp or gpus // (p.tp * p.pp * p.cp)
    precision = p.precision or precision_default
    reduce_dtype = p.reduce_dtype or ("bf16" if precision == "fp8" else precision)
    return Layout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=dp, zero_group=p.zero_group or dp,
                  zero_stage=p.zero_stage, vpp=p.vpp, schedule=p.schedule,
                  micro_batch=p.micro_batch or p.global_batch // dp,
                  global_batch=p.global_batch, recompute=p.recompute,
                  sequence_parallel=p.sequence_parallel, precision=precision,
                  cp_mode=p.cp_mode, reduce_dtype=reduce_dtype,
                  optimizer=cfg.train.optimizer, source=p)


def check_model_fits_layout(model: ModelConfig, lay: Layout) -> None:
    """Divisibility the planner's formulas assume; ConfigError naming the key otherwise."""
    if model.heads % lay.tp or model.n_kv_heads % lay.tp and lay.tp % model.n_kv_heads:
        raise ConfigError("parallel.tp", f"tp = {lay.tp} must divide model.heads = "
                                         f"{model.heads} (and kv_heads {model.n_kv_heads}, or be"
                                         " a multiple of it)")
    if lay.pp * lay.vpp > model.layers:
        raise ConfigError("parallel.pp", f"pp*vpp = {lay.pp * lay.vpp} stages exceed the "
                                         f"{model.layers} layers")
    if model.seq_len % lay.cp:
        raise ConfigError("parallel.cp", f"cp = {lay.cp} does not divide model.seq_len = "
                                         f"{model.seq_len}")
    if model.moe is not None and (lay.dp * lay.cp) % lay.ep:
        raise ConfigError("parallel.ep", f"ep = {lay.ep} does not divide the dp*cp = "
                                         f"{lay.dp * lay.cp} ranks that hold the experts")
    if model.moe is not None and model.moe.experts % lay.ep:
        raise ConfigError("parallel.ep", f"ep = {lay.ep} does not divide model.moe.experts = "
                                         f"{model.moe.experts}")
    if model.moe is None and lay.ep != 1:
        raise ConfigError("parallel.ep", "expert parallelism needs a mixture-of-experts model "
                                         "(model.moe); set parallel.ep = 1")

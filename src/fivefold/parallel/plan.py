"""The parallel plan of a run: every degree, switch and derived count, resolved once.

A `ParallelPlan` is worked out from a config and a number of ranks before any rank starts,
and is then what everything else reads: the mesh (`mesh_shape`), `parallelize` and the
trainer (which update path, which axes the gradient norm spans), the checkpoint metadata
(fivefold.train.checkpoint keys a checkpoint by it), the planner's `simulate` /
`predict_ledger` / search (each candidate of the search is a plan) and `parallel = "auto"`,
whose winning plan is handed to the ranks as JSON instead of `--set` strings. It is frozen
and torch-free: the planner scores millions of them, and a test compares the plan a run
trained with against the one the planner scored.

Rank order (the mesh's axes, outermost first): pp, dp_replicate, dp_shard, cp, tp; tp ranks
are neighbours on a node, then cp, then the data-parallel ranks. The data-parallel degree
splits into `dp_shard = zero_group` (ZeRO / FSDP sharding, MiCS's partition group) and
`dp_replicate = dp / zero_group`. The routed experts have a grid of their own over a stage's
dp x cp x tp ranks (Megatron-Core's parallel folding, fivefold.expert_grid): `etp` ranks
split each expert's MLP, `ep` groups of those hold different experts, and each expert shard
is data-parallel over the other dp * cp * tp / (ep * etp).

`training_plan` validates first (fivefold.validate.validate_for_training: the messages users
see), so a plan that reaches the runtime is one it executes; `plan_from_config` is the
planner's (a spec may describe layouts the runtime does not run yet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

from fivefold.batch_shares import replica_rows
from fivefold.config import Config, ParallelConfig
from fivefold.expert_grid import expert_data_degree
from fivefold.parallel.pipeline.actions import SPLIT_SCHEDULES
from fivefold.parallel.pipeline.partition import stage_ids_of_rank
from fivefold.parallel.pipeline.schedules import V_SCHEDULES, Schedule, build_schedule
from fivefold.validate import validate_for_training
from fivefold.validate_parallel import ranks_per_node
from fivefold.validate_runtime import context_degrees

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8 keeps bf16 activations
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelPlan:
    """One resolved layout. Fields mirror `ParallelConfig` (see docs/config.md for each),
    with every default filled in; `optimizer` and `gpus_per_node` come from the train and
    cluster sections because the update path and ZeRO++'s node groups depend on them."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int  # expert tensor parallelism (fivefold.expert_grid)
    dp: int
    zero_group: int  # dp ranks that shard one copy of the model state (dp_shard)
    zero_stage: int
    vpp: int
    schedule: str
    stage_layers: tuple[int, ...] | None  # blocks per virtual stage; None: balanced by cost
    token_slices: int | None  # TeraPipe's slices per sequence; None: pp
    weight_prediction: bool
    micro_batch: int
    global_batch: int
    recompute: str
    sequence_parallel: bool
    precision: str
    fp8_emulate: bool | None  # None: emulate where the device has no fp8 units
    fp8_recipe: str
    fp8_tensors: tuple[str, ...]
    cp_mode: str
    cp_ulysses: int | None  # hybrid: the Ulysses degree (context_degrees)
    reduce_dtype: str
    qwz: bool
    hpz: bool
    qgz: bool
    optimizer: str
    gpus_per_node: int
    offload: str  # "none" | "cpu" | "nvme" (fivefold.memory.offload)
    offload_path: str | None
    offload_fraction: float
    offload_kernel: str  # the host's AdamW: "foreach" (exact) | "fused"
    dp_batch_shares: tuple[int, ...] | None = None  # None: the batch splits evenly over dp
    offload_activations: int = 0  # first blocks of each chunk whose saves live on the host

    # ------------------------------------------------------------ ranks and batches

    @property
    def gpus(self) -> int:
        """Ranks (devices) of the layout."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.zero_group

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes of the rank mesh (fivefold.parallel.mesh), outermost first."""
        return dict(zip(MESH_AXES, (self.pp, self.dp_replicate, self.zero_group, self.cp,
                                    self.tp)))

    def pp_rank_of(self, rank: int) -> int:
        """The pipeline stage of global rank `rank` (pp is the outermost axis)."""
        return rank // (self.gpus // self.pp)

    @property
    def expert_data_parallel(self) -> int:
        """Copies of each expert shard: the dp x cp x tp ranks of a stage that ep and etp do
        not split (fivefold.expert_grid)."""
        return expert_data_degree(self.dp, self.cp, self.tp, self.ep, self.etp)

    @property
    def expert_grid(self) -> bool:
        """Whether an MoE model's experts get their own etp x ep x edp grid (every layout
        that splits a stage's MoE work: ep, etp, or tp, which the experts fold into); else
        they are data-parallel with everything else."""
        return self.ep > 1 or self.etp > 1 or self.tp > 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks of one data-parallel shard group on a node (validate.ranks_per_node); the
        group spans dp_shard x cp, tp ranks apart."""
        return ranks_per_node(self.gpus_per_node, self.tp, self.zero_group * self.cp)

    @property
    def expert_ranks_per_node(self) -> int:
        """Ranks of one expert-data-parallel group on a node: its members are strided by
        ep x etp (the experts' grid's inner axes, fivefold.expert_grid), ZeRO++'s node groups
        of the expert units; 1 (each rank its own node) where nodes hold unequal parts of the
        group. Of the group ZeRO shards the experts over (`expert_shard_axis`)."""
        edp = self.expert_shard_axis[1]
        per_node = ranks_per_node(self.gpus_per_node, self.ep * self.etp, edp)
        return per_node if edp % per_node == 0 else 1

    @property
    def expert_shard_axis(self) -> tuple[str, int]:
        """(ledger name, size) of the axis ZeRO (stages 1-3) shards a routed-expert unit
        over: its edp ranks, or under hierarchical sharding (dp_replicate > 1) the part of
        them inside one zero group ("edp_shard"), replicated over "edp_replicate"
        (fivefold.parallel.mesh.Mesh.expert_zero_axes; MiCS, arXiv 2205.00119, Sec. 3)."""
        if self.dp_replicate > 1:
            return "edp_shard", self.expert_data_parallel // self.dp_replicate
        return "edp", self.expert_data_parallel

    @property
    def per_rank_batch(self) -> int:
        """Sequences per data-parallel rank per step (even split; dp_batch_shares: the
        replicas' own are fivefold.batch_shares.replica_rows)."""
        return self.global_batch // self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel rank per step (accumulated or pipelined)."""
        return self.per_rank_batch // self.micro_batch

    # ------------------------------------------------------------ bytes

    @property
    def act_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def param_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return PRECISION_BYTES[self.reduce_dtype]

    # ------------------------------------------------------------ how a step runs

    @property
    def asynchronous(self) -> bool:
        """PipeDream-2BW: each stage updates itself, one step of weight staleness."""
        return self.pp > 1 and self.schedule == "pipedream-2bw"

    @property
    def update(self) -> str:
        """Who owns parameters, gradients and the optimizer step:
        "engine"         fivefold.parallel.data_parallel (DDP / ZeRO, flat units), every
                         layout with more than one rank, a ZeRO stage or offload, pipelines
                         included
        "galore-dp"      GaLore over data-parallel ranks and ZeRO-1/2
                         (fivefold.memory.galore_dp)
        "pipedream-2bw"  each pipeline stage's own weight versions and optimizer
        "lomo"           SGD fused into backward (fivefold.memory.lomo), its gradients
                         all-reduced over the data-parallel ranks in backward (ZeRO-1/2:
                         reduce-scattered, and the updated slices all-gathered)
        "plain"          torch's optimizer on the plain model, one rank: the reference"""
        if self.asynchronous:
            return "pipedream-2bw"
        # what these two run on (offload with either is refused: fivefold.compositions)
        data_only = (self.tp == self.pp == self.cp == self.ep == self.etp == 1
                     and self.offload == "none")
        if self.optimizer == "lomo" and data_only and self.zero_stage <= 2:
            return "lomo"
        if self.optimizer == "galore" and data_only and self.zero_stage <= 2 and (
                self.gpus > 1 or self.zero_stage > 0):
            return "galore-dp"
        if self.gpus > 1 or self.zero_stage > 0 or self.offload != "none":
            return "engine"
        return "plain"

    def offloaded_units(self, shard_numels: list[int]) -> int:
        """How many of the engine's units (in engine order, fivefold.parallel.data_parallel)
        offload moves off the device, given this rank's shard elements of each: the shortest
        prefix whose elements reach `offload_fraction` of them all (Megatron's offload
        fraction); 0 without offload. The runtime and the planner both count by this rule."""
        return 0 if self.offload == "none" else offloaded_unit_count(shard_numels,
                                                                     self.offload_fraction)

    @property
    def context_degrees(self) -> tuple[int, int]:
        """(ring degree, Ulysses degree) of the cp ranks: cp x 1 for ring, 1 x cp for
        Ulysses, cp / cp_ulysses x cp_ulysses for the hybrid (Ulysses innermost)."""
        return context_degrees(self.cp, self.cp_mode, self.cp_ulysses)

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The mesh axes ZeRO shards the model state over: the dp_shard group and, with
        context parallelism, the cp ranks, which hold the same parameters and compute on
        other tokens of the same sequences (ZeRO over dp x cp, as the planner assumes)."""
        return ("dp_shard", "cp") if self.cp > 1 else ("dp_shard",)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes whose ranks compute on different tokens: gradients and the loss are
        summed over them (dp_replicate, dp_shard and, with context parallelism, cp)."""
        return ("dp_replicate", *self.shard_axes)

    @property
    def token_split_axes(self) -> tuple[str, ...]:
        """The mesh axes that split one micro-batch's tokens for an MoE layer: cp and tp (an
        MoE layer runs on its rank's share, fivefold.parallel.moe_tokens; without sequence
        parallelism the layer takes the rank's 1/tp of its tp group's tokens)."""
        return ("cp",) * (self.cp > 1) + ("tp",) * (self.tp > 1)

    @property
    def routing_axes(self) -> tuple[str, ...]:
        """The mesh axes whose ranks route different tokens through an MoE layer: the token
        axes and tp (fivefold.train.moe_stats sums over them)."""
        if self.tp > 1:
            return ("dp_replicate", "dp_shard", "cp", "tp")
        return self.token_axes

    @property
    def grad_norm_axes(self) -> tuple[tuple[str, ...], ...]:
        """Mesh axes (each a group of adjacent axes, joined) over which ranks hold different
        parts of the gradient, so the squared norm is summed over them before clipping: the
        ZeRO shard group (stages 1-3), the tensor-parallel shards and the pipeline stages.
        Copies that are equal (dp_replicate, and without ZeRO every data-parallel rank after
        the all-reduce) are not summed."""
        axes = []
        if self.update in ("engine", "galore-dp") and self.zero_stage >= 1:
            axes.append(self.shard_axes)
        for axis in ("tp", "pp"):
            if getattr(self, axis) > 1:
                axes.append((axis,))
        return tuple(axes)

    @property
    def slices(self) -> int:
        """Pieces each sequence is cut into along time: TeraPipe's token slices, else 1."""
        return (self.token_slices or self.pp) if self.schedule == "terapipe" else 1

    def stage_ids_of_rank(self, pp_rank: int) -> list[int]:
        """The virtual stages pp rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (its
        chunks, round-robin as the interleaved schedule needs; in a V for "zbv", "dualpipev")."""
        return stage_ids_of_rank(self.pp, self.vpp, pp_rank, self.v_shape)

    def ends_of_rank(self, pp_rank: int) -> tuple[bool, bool]:
        """(holds the first stage, holds the last stage) of pp rank `pp_rank`."""
        ids = self.stage_ids_of_rank(pp_rank)
        return 0 in ids, self.pp * self.vpp - 1 in ids

    @property
    def v_shape(self) -> bool:
        """Whether the schedule places its two chunks per rank in a V (the last stage on
        pp rank 0, next to the first)."""
        return self.schedule in V_SCHEDULES

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backward into I and W (zero-bubble; pp > 1 only)."""
        return self.pp > 1 and self.schedule in SPLIT_SCHEDULES

    def pipeline_schedules(self, tied_embeddings: bool) -> tuple[Schedule, Schedule]:
        """(training, evaluation) action lists of a synchronous schedule, as the executor
        runs them and the ledger model replays them. PipeDream-2BW's lists span the whole run
        and are built by its engine (fivefold.parallel.pipeline.pipedream_2bw)."""
        args = (self.schedule, self.pp, self.micro_batches, self.vpp, self.slices,
                tied_embeddings)
        return build_schedule(*args), build_schedule(*args, forward_only=True)

    # ------------------------------------------------------------ to and from configs

    def parallel_config(self) -> ParallelConfig:
        """This plan written as a config's `parallel` section, every value resolved."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelConfig)
                  if f.name != "auto"}
        fields["stage_layers"] = list(self.stage_layers) if self.stage_layers else None
        fields["fp8_tensors"] = list(self.fp8_tensors)
        return ParallelConfig(**fields)

    def parallel_table(self) -> dict:
        """The `parallel` table of simulate's output: every ParallelConfig field, resolved."""
        return dataclasses.asdict(self.parallel_config())

    def apply_to(self, cfg: Config) -> Config:
        """`cfg` with this plan's layout written in: the config a rank trains with."""
        return dataclasses.replace(cfg, parallel=self.parallel_config())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelPlan":
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"a parallel plan has the fields {sorted(names)}; got "
                             f"{sorted(data)}")
        stages, shares = data["stage_layers"], data["dp_batch_shares"]
        return cls(**{**data, "stage_layers": tuple(stages) if stages else None,
                      "fp8_tensors": tuple(data["fp8_tensors"]),
                      "dp_batch_shares": tuple(shares) if shares else None})

    def replace(self, **changes) -> "ParallelPlan":
        """This plan with `changes`, the fields copied without the frozen __init__'s setattr
        per field: the search makes one per candidate (about 80,000 on 1024 GPUs)."""
        if changes.keys() - _FIELDS:
            raise TypeError(f"ParallelPlan has no fields {sorted(changes.keys() - _FIELDS)}")
        new = object.__new__(ParallelPlan)
        new.__dict__.update(self.__dict__, **changes)
        return new


_FIELDS = frozenset(f.name for f in dataclasses.fields(ParallelPlan))


def offloaded_unit_count(shard_numels: list[int], fraction: float) -> int:
    """The shortest prefix of units whose shard elements reach `fraction` of them all
    (`ParallelPlan.offloaded_units`; the engine applies it to its units)."""
    need = fraction * sum(shard_numels)
    return next((count for count, total in enumerate(accumulate(shard_numels), 1)
                 if total >= need), len(shard_numels))


def plan_from_config(cfg: Config, world_size: int, default_precision: str = "bf16"
                     ) -> ParallelPlan:
    """The plan a config describes on `world_size` ranks, defaults resolved (precision:
    `default_precision` unless the config sets one; gradients reduce in the compute dtype,
    under fp8 that of the layers outside fp8 (`fp8_base`), unless `parallel.reduce_dtype`
    says otherwise). No validation: the planner's entry points validate what they need."""
    p = cfg.parallel
    dp = p.dp or world_size // (p.tp * p.pp * p.cp)
    precision = p.precision or default_precision
    return ParallelPlan(
        tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, dp=dp, zero_group=p.zero_group or dp,
        zero_stage=p.zero_stage, vpp=p.vpp, schedule=p.schedule,
        stage_layers=tuple(p.stage_layers) if p.stage_layers else None,
        token_slices=p.token_slices, weight_prediction=p.weight_prediction,
        micro_batch=p.micro_batch or max(replica_rows(p.global_batch, dp, p.dp_batch_shares)),
        global_batch=p.global_batch,
        recompute=p.recompute, sequence_parallel=p.sequence_parallel, precision=precision,
        fp8_emulate=p.fp8_emulate, fp8_recipe=p.fp8_recipe, fp8_tensors=tuple(p.fp8_tensors),
        cp_mode=p.cp_mode, cp_ulysses=p.cp_ulysses, qwz=p.qwz, hpz=p.hpz, qgz=p.qgz,
        reduce_dtype=p.reduce_dtype or (fp8_base(default_precision) if precision == "fp8"
                                        else precision),
        optimizer=cfg.train.optimizer, gpus_per_node=cfg.cluster.gpus_per_node, offload=p.offload,
        offload_path=p.offload_path, offload_fraction=p.offload_fraction,
        offload_kernel=p.offload_kernel, offload_activations=p.offload_activations,
        dp_batch_shares=tuple(p.dp_batch_shares) if p.dp_batch_shares else None)


def fp8_base(default_precision: str) -> str:
    """The dtype of what fp8 training leaves out of fp8 (attention, norms, the head, the
    reductions): fp32 where that is the device's default (CPU: no bf16 units), else bf16."""
    return "fp32" if default_precision == "fp32" else "bf16"


def compute_precision(precision: str, device_type: str) -> str:
    """The compute dtype of the modules outside fp8: the precision, or fp8's `fp8_base`."""
    return fp8_base(device_precision(device_type)) if precision == "fp8" else precision


def device_precision(device_type: str) -> str:
    """The precision a run gets when the config sets none: bf16 on GPU, fp32 on CPU (these
    CPUs have no bf16 units)."""
    return "bf16" if device_type == "cuda" else "fp32"


def training_plan(cfg: Config, world_size: int, device_type: str,
                  fp8_units: bool = False) -> ParallelPlan:
    """The plan `fivefold train` runs on `world_size` ranks of `device_type` (`fp8_units`:
    whether it runs fp8 GEMMs), after the config has passed every check the runtime needs
    (ConfigError naming the key if not)."""
    validate_for_training(cfg, world_size, fp8_units)
    return plan_from_config(cfg, world_size, device_precision(device_type))

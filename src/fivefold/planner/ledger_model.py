"""The ledger of one training step, predicted from the configuration alone.

`predict_ledger(cfg, plan, rank=r)` returns a `Ledger` (fivefold.comm.ledger) with the
collectives global rank r issues in one `Trainer.train_step` under that `ParallelPlan` and
the model-state bytes it holds, to compare with `trainer.ledger.totals()` key by key. It
follows the data-parallel engine step by step, per flat unit of the rank's pipeline stage
(root first, then one per block, padded as the runtime pads them, fivefold.planner.memory):

  stage 0   last micro-batch: all-reduce each unit's gradient buffer over all dp ranks
  stage 1   last micro-batch: reduce-scatter each buffer over dp_shard; after the step,
            all-gather each unit's parameters
  stage 2   every backward pass: reduce-scatter each unit's gradient; all-gather after the step
  stage 3   every micro-batch: all-gather the root once and each block twice (forward and
            backward), reduce-scatter each unit's gradient; with pp > 1 the root once per
            step, the blocks as the passes find them freed (ledger_pipeline.zero3_block_gathers)
  stage>=1  hierarchical sharding (zero_group < dp): all-reduce each gradient shard over
            dp_replicate (experts': edp_replicate) after the last micro-batch; a 4-byte fp32
            all-reduce of the squared gradient norm over dp_shard
  always    a 4-byte fp32 all-reduce of the summed loss over every dp rank
  tp > 1    per micro-batch the collectives of tensor (and sequence) parallelism, see
            `_Step.tensor_parallel`, and under fp8 the tp ranks' amax exchanges
            (fivefold.planner.fp8_ledger); a 4-byte fp32 all-reduce of the gradient norm over tp;
            every unit holds this rank's shards (vocabulary padded to a multiple of tp)
  pp > 1    the sends and receives of the rank's schedule (fivefold.planner.ledger_pipeline),
            4-byte fp32 all-reduces of the loss and the gradient norm over pp; the units
            are the stage's (a tied head borrowed by the last stage is a buffer, not a unit)
  pp x tp   each stage split over tp (fivefold.parallel.pipeline.tensor_stage): the stage's
            own blocks' tensor-parallel collectives, the embedding's on the first stage, the
            final norm's and the vocabulary loss's on the last; messages of (B, T, D) per tp
            rank, (B, T/t, D) with sequence parallelism; the lent tied head is the tp rank's
            vocabulary rows; a zero-bubble split repeats no collective (f's all-reduce runs
            once, in I; sequence parallelism's re-gathers and norm-gain sums once, in W)
  cp > 1    per micro-batch and block, the attention's exchanges on the cp axis
            (fivefold.parallel.context; `_Step.context_parallel`); gradients are synced, and
            ZeRO shards, over dp x cp: the dp_shard collectives run on "dp_shard+cp" (size
            zero_group * cp) and the all-reduces over every data rank on
            "dp_replicate+dp_shard+cp"
  Muon      under ZeRO or tp, per unit with a matrix an fp32 all-gather and reduce-scatter
            over its Muon axis, and the exact optimizer state (fivefold.planner.muon_cost);
            GaLore on the engine (tp, pp or ZeRO-3) its gradient all-gathers, tp projections
            and refreshes (`galore_refresh`; fivefold.planner.ledger_galore) and its state
  MoE       after the step, one float64 all-reduce over the stage's routing ranks of the
            MoE layers' load statistics (experts + 2 numbers each: train.moe_stats). On the
            experts' grid (ep, etp or tp > 1; fivefold.expert_grid) each block's routed
            experts are a unit of their own, synced over the edp ranks (all-reduced at stage
            0, sharded at 1-3), the gradient norm one 4-byte all-reduce over the stage, and
            per micro-batch the all-to-alls of `_Step.expert_parallel` at balanced routing;
            an MoE block has no tensor-parallel MLP region (it runs on 1/tp of the tokens).
            Where tp, sp or cp splits a micro-batch, the statistics are reduced over the
            routing axes, the expert rows are a rank's share's, and moe_ledger's
            `token_split_records` adds the balancing counts' all-reduce, over tp the
            router's and shared experts' gradient all-reduces and, without sequence
            parallelism, the all-gathers of the layer's output and input gradient

ZeRO++ (fivefold.comm.zeropp): qwZ sends weight all-gathers as int8 plus an fp32 scale per
256 values; hpZ runs backward all-gathers inside the node; qgZ replaces each gradient
reduce-scatter by two int8 all-to-alls (within, then across nodes); a routed-expert unit's on
its edp (or edp_shard) group ("edp", "edp.intra", "edp.inter"). With dp_batch_shares a rank's
step is its replica's (batch_shares.replica_plan). Sizes are computed, not read from a run.
"""

from __future__ import annotations

import math

from fivefold.batch_shares import dp_rank_of, replica_plan
from fivefold.comm.ledger import Ledger
from fivefold.config import Config
from fivefold.expert_grid import STAGE_AXES
from fivefold.models.description import is_moe_layer
from fivefold.parallel.context.heads import ulysses_kv_heads
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.fp8_ledger import fp8_amax_records
from fivefold.planner.ledger_pipeline import (gradient_passes, pipeline_messages,
                                               stage_layers_of_rank, zero3_block_gathers)
from fivefold.planner.ledger_galore import galore_engine_ledger
from fivefold.planner.ledger_update import update_path_ledger
from fivefold.planner.memory import Unit, model_state_bytes, stage_units
from fivefold.planner.moe_ledger import token_split_records
from fivefold.planner.muon_cost import muon_records, sharded_muon, with_muon_state

# fp8 training communicates in bf16 outside its linears, as on a GPU (on the CPU the
# runtime's base dtype is fp32: fivefold.parallel.plan.compute_precision)
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
QUANT_BLOCK = 256  # fivefold.comm.quantize.BLOCK


def predict_ledger(cfg: Config, lay: ParallelPlan, rank: int = 0,
                   galore_refresh: bool = False) -> Ledger:
    """The ledger `Trainer.train_step` records on global rank `rank` under plan `lay` (for
    GaLore on the engine, of a step without subspace refresh unless `galore_refresh`)."""
    lay = replica_plan(lay, dp_rank_of(lay, rank))  # dp_batch_shares: this rank's replica
    pp_rank = lay.pp_rank_of(rank)
    layers, first, last = stage_layers_of_rank(cfg, lay, pp_rank)
    units = stage_units(cfg.model, lay, layers, first, last,
                        QUANT_BLOCK if lay.qwz or lay.qgz else 1, etp=lay.etp)
    moe_layers = sum(is_moe_layer(cfg.model, i) for i in layers)
    if lay.update in ("galore-dp", "lomo"):  # outside the engine (their own module)
        ledger = update_path_ledger(cfg, lay)
    else:
        ledger = Ledger()
        if lay.update == "plain":
            return ledger  # the plain single-process path: no engine, no collectives
        _Step(ledger, lay, units, cfg, pp_rank, (layers, first, last), moe_layers).run()
        ledger.model_state_bytes = model_state_bytes(units, lay)
        if lay.optimizer == "galore":  # the engine's optimizer: fivefold.memory.galore_units
            galore_engine_ledger(ledger, cfg, lay, units, layers, rank, galore_refresh)
        if sharded_muon(lay):  # each matrix gathered to its owner and scattered back
            for record in muon_records(cfg, lay, units, layers):
                ledger.record(*record)
            ledger.model_state_bytes = with_muon_state(ledger.model_state_bytes, cfg, lay,
                                                       units, layers, rank)
    routing = lay.dp * lay.cp * (lay.tp if "tp" in lay.routing_axes else 1)
    if moe_layers and routing > 1:  # the load statistics (fivefold.train.moe_stats)
        ledger.record("all_reduce", "+".join(lay.routing_axes), routing, "float64",
                      moe_layers * (cfg.model.moe.experts + 2) * 8, "moe_load")
    return ledger


class _Step:
    """Replays the engine's collectives for one optimizer step into a ledger."""

    def __init__(self, ledger: Ledger, lay: ParallelPlan, units: list[Unit], cfg: Config,
                 pp_rank: int, stage: tuple[list[int], bool, bool], moe_layers: int):
        self.ledger, self.lay, self.units, self.cfg = ledger, lay, units, cfg
        self.pp_rank = pp_rank
        self.layers, self.first, self.last = stage  # blocks held; embedding; norm and head
        self.blocks = len(self.layers)
        self.moe_layers = moe_layers  # of those blocks
        self.qwz, self.hpz, self.qgz = lay.qwz, lay.hpz, lay.qgz
        self.param = DTYPE_NAMES[lay.precision]
        self.reduce = DTYPE_NAMES[lay.reduce_dtype] if lay.zero_stage >= 2 else self.param
        self.pb = 4 if lay.precision == "fp32" else 2
        self.gb = 4 if self.reduce == "float32" else 2
        self.shard = lay.zero_group * lay.cp if lay.zero_stage >= 1 else 1
        self.replicate = lay.dp_replicate if lay.zero_stage >= 1 else 1
        self.shard_dim = "+".join(lay.shard_axes)  # the mesh axes ZeRO shards over
        self.tokens_dim = "+".join(lay.token_axes)  # every rank of other tokens
        self.tokens_size = lay.dp * lay.cp
        self.node = lay.ranks_per_node if (self.hpz or self.qgz) else 1
        self.expert_node = lay.expert_ranks_per_node if (self.hpz or self.qgz) else 1
        self.edp = lay.expert_data_parallel  # the ranks holding copies of the same experts

    def record(self, op: str, dim: str, size: int, dtype: str, nbytes: int, purpose: str):
        if size > 1:
            self.ledger.record(op, dim, size, dtype, nbytes, purpose)

    def shard_axis(self, u: Unit) -> tuple[str, int]:
        """(axis, size) a unit's ZeRO collectives run on: ZeRO's shard axes, or for a block's
        routed experts the edp ranks that shard them (ParallelPlan.expert_shard_axis)."""
        return self.lay.expert_shard_axis if u.expert else (self.shard_dim, self.shard)

    def sync_axis(self, u: Unit) -> tuple[str, int]:
        """(axis, size) of a unit's plain data-parallel all-reduce (stage 0)."""
        return ("edp", self.edp) if u.expert else (self.tokens_dim, self.tokens_size)

    def node_size(self, u: Unit) -> int:
        """Ranks per node of a unit's shard group (ZeRO++'s hpZ and qgZ subgroups)."""
        return self.expert_node if u.expert else self.node

    def gather(self, u: Unit, backward: bool) -> None:
        dim, size = self.shard_axis(u)
        if backward and self.hpz:
            self.record("all_gather", f"{dim}.intra", self.node_size(u), self.param,
                        u.padded * self.pb, "params")
        elif self.qwz:
            self.record("all_gather", dim, size, "int8", u.padded, "params")
            self.record("all_gather", dim, size, "float32", u.padded // QUANT_BLOCK * 4,
                        "params")
        else:
            self.record("all_gather", *self.shard_axis(u), self.param, u.padded * self.pb,
                        "params")

    def reduce_scatter(self, u: Unit, dtype: str, nbytes_per: int) -> None:
        if not self.qgz:
            self.record("reduce_scatter", *self.shard_axis(u), dtype, u.padded * nbytes_per,
                        "grads")
            return
        (dim, shard), g = self.shard_axis(u), self.node_size(u)
        for dim, size, numel in ((f"{dim}.intra", g, u.padded),
                                 (f"{dim}.inter", shard // g, u.padded // g)):
            self.record("all_to_all", dim, size, "int8", numel, "grads")
            self.record("all_to_all", dim, size, "float32", numel // QUANT_BLOCK * 4, "grads")

    def tensor_parallel(self) -> None:
        """One micro-batch's tensor-parallel collectives on this rank's stage
        (fivefold.parallel.tensor; the whole model when pp = 1): Megatron's f/g all-reduces at
        the embedding (first stage), around each attention and MLP of the stage's blocks and
        at the final norm (last stage); with sequence parallelism their all-gather /
        reduce-scatter halves, one re-gather of each region's input in backward and an
        all-reduce of every norm gain's gradient; and, on the last stage, the
        vocabulary-parallel loss's all-gather of three fp32 statistics per token. Full
        and selective recomputation run each block's forward again in backward
        (fivefold.memory.recompute; selective takes some outputs from its cache but runs the
        collectives again) up to the last tensor the backward needs (torch's early stop):
        the two regions' openings and the attention's close run again; the MLP's close,
        whose output nothing saves, only where a split backward recomputes whole blocks."""
        lay, t, m = self.lay, self.lay.tp, self.cfg.model
        tokens = lay.micro_batch * m.seq_len // lay.cp  # this cp rank's share
        act = tokens * m.hidden * self.pb
        # an MoE block's MLP is no region (whole on every tp rank, or on its sp shard)
        regions, ends = 2 * self.blocks - self.moe_layers, int(self.first) + int(self.last)
        again = (regions if lay.split_backward else self.blocks) if lay.recompute != "none" else 0
        opened = regions if lay.recompute != "none" else 0  # every region's opening again
        if lay.sequence_parallel:
            for op, count, purpose in (
                    ("reduce_scatter", 2 * regions + ends + again, "sp_activations"),
                    ("all_gather", 2 * regions + ends + opened, "sp_activations"),
                    ("all_gather", regions, "sp_regather")):
                for _ in range(count):
                    self.record(op, "tp", t, self.param, act, purpose)
            for _ in range(2 * self.blocks + int(self.last)):  # the norm gains
                self.record("all_reduce", "tp", t, self.param, m.hidden * self.pb,
                            "sp_norm_grads")
        else:  # embedding and 2 regions forward; 2 regions and the final norm backward
            for _ in range(2 * regions + ends + again):
                self.record("all_reduce", "tp", t, self.param, act, "tp_activations")
        if self.last:
            self.record("all_gather", "tp", t, "float32", t * 3 * tokens * 4, "vocab_loss")

    def context_parallel(self) -> None:
        """One micro-batch's attention exchanges on the cp axes, per block of the stage
        (fivefold.parallel.context). Ulysses (degree u, the "cp" axis, or "cp_ulysses" in the
        hybrid): four all-to-alls forward (q, k, v to head shards, the output back) of this rank's
        T/cp tokens and their four inverses backward, key/value heads replicated up to u when they
        are fewer. Ring (degree n, "cp", or "cp_ring" across the Ulysses groups): on the T/n tokens
        and heads/u heads a rank then holds, the forward passes the stacked key/value block (2 x B
        x K x T/n x E) n - 1 times round the ring, the backward passes it n - 1 times again and the
        accumulating dK/dV block n times, in fp32 when the compute dtype has 16 bits. Recomputation
        (full or selective) repeats the forward's (wo's input is their output)."""
        lay, m, passes = self.lay, self.cfg.model, 2 if self.lay.recompute != "none" else 1
        ring, ulysses = lay.context_degrees
        hybrid = ring > 1 and ulysses > 1
        shard_tokens = lay.micro_batch * m.seq_len // lay.cp
        heads, kv_heads = m.heads // lay.tp, m.n_kv_heads // lay.tp  # this tp rank's
        if ulysses > 1:
            kv_heads = ulysses_kv_heads(kv_heads, ulysses)  # replicated to fit when fewer
            dim = "cp_ulysses" if hybrid else "cp"
            sizes = {"cp_q": heads, "cp_k": kv_heads, "cp_v": kv_heads, "cp_out": heads}
            for _ in range(self.blocks):
                for purpose, n_heads in sizes.items():
                    nbytes = shard_tokens * n_heads * m.d_head * self.pb
                    for suffix in ("",) * passes + ("_grad",):
                        self.record("all_to_all", dim, ulysses, self.param, nbytes,
                                    purpose + suffix)
        if ring > 1:
            ring_tokens, ring_kv_heads = shard_tokens * ulysses, kv_heads // ulysses
            kv = 2 * ring_tokens * ring_kv_heads * m.d_head
            dim = "cp_ring" if hybrid else "cp"
            acc, acc_bytes = ("float32", 4) if self.pb == 2 else (self.param, self.pb)
            for _ in range(self.blocks):
                for _ in range((passes + 1) * (ring - 1)):
                    for op in ("send", "recv"):
                        self.record(op, dim, ring, self.param, kv * self.pb, "cp_kv")
                for _ in range(ring):
                    for op in ("send", "recv"):
                        self.record(op, dim, ring, acc, kv * acc_bytes, "cp_dkv")

    def expert_parallel(self) -> None:
        """One micro-batch's all-to-alls on the experts' grid, per MoE layer of the stage
        (fivefold.parallel.expert, fivefold.parallel.expert_tensor), at balanced routing. On
        the ep axis: the count exchange (one int64 per expert), the dispatch of this rank's
        kept assignments (a row of `hidden` each; the rank's 1/tp of its tokens) and their
        combine back, and backward's two in reverse. On the etp axis: the all-gather of the
        rows per local expert (int64), the gather of the etp ranks' rows (each rank's
        received rows once per peer) and the scatter of their partial outputs back, and
        backward's two in reverse. Dispatch and the combine's backward carry this rank's own
        rows, so with dropless routing their bytes are exact; the others carry rows the
        routing decides: balanced, as many (summed over the ranks, exact when dropless;
        fivefold.planner.moe_ledger predicts them from a recorded routing). Recomputation
        (full or selective) runs the forward's collectives again in backward."""
        lay, m = self.lay, self.cfg.model
        rows = lay.micro_batch * m.seq_len // lay.cp // lay.tp * m.moe.top_k
        if m.moe.capacity_factor is not None:  # each expert takes at most its capacity
            per_expert = math.ceil(m.moe.capacity_factor * rows / m.moe.experts)
            rows = min(rows, m.moe.experts * per_expert)
        row_bytes = rows * m.hidden * self.pb
        grid = []  # (dim, size, forward, backward)
        if lay.ep > 1:
            grid.append(("ep", lay.ep,
                         [("int64", m.moe.experts * 8, "moe_counts"),
                          (self.param, row_bytes, "moe_dispatch"),
                          (self.param, row_bytes, "moe_combine")],
                         [(self.param, row_bytes, "moe_dispatch_backward"),
                          (self.param, row_bytes, "moe_combine_backward")]))
        if lay.etp > 1:
            etp_bytes = lay.etp * row_bytes
            grid.append(("etp", lay.etp,
                         [("int64", lay.etp * m.moe.experts // lay.ep * 8, "moe_etp_counts"),
                          (self.param, etp_bytes, "moe_etp_gather"),
                          (self.param, etp_bytes, "moe_etp_scatter")],
                         [(self.param, etp_bytes, "moe_etp_scatter_backward"),
                          (self.param, etp_bytes, "moe_etp_gather_backward")]))
        passes = 2 if lay.recompute != "none" else 1
        for _ in range(self.moe_layers):
            for dim, size, forward, backward in grid:
                for dtype, nbytes, purpose in forward * passes + backward:
                    op = "all_gather" if purpose == "moe_etp_counts" else "all_to_all"
                    self.record(op, dim, size, dtype, nbytes, purpose)

    def pipeline(self) -> None:
        """The step's point-to-point messages on the pp axis (ledger_pipeline) and the
        pipeline's 4-byte fp32 all-reduce of the summed loss over the stages."""
        for op, purpose, nbytes in pipeline_messages(self.cfg, self.lay, self.pp_rank, self.pb):
            self.record(op, "pp", self.lay.pp, self.param, nbytes, purpose)
        self.record("all_reduce", "pp", self.lay.pp, "float32", 4, "loss")

    def run(self) -> None:
        lay, units = self.lay, self.units
        stage, micro = lay.zero_stage, lay.micro_batches
        if lay.pp > 1:
            self.pipeline()
        has_root = lay.pp == 1 or any(lay.ends_of_rank(self.pp_rank))
        root, blocks = (units[0], units[1:]) if has_root else (None, units)
        if stage == 3 and lay.pp > 1:
            if root:  # held from the step's first action to its end
                self.gather(root, backward=False)
            starts = [k for k, u in enumerate(blocks) if not u.expert] + [len(blocks)]
            per_block = [blocks[a:b] for a, b in zip(starts, starts[1:])]  # dense, experts
            for j, backward in zero3_block_gathers(self.cfg, lay, self.pp_rank):
                for u in per_block[j]:
                    self.gather(u, backward)
        dense = [*([root] if root else []), *(u for u in blocks if not u.expert)]
        passes = dict(zip(map(id, dense), gradient_passes(self.cfg, lay, self.pp_rank)))
        for j in range(micro):
            last = j == micro - 1
            if lay.tp > 1:
                self.tensor_parallel()
            if lay.cp > 1:
                self.context_parallel()
            if (lay.ep > 1 or lay.etp > 1) and self.moe_layers:
                self.expert_parallel()
            for record in token_split_records(self.cfg, lay, self.layers, self.param, self.pb):
                self.record(*record)
            if lay.precision == "fp8":  # the linears' amax exchanges over tp and cp
                for record in fp8_amax_records(self.cfg, lay, self.layers):
                    self.record(*record)
            if stage == 3 and lay.pp == 1:
                for u in units:  # root, then each block (prefetched one ahead)
                    self.gather(u, backward=False)
            for u in reversed(blocks):
                if stage == 3 and lay.pp == 1:
                    self.gather(u, backward=True)
            for u in [*reversed(blocks), *([root] if root else [])]:
                if stage == 0 and last:
                    self.record("all_reduce", *self.sync_axis(u), self.param,
                                u.padded * self.pb, "grads")
                elif stage == 1 and last:
                    self.reduce_scatter(u, self.param, self.pb)
                elif stage >= 2:
                    for _ in range(passes.get(id(u), 1)):
                        self.reduce_scatter(u, self.reduce, self.gb)
            if last and stage >= 1:
                for u in units:  # hierarchical sharding's second hop (experts' own)
                    self.record("all_reduce", "edp_replicate" if u.expert else "dp_replicate",
                                self.replicate, self.reduce, u.shard_numel * self.gb, "grads")
        if self.cfg.model.moe is not None and lay.expert_grid:  # every rank of the stage
            self.record("all_reduce", "+".join(STAGE_AXES), self.tokens_size * lay.tp,
                        "float32", 4, "grad_norm")
        else:
            if stage >= 1:
                self.record("all_reduce", self.shard_dim, self.shard, "float32", 4,
                            "grad_norm")
            self.record("all_reduce", "tp", lay.tp, "float32", 4, "grad_norm")
        self.record("all_reduce", "pp", lay.pp, "float32", 4, "grad_norm")
        if stage in (1, 2):
            for u in units:
                self.record("all_gather", *self.shard_axis(u), self.param, u.padded * self.pb,
                            "params")
        self.record("all_reduce", self.tokens_dim, self.tokens_size, "float32", 4, "loss")

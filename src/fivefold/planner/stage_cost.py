"""A layout's pipeline stages: blocks cut into virtual stages, each stage's times for one
micro-batch, and the schedule's action lists replayed with them.

Blocks are cut by the runtime's partitioner (fivefold.parallel.pipeline.partition), or by the
planner's split when the layout carries `stage_layers`. A stage's time is its blocks'
scheduled times (fivefold.planner.block_cost) plus its root parts (embedding on the first,
final norm, head and loss on the last) and their tensor-parallel collectives. The schedule's
action lists (fivefold.planner.schedules) are replayed event by event by the runtime's own
replay (fivefold.parallel.pipeline.replay): the stage-level use of the step's event model,
with point-to-point transfers on their own stream (only the receiver waits). With tied
embeddings the first rank lends the matrix to the last stage at the start of the step
(hidden behind the pipeline's fill) and receives its head gradient back after the last
stage's final backward, before its own final backward: that return can be exposed
(fivefold.planner.step). Under activation offload a stage's first blocks keep their saved
bytes on the host, and its backward waits for their return (fivefold.planner.
activation_offload).
"""

from __future__ import annotations

import functools

from fivefold.models.description import is_moe_layer
from fivefold.parallel.plan import PRECISION_BYTES
from fivefold.parallel.pipeline.partition import balanced_counts, stage_layer_ranges
from fivefold.planner import activations as A
from fivefold.planner.activation_offload import (backward_wait_s, inline_copy_s,
                                                 offloaded_layers)
from fivefold.planner.block_cost import BlockCosts
from fivefold.planner.block_ops import beside_seconds
from fivefold.planner.comm import Group
from fivefold.planner.schedules import (Replay, action_durations, overlapped_pairs,
                                        replay_step, runtime_schedule)


class StageCosts(BlockCosts):
    """`BlockCosts` cut into the layout's pipeline stages and replayed (module docstring)."""

    @functools.cached_property
    def stage_layers(self) -> list[int]:
        """Blocks per virtual stage (pp * vpp stages): the layout's `stage_layers` when set
        (the planner's search sets it by `balanced_stage_layers`), else the runtime's own
        default split (fivefold.parallel.pipeline.partition), so that `simulate` predicts
        what `train` runs."""
        stages = self.lay.pp * self.lay.vpp
        given = self.lay.stage_layers
        if given:
            return list(given)
        if stages == 1:
            return [self.model.layers]
        return [len(r) for r in stage_layer_ranges(self.model, stages)]

    def balanced_stage_layers(self, fits=lambda stage, first, end: True) -> list[int]:
        """The planner's split: blocks cut by modelled time, each stage within `fits`
        (fivefold.parallel.pipeline.partition, Alpa's inter-operator pass)."""
        stages = self.lay.pp * self.lay.vpp
        if stages == 1:
            return [self.model.layers]
        costs = [self.layer_cost(i).f + self.layer_cost(i).b for i in range(self.model.layers)]
        emb, head = self.embedding, self.head
        return balanced_counts(costs, stages, emb.fwd + emb.bwd, head.fwd + head.bwd, fits)

    @functools.cached_property
    def stage_ranges(self) -> list[range]:
        out, start = [], 0
        for n in self.stage_layers:
            out.append(range(start, start + n))
            start += n
        return out

    def stage_times(self, g: int) -> tuple[float, float, float, float, float]:
        """(F, B, W, F comm, B comm) seconds of virtual stage g for one micro-batch."""
        costs = [self.layer_cost(i) for i in self.stage_ranges[g]]
        f = sum(c.f for c in costs)
        b = sum(c.b for c in costs)
        fc = sum(c.f_comm for c in costs)
        bc = sum(c.b_comm for c in costs)
        w = sum(c.wgrad for c in costs)
        copies_f, wait_b = self.offload_copy_s(g)
        f, b = f + copies_f, b + wait_b
        stages = len(self.stage_layers)
        tp_f, tp_b = self.root_tp_comm(g == 0, g == stages - 1)
        f, b, fc, bc = f + tp_f, b + tp_b, fc + tp_f, bc + tp_b
        if g == 0:
            f, b = f + self.embedding.fwd, b + self.embedding.bwd
            w += self.embedding.wgrad
        if g == stages - 1:
            f, b = f + self.head.fwd, b + self.head.bwd
            w += self.head.wgrad
        return f, b, w, fc, bc

    def offload_copy_s(self, g: int) -> tuple[float, float]:
        """(forward, backward) seconds stage g's pass of one micro-batch spends on its
        offloaded blocks' copies (fivefold.planner.activation_offload): queued with compute
        under a stack with offload_copies_inline, else none in forward and in backward the
        wait for the activations to come back; (0, 0) without activation offload."""
        off = offloaded_layers(self.lay, self.stage_ranges[g])
        if not off:
            return 0.0, 0.0
        link = self.prof.host.link_Bps
        if self.stack.offload_copies_inline:
            copies = inline_copy_s([self.block_saved_bytes(i) for i in off], link)
            return copies, copies
        before = sum(self.layer_cost(i).b for i in self.stage_ranges[g] if i not in off)
        if g == len(self.stage_layers) - 1:
            before += self.head.bwd
        return 0.0, backward_wait_s([(self.block_saved_bytes(i), self.layer_cost(i).b)
                                     for i in off], before, link)

    @functools.cached_property
    def stages_once(self) -> list[tuple[float, float]]:
        """`stage_once` of every virtual stage."""
        return [self.stage_once(g) for g in range(len(self.stage_layers))]

    def stage_once(self, g: int) -> tuple[float, float]:
        """(first forward, last backward) seconds that virtual stage g pays once a step when
        its ZeRO-3 blocks stay gathered: their all-gathers beside its first forward's
        compute, their gradient reduce-scatters beside its last backward's."""
        if not self.pp_unsharded:
            return 0.0, 0.0
        hide, g_bytes = self.prof.eff.overlap_eff, PRECISION_BYTES[self.lay.reduce_dtype]
        ag = rs = fwd = bwd = 0.0
        for i in self.stage_ranges[g]:
            dense, expert = self.block_numels(is_moe_layer(self.model, i))
            ag += self._data_coll("all_gather", dense * self.a, expert * self.a)
            rs += self._data_coll("reduce_scatter", dense * g_bytes, expert * g_bytes)
            cost = self.layer_cost(i)
            fwd, bwd = fwd + cost.f_compute, bwd + cost.b_compute
        return beside_seconds(ag, fwd, hide), beside_seconds(rs, bwd, hide)

    @functools.cached_property
    def p2p_s(self) -> float:
        if self.lay.pp == 1:
            return 0.0
        act = self.shard.tokens * self.model.hidden * self.a
        if self.lay.sequence_parallel:
            act /= self.lay.tp
        return self._coll("send", act, self.pp_pair)

    @functools.cached_property
    def tied_exchange_s(self) -> float:
        """Seconds of one tied-embedding message between the first pipeline rank and the
        last stage's (this tp rank's ceil(V/t) rows of the matrix, lent at the step's start,
        or of the head's gradient, returned), in the compute dtype as the executor sends
        them; 0 without pipelining or tied embeddings, and in a V, where both stages are on
        the first rank."""
        lay, m = self.lay, self.model
        if lay.pp == 1 or not m.tied_embeddings or lay.v_shape:  # V: through the mailbox
            return 0.0
        first_last = Group.strided(2, lay.tp * lay.cp * lay.dp * (lay.pp - 1),
                                   self.cfg.cluster.gpus_per_node)
        rows = -(-m.vocab // lay.tp)
        return self._coll("send", rows * m.hidden * self.a, first_last)

    def stage_activation_bytes(self, g: int) -> float:
        """Bytes virtual stage g keeps on the device per in-flight micro-batch (not its
        offloaded blocks')."""
        lay = self.lay
        off = offloaded_layers(lay, self.stage_ranges[g])
        total = sum(self.block_saved_bytes(i) for i in self.stage_ranges[g] if i not in off)
        first, last = g == 0, g == len(self.stage_layers) - 1
        return total + A.layout_root_saved_bytes(self.model, lay, first, last, self.stack)

    def block_saved_bytes(self, i: int) -> float:
        """Bytes block i keeps for backward per micro-batch (fivefold.planner.activations),
        shared through `cache` by the layouts of the same shard shape."""
        lay = self.lay
        key = ("saved", i, lay.cp_ulysses, A.layout_autocast(lay, self.stack)) + self.shape_key
        if key not in self.cache:
            self.cache[key] = A.layout_block_saved_bytes(self.model, lay, i, self.stack)
        return self.cache[key]

    def full_block_bytes(self) -> float:
        """Bytes one block holds while it is recomputed and differentiated
        (fivefold.planner.activations.full_block_bytes), shared through `cache` by the
        layouts of the same shard shape."""
        key = ("full block",) + self.shape_key
        if key not in self.cache:
            lay = self.lay
            self.cache[key] = A.full_block_bytes(self.model, self.shard.tokens, self.a, lay.tp,
                                                 lay.sequence_parallel)
        return self.cache[key]

    def run_pipeline(self, keep_events: bool) -> Replay:
        """Replay the schedule; PipeDream-2BW never flushes, so its step is the steady-state
        difference between replays of two and three optimizer steps."""
        lay = self.lay
        stages, n, m = len(self.stage_layers), lay.slices, lay.micro_batches
        once = self.stages_once if self.pp_unsharded else None
        duration = action_durations([self.stage_times(g) for g in range(stages)], n, m, once,
                                    overlapped_pairs(lay.schedule, lay.pp, lay.vpp, m),
                                    self.prof.eff.overlap_eff)
        weights = [self.stage_activation_bytes(g) / n for g in range(stages)]
        tied = self.tied_exchange_s > 0
        tied_s = {"tied_weight": self.tied_exchange_s, "tied_grad": self.tied_exchange_s}
        if lay.schedule == "pipedream-2bw":
            two, three = (replay_step(runtime_schedule(lay.schedule, lay.pp, 1, m, steps=k,
                                                       tied=tied),
                                      duration, self.p2p_s, lambda g: weights[g], keep_events,
                                      tied_s)
                          for k in (2, 3))
            return Replay([c - b for b, c in zip(two.finish_s, three.finish_s)],
                          [c - b for b, c in zip(two.busy_s, three.busy_s)],
                          three.peak_weight, three.events, three.last_grads)
        sched = runtime_schedule(lay.schedule, lay.pp, lay.vpp, m, n, tied=tied)
        return replay_step(sched, duration, self.p2p_s, lambda g: weights[g], keep_events,
                           tied_s)

"""One simulated step of a layout: memory per pipeline rank and the step time with its
breakdown.

The step is assembled from the parts below it:

1. Per block and micro-batch on one rank: compute and the collectives of each technique as
   ops on the rank's streams, scheduled (fivefold.planner.block_cost, block_ops, events).
2. The pipeline schedule's action lists replayed with the stages' times
   (fivefold.planner.stage_cost): each rank's finish time, busy time and peak in-flight
   activations.
3. After the last backward (fivefold.planner.rank_cost): the data-parallel gradient
   synchronisation that did not hide behind that backward, then the optimizer step
   (memory bound) and, for ZeRO-1/2, the parameter all-gather that follows it (beside the
   next step's first forward under a stack with `dp_overlap`). Under offload the offloaded
   units step on the CPU (fivefold.planner.offload) and what the next forward waits for
   them counts as optimizer time; the host must hold the offloaded state of its ranks.
   Under activation offload the host must also hold the offloaded blocks' activations, and
   each stage's backward includes its wait for them (fivefold.planner.activation_offload).

Memory per rank: model states per fivefold.planner.memory, saved activations per
fivefold.planner.activations at the replay's peak in-flight micro-batches, and `other`
(reserved memory, ZeRO-3's gathered blocks, the loss's logits); the blocks' linear weights,
and ZeRO-3's gathered copies of them, at the bytes the stack keeps them in (`linear_bytes`:
fp8 where it gathers fp8 parameters, fivefold.planner.stack). FLOPs follow docs/planner.md:
model FLOPs are three times the forward matmul FLOPs, attention over the full s x s square;
hardware FLOPs add what recomputation repeats.
"""

from __future__ import annotations

import functools

from fivefold.models.description import is_moe_layer
from fivefold.parallel.plan import PRECISION_BYTES
from fivefold.planner import activations as A
from fivefold.planner import offload
from fivefold.planner.activation_offload import activation_offload_summary
from fivefold.planner.block_ops import beside_seconds
from fivefold.planner.compute import Shard, block_times, head_times
from fivefold.planner.estimate import Estimate
from fivefold.planner.memory import model_state_bytes, stage_units, weight_copies
from fivefold.planner.params import (block_linear_params, block_params, borrowed_head_params,
                                     root_params)
from fivefold.planner.rank_cost import RankCosts
from fivefold.planner.schedules import peak_in_flight


class LayoutStep(RankCosts):
    """A layout's whole step: `estimate()` (module docstring)."""

    @functools.cached_property
    def linear_bytes(self) -> int | None:
        """Bytes per element of the blocks' linear weights where the stack keeps them as fp8
        (fivefold.planner.stack Stack.fp8_weight_bytes); None: the compute dtype's."""
        return self.stack.fp8_weight_bytes(self.lay.precision, self.prof.architecture)

    def fp8_weight_saving(self, linear: float) -> float:
        """Bytes that `linear` elements of linear weights take less than at the compute
        dtype's width, where the stack keeps them as fp8."""
        return 0 if self.linear_bytes is None else linear * (self.a - self.linear_bytes)

    def block_state_bytes(self, i: int) -> float:
        """Parameters, gradients and optimizer states of block i on its rank."""
        units = stage_units(self.model, self.lay, [i], False, False, etp=self.etp)
        return model_state_bytes(units, self.lay, self.linear_bytes)["total"]

    def rank_fixed_bytes(self, rank: int, inflight: float) -> float:
        """What pipeline rank `rank` holds besides its blocks: root parameters and their
        activations over `inflight` micro-batches, and the memory() 'other' terms."""
        lay = self.lay
        first, last = rank == 0, rank == lay.pp - 1
        units = stage_units(self.model, lay, [], first, last)
        states = model_state_bytes(units, lay, self.linear_bytes)["total"] if units else 0
        root = A.layout_root_saved_bytes(self.model, lay, first, last, self.stack)
        return states + root * inflight + self.other_bytes(rank)

    def other_bytes(self, rank: int) -> float:
        """Reserved memory, ZeRO-3's gathered buffers, the tied head a last stage borrows
        (the buffer and its gradient, at the parameters' bytes) and the loss's logits on
        `rank`."""
        lay, m = self.lay, self.model
        other = self.prof.eff.reserved_bytes
        borrowed = borrowed_head_params(m, lay.tp, rank == 0, rank == lay.pp - 1)
        other += borrowed * PRECISION_BYTES[lay.precision] * (weight_copies(lay) + 1)
        if lay.zero_stage == 3 and self.pp_unsharded:  # every block of the rank, all step
            unsharded = (sum(sum(block_params(m, i, lay.tp, lay.ep, self.etp))
                             for i in self.rank_layers(rank))
                         + root_params(m, lay.tp, rank == 0, rank == lay.pp - 1))
            other += unsharded * (self.a + PRECISION_BYTES[lay.reduce_dtype])
            other -= self.fp8_weight_saving(sum(sum(block_linear_params(
                m, i, lay.tp, lay.ep, self.etp)) for i in self.rank_layers(rank)))
        elif lay.zero_stage == 3:  # the gathered unit being computed and the prefetched one
            dense, expert = block_params(m, m.layers - 1, lay.tp, lay.ep, self.etp)
            live = 2 * (dense + expert)
            linear = 2 * sum(block_linear_params(m, m.layers - 1, lay.tp, lay.ep, self.etp))
            if self.stack.zero3_live_params:
                live, linear = (min(live, self.stack.zero3_live_params),
                                linear * min(1.0, self.stack.zero3_live_params / live))
            other += live * self.a - self.fp8_weight_saving(linear)
            other += root_params(m, lay.tp, rank == 0, rank == lay.pp - 1) * self.a
        if rank == lay.pp - 1:  # logits, their fp32 copy and gradient around the loss
            other += self.shard.tokens * m.vocab / lay.tp * self.stack.logit_bytes(self.a)
        return other

    def memory(self, rank: int, peak_act: float) -> dict[str, int]:
        lay, m = self.lay, self.model
        if A.layout_autocast(lay, self.stack):  # fp32 weights and gradients, no masters
            fp32 = lay.replace(precision="fp32")
            states = model_state_bytes(self.rank_units(rank, fp32), fp32)
        else:
            states = model_state_bytes(self.rank_units(rank), lay, self.linear_bytes)
        if lay.recompute != "none":  # one block rematerialised during its backward
            peak_act += (A.full_block_bytes(m, self.shard.tokens, self.a, lay.tp,
                                            lay.sequence_parallel)
                         if not self.stack.fp8_saved_inputs else
                         A.block_saved_bytes(m, self.shard.tokens, self.a, lay.tp,
                                             lay.sequence_parallel, "none", 0, self.stack,
                                             A.fp8_input_copy(lay)))
        mem = {"params": states["params"], "grads": states["grads"],
               "optimizer": states["master"] + states["optimizer"],
               "activations": int(peak_act), "other": int(self.other_bytes(rank))}
        mem["total"] = sum(mem.values())
        return mem

    @functools.cached_property
    def flops_per_sequence(self) -> tuple[float, float]:
        """(model, hardware) FLOPs of one sequence through the whole model, all ranks."""
        one = Shard(1, self.model.seq_len, 1, 1, False, 1, "bf16", self.lay.recompute,
                    stack=self.stack)
        model = hw = 0.0
        for i in range(self.model.layers):
            t = block_times(self.model, one, self.prof, is_moe_layer(self.model, i))
            model, hw = model + t.model_flops, hw + t.hw_flops
        h = head_times(self.model, one, self.prof)
        return model + h.model_flops, hw + h.hw_flops

    def estimate(self, keep_events: bool = False) -> Estimate:
        lay, prof = self.lay, self.prof
        rp = self.run_pipeline(keep_events)
        ends, stages = [], len(self.stage_layers)
        times = [self.stage_times(g) for g in range(stages)]
        tails = []
        for r in range(lay.pp):
            tail, regather = self.dp_sync(r, rp.last_grads[r])
            if self.stack.dp_overlap and regather:  # beside the next step's first forward
                window = sum(times[g][0] for g in lay.stage_ids_of_rank(r))
                regather = beside_seconds(regather, window, prof.eff.overlap_eff)
            opt = self.optimizer_s(r)
            offloaded = offload.rank_offload(self, r, opt + regather)
            opt += offloaded.exposed_s  # downloads, host clipping, the forward's waits
            tails.append(tail)
            ends.append((rp.finish_s[r] + tail + opt + regather, r, tail, opt, regather,
                         offloaded))
        step, r, tail, opt, regather, offloaded = max(ends)
        m = lay.micro_batches
        comm_in = sum(m * (times[g][3] + times[g][4]) + sum(self.stages_once[g])
                      for g in lay.stage_ids_of_rank(r))
        busy = rp.busy_s[r]
        compute = busy - comm_in
        bubble = max(0.0, rp.finish_s[r] - busy)  # with the waits on every p2p message
        exposed_s = comm_in + tail + regather
        breakdown = {"compute": compute, "exposed_comm": exposed_s, "bubble": bubble,
                     "optimizer": opt}
        mems = [self.memory(k, rp.peak_weight[k]) for k in range(lay.pp)]
        mem = max(mems, key=lambda x: x["total"])
        model_fl, hw_fl = self.flops_per_sequence
        per_gpu = lay.global_batch / lay.gpus / step
        peak = prof.peak_flops("bf16" if lay.precision == "fp8" else lay.precision)
        tokens = lay.global_batch * self.model.seq_len
        host = offload.offload_summary(self, offloaded)
        acts_host = activation_offload_summary(self, [
            peak_in_flight(lay.schedule, lay.pp, m, k, lay.vpp) if lay.pp > 1 else 1
            for k in range(lay.pp)])
        host_use = ((host["host_bytes_per_host"] if host else 0)
                    + (acts_host["host_bytes_per_host"] if acts_host else 0))
        fits = mem["total"] <= prof.memory_bytes and host_use <= prof.host.memory_bytes
        return Estimate(step, tokens / step, model_fl * per_gpu / 1e12, hw_fl * per_gpu / 1e12,
                        model_fl * per_gpu / peak, hw_fl * per_gpu / peak, mem,
                        fits, breakdown, lay.parallel_table(), lay,
                        list(self.stage_layers), rp if keep_events else None, tails, self, host,
                        acts_host)

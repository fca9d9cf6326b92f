"""`parallelize(model, plan, mesh)`: the one place parallelism is applied to a plain model.

The model (fivefold.models.llama's Transformer, or one pipeline stage of it cut by
fivefold.parallel.pipeline.build) knows nothing of ranks; everything the plan asks of the
model's own modules happens here, from outside and in this order (torchtitan's
`parallelize` habit):

  1. tensor parallelism over the mesh's "tp" axis (fivefold.parallel.tensor: Megatron 1D
     with sequence parallelism; a stage through fivefold.parallel.pipeline.tensor_stage),
  2. context parallelism over the "cp" axis (fivefold.parallel.context): every block's
     attention core becomes `context_attention` in `plan.cp_mode`, and the model's token
     positions are this rank's (its zigzag or contiguous part of every sequence,
     `rank_token_positions`, which the trainer's samplers take from the plan as well),
  3. expert parallelism over the experts' grid (`plan.ep > 1` or `plan.etp > 1`,
     fivefold.parallel.expert, fivefold.expert_grid): every MoE layer keeps its ep rank's
     experts, split over etp, and dispatches tokens by all-to-all,
  4. MoE layers on a rank's share of the tokens, where tensor, sequence or context
     parallelism splits a micro-batch (`plan.token_split_axes`, fivefold.parallel.moe_tokens):
     their balancing statistics are summed over those ranks (and, over tp, the router's and
     shared experts' gradients),
  5. fp8 linears (`plan.precision = "fp8"`, fivefold.parallel.fp8): every block's attention
     and MLP linear, plain or tensor-parallel, becomes an `Fp8Linear` of the plan's recipe,
     emulated in fp32 unless the device has fp8 units (or `plan.fp8_emulate` says); MoE
     layers' experts and shared experts in fp8 too, their routers not, with amaxes agreed
     over the ranks that split a micro-batch's tokens (fp8.experts),
  6. activation recomputation (`plan.recompute = "full"` or `"selective"`,
     fivefold.memory.recompute), or activation offload of the first
     `plan.offload_activations` blocks of each of this rank's model chunks
     (`offloaded_blocks`, fivefold.memory.activation_offload),
  7. torch.compile of each block (`compile_blocks`, the train.compile switch).

What wraps the model rather than rewriting it is the trainer's to build from the same plan:
the data-parallel engine (fivefold.parallel.data_parallel, `plan.update == "engine"`) and the
pipeline executor (`plan.pipeline_schedules`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fivefold.memory.activation_offload import apply_activation_offload
from fivefold.memory.recompute import apply_full_recompute, apply_selective_recompute
from fivefold.parallel.context.attention import context_attention
from fivefold.parallel.context.layout import context_positions
from fivefold.parallel.expert import apply_expert_parallel
from fivefold.parallel.fp8.experts import apply_fp8_to_experts
from fivefold.parallel.fp8.linear import apply_fp8, has_fp8_units
from fivefold.parallel.fp8.recipe import Fp8Recipe
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.moe_tokens import apply_moe_token_split
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.pipeline.tensor_stage import apply_tensor_parallel_to_stage
from fivefold.parallel.plan import ParallelPlan
from fivefold.parallel.tensor import apply_tensor_parallel


def rank_token_positions(plan: ParallelPlan, mesh: Mesh, seq_len: int) -> torch.Tensor | None:
    """The positions of the tokens this rank computes on under context parallelism (its
    part of every `seq_len`-token sequence, fivefold.parallel.context.layout); None without
    cp."""
    if plan.cp == 1:
        return None
    return context_positions(seq_len, plan.cp_mode, plan.cp,
                             mesh.axis("cp").rank, plan.cp_ulysses)


def offloaded_blocks(model: nn.Module, n: int) -> list[nn.Module]:
    """The first `n` blocks of each of `model`'s chunks (all of a chunk that has fewer): one
    chunk for the plain model and a stage without virtual stages, the rank's `vpp` chunks
    (its virtual stages, in `stage_ids` order) under an interleaved or V schedule.

    Why each chunk's first blocks and not the rank's first `n` (Narayanan et al. 2021,
    arXiv 2104.04473 Sec. 2.2): the interleaved 1F1B schedule runs the forwards of all of
    a rank's chunks before the first backward (its warm-up goes round the chunks in
    groups of pp micro-batches) and frees a micro-batch's chunks in reverse chunk order,
    so at the rank's peak every chunk holds micro-batches in flight; with pp 4, vpp 4 and
    16 micro-batches rank 0's peak holds 7 of chunk 0 and 4 of each other chunk (19 in
    all). Taking `n` blocks off every chunk lowers that peak by n blocks x 19 micro-batches,
    the rank's first `n` (all in chunk 0) by n x 7. It also keeps one statement for every
    schedule: `n` counts the blocks of a virtual stage, which is a pipeline stage without
    vpp, and each chunk's first blocks are those whose backward runs last in the chunk's
    backward, as for a stage. The planner prices the same blocks
    (fivefold.planner.activation_offload)."""
    if isinstance(model, PipelineStage):
        chunks = [[model.layers[str(i)] for i in model.layer_ranges[s]]
                  for s in model.stage_ids]
    else:
        chunks = [list(model.layers)]
    return [block for chunk in chunks for block in chunk[:n]]


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: Mesh,
                compile_blocks: bool = False) -> nn.Module:
    """Apply `plan` to `model` (in place) on this rank of `mesh`; returns the model."""
    tp_axis = mesh.axis("tp")
    if tp_axis.size > 1:
        split = (apply_tensor_parallel_to_stage if isinstance(model, PipelineStage)
                 else apply_tensor_parallel)
        split(model, tp_axis, plan.sequence_parallel)
    cp_axis = mesh.axis("cp")
    if cp_axis.size > 1:
        if plan.cp_mode == "hybrid":
            ring_axis, ulysses_axis = mesh.split_axis("cp", plan.cp_ulysses,
                                                      ("cp_ring", "cp_ulysses"))
            attend = functools.partial(context_attention, mode="hybrid",
                                       ulysses_axis=ulysses_axis, ring_axis=ring_axis)
        else:
            attend = functools.partial(context_attention, mode=plan.cp_mode, cp_axis=cp_axis)
        for block in model.layers:
            block.attention.attend = attend
        positions = rank_token_positions(plan, mesh, model.cfg.seq_len)
        model.token_positions = positions.to(model.rope_cos.device)
    if plan.ep > 1 or plan.etp > 1:
        apply_expert_parallel(model, mesh.expert_axes(plan.ep, plan.etp))
    token_group = (mesh.joint_axis(*plan.token_split_axes)
                   if model.cfg.moe is not None and plan.token_split_axes else None)
    if token_group is not None:
        apply_moe_token_split(model, token_group, tp_axis if tp_axis.size > 1 else None,
                              plan.sequence_parallel)
    if plan.precision == "fp8":
        emulate = (plan.fp8_emulate if plan.fp8_emulate is not None
                   else not has_fp8_units(mesh.device_type))
        recipe = Fp8Recipe(plan.fp8_recipe, plan.fp8_tensors, emulate)
        apply_fp8(model, recipe, tp_axis, cp_axis)
        apply_fp8_to_experts(model, recipe, token_group, plan.ep > 1 or plan.etp > 1)
    if plan.recompute == "full":
        apply_full_recompute(model.layers)
    elif plan.recompute == "selective":
        apply_selective_recompute(model.layers)
    if plan.offload_activations:  # validation refuses it with recompute
        apply_activation_offload(model, offloaded_blocks(model, plan.offload_activations))
    if compile_blocks:
        for block in model.layers:
            block.compile()
    return model

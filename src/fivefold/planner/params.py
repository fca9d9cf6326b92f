"""Parameter counts per data-parallel unit on one rank, from the model description.

The runtime groups parameters into flat units (fivefold.parallel.data_parallel.split_units):
a root unit with everything outside the blocks (token embeddings, final norm, the output head
when it is not tied) and one unit per block. These functions take the parameters
fivefold.models.description lists and cut each as one rank holds it: tensor parallelism splits
the dim the description names (the vocabulary rows padded to a multiple of tp, as
fivefold.parallel.tensor.padded_vocab does; attention into whole heads, one kv head per rank
when tp exceeds kv_heads, as Megatron-LM replicates them; other widths evenly) and expert
parallelism splits the routed experts' first dim (and expert tensor parallelism their
width, fivefold.expert_grid), so that the planner's memory and
communication predictions can be exact (tests/test_planner_ledger.py holds them against the
runtime's ledger). A search asks for the same counts hundreds of thousands of times, so each
count is computed once per model, degree and layer (`per_model`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from fivefold.config import ModelConfig
from fivefold.models.description import (MOE_PARTS, VOCAB_PARTS, Param, block_parameters,
                                         root_parameters)


def per_model(count: Callable) -> Callable:
    """`count(model, *args)`, cached by the model's field values (a ModelConfig is mutable and
    so not hashable itself)."""
    cache: dict[tuple, object] = {}

    @functools.wraps(count)
    def cached(model: ModelConfig, *args):
        moe = model.moe
        key = (*vars(model).values(), *args) if moe is None else (
            *(v for v in vars(model).values() if v is not moe), *vars(moe).values(), *args)
        if key not in cache:
            cache[key] = count(model, *args)
        return cache[key]
    return cached


def local_shape(model: ModelConfig, p: Param, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """The shape of parameter `p` on one rank of tp x ep."""
    shape = list(p.shape)
    if p.part == "experts":
        shape[0] //= ep
    d = p.tp_dim
    if d is not None:
        if p.part in VOCAB_PARTS:
            shape[d] = -(-shape[d] // tp)
        elif p.part == "attention":
            shape[d] = max(1, shape[d] // model.d_head // tp) * model.d_head
        else:
            shape[d] //= tp
    return tuple(shape)


def local_numel(model: ModelConfig, p: Param, tp: int = 1, ep: int = 1) -> int:
    n = 1
    for size in local_shape(model, p, tp, ep):
        n *= size
    return n


def block_matrix_shapes(model: ModelConfig, layer: int, tp: int = 1) -> list[tuple[int, int]]:
    """(rows, columns) of block `layer`'s 2-D weight matrices on one tensor-parallel rank:
    attention, then the dense MLP, or the router and shared experts of an MoE layer (routed
    experts are one 3-D tensor per projection)."""
    return [local_shape(model, p, tp) for p in block_parameters(model, layer)
            if len(p.shape) == 2]


@per_model
def block_vector_params(model: ModelConfig, tp: int = 1) -> int:
    """The vectors of one block (two norm gains, the query/key/value biases): with Muon they
    stay with AdamW, as everything outside the blocks' matrices (fivefold.optim)."""
    return sum(local_numel(model, p, tp) for p in block_parameters(model, 0)
               if len(p.shape) == 1)


@per_model
def block_params(model: ModelConfig, layer: int, tp: int = 1, ep: int = 1,
                 etp: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters of block `layer` on one rank: the routed experts apart,
    since expert parallelism shards them over other ranks than the rest of the block.
    `etp`: the experts' own grid, as fivefold's runtime holds an MoE layer
    (fivefold.expert_grid): the routed experts' width split over etp (not tp), the router
    and shared experts whole on every tp rank; None: the MoE layer split over tp like a
    dense MLP (an external stack's, fivefold.planner.stack `experts_follow_tp`)."""
    return _dense_expert(model, layer, tp, ep, etp, lambda p: True)


@per_model
def block_linear_params(model: ModelConfig, layer: int, tp: int = 1, ep: int = 1,
                        etp: int | None = None) -> tuple[int, int]:
    """(dense, expert) elements of block `layer`'s linear layers' weights on one rank, split
    as `block_params` splits them: every weight of two or more dims but the router's (norm
    gains and biases are vectors; the router is no fp8 linear: fivefold.planner.memory)."""
    return _dense_expert(model, layer, tp, ep, etp,
                         lambda p: len(p.shape) >= 2 and p.part != "router")


def _dense_expert(model: ModelConfig, layer: int, tp: int, ep: int, etp: int | None,
                  counted) -> tuple[int, int]:
    """(dense, expert) elements on one rank of block `layer`'s parameters that `counted`
    accepts (block_params' splits)."""
    dense = expert = 0
    for p in block_parameters(model, layer):
        if not counted(p):
            continue
        split = tp if etp is None or p.part not in MOE_PARTS else (
            etp if p.part == "experts" else 1)
        n = local_numel(model, p, split, ep)
        if p.part == "experts":
            expert += n
        else:
            dense += n
    return dense, expert


@per_model
def root_params(model: ModelConfig, tp: int = 1, first: bool = True, last: bool = True) -> int:
    """Embeddings (first pipeline stage), final norm and untied head (last stage). With tied
    embeddings the first stage owns the table; a last stage that is not also the first
    computes the head with a borrowed copy, a buffer (`borrowed_head_params`), which no
    optimizer steps and no data-parallel collective syncs."""
    return sum(local_numel(model, p, tp) for p in root_parameters(model)
               if (first if p.part == "embedding" else last))


@per_model
def borrowed_head_params(model: ModelConfig, tp: int = 1, first: bool = True,
                         last: bool = True) -> int:
    """Elements of the tied table a last pipeline stage that is not also the first holds as
    its head (fivefold.parallel.pipeline.stage's `tied_head_weight`, this tp rank's rows):
    lent by the first stage at the step's start, its gradient returned; 0 otherwise."""
    if not (model.tied_embeddings and last and not first):
        return 0
    return sum(local_numel(model, p, tp) for p in root_parameters(model)
               if p.part == "embedding")


def total_params(model: ModelConfig) -> int:
    """Every parameter of the model on one device (embeddings once when tied)."""
    blocks = sum(sum(block_params(model, i)) for i in range(model.layers))
    return blocks + root_params(model)

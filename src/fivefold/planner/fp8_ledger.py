"""The fp8 linears' amax exchanges of one micro-batch, predicted from the configuration.

fivefold.parallel.fp8.scaling agrees each dynamic scale over the ranks that hold other parts
of its tensor: the tp ranks where the amax reduces over a dim tensor parallelism splits, the
cp ranks where it reduces over the tokens context parallelism splits. Each exchange is an
fp32 all-gather (purpose "fp8_amax") of every rank's partial amaxes: one number tensorwise,
one per row or column rowwise. An MoE block's dense linears are its attention's only; where
tp, sp or cp splits a micro-batch for its MoE layer (fivefold.parallel.fp8.experts) the
routed experts' (without expert parallelism) and shared experts' row-reducing amaxes are
agreed over those ranks too. fivefold.planner.ledger_model adds these records to a step's
ledger, per micro-batch.
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.models.description import expert_ffn, is_moe_layer
from fivefold.parallel.plan import ParallelPlan

Record = tuple[str, str, int, str, int, str]  # (op, mesh dim, size, dtype, bytes, purpose)


def fp8_amax_records(cfg: Config, lay: ParallelPlan, layers: list[int]) -> list[Record]:
    """One micro-batch's amax all-gathers over tp, cp and an MoE layer's token group for
    the blocks `layers`."""
    moe = [i for i in layers if is_moe_layer(cfg.model, i)]
    dense, records = len(layers) - len(moe), []
    if lay.tp > 1:
        records += _over("tp", lay.tp, dense, _tp_amaxes(cfg, lay, False))
        records += _over("tp", lay.tp, len(moe), _tp_amaxes(cfg, lay, True))
    if lay.cp > 1:
        records += _over("cp", lay.cp, dense, _cp_amaxes(cfg, lay, False))
        records += _over("cp", lay.cp, len(moe), _cp_amaxes(cfg, lay, True))
    split = lay.cp * lay.tp  # the ranks of lay.token_split_axes
    if moe and split > 1:
        records += _over("+".join(lay.token_split_axes), split, len(moe),
                         _moe_amaxes(cfg, lay))
    return records


def _over(dim: str, size: int, blocks: int, per_block: list[int]) -> list[Record]:
    return [("all_gather", dim, size, "float32", size * numel * 4, "fp8_amax")
            for _ in range(blocks) for numel in per_block]


def _passes(lay: ParallelPlan) -> int:
    """How often a block's forward runs: twice under recomputation, selective too (its
    cache keeps matmul outputs, but the fp8 linear's amax exchange runs again)."""
    return 2 if lay.recompute != "none" else 1


def _tp_amaxes(cfg: Config, lay: ParallelPlan, attention_only: bool) -> list[int]:
    """Per block (an MoE block: its attention's linears only), the amaxes (elements each)
    agreed over tp: forward, the amax of every operand whose reduction spans the split dim: tensorwise the 7 weights and the inputs of
    wo and w2; rowwise the inputs and weights of wo and w2 (their contracted dim is split);
    backward, the output gradients of the 5 column-parallel linears, and rowwise also their
    weights (contracted along the split output dim). Recomputation repeats the forward
    ones."""
    D = cfg.model.hidden
    tokens = lay.micro_batch * cfg.model.seq_len // lay.cp
    column = 3 + (0 if attention_only else 2 if cfg.model.ffn_type == "swiglu" else 1)
    row = 1 if attention_only else 2  # wo (w2)
    if lay.fp8_recipe == "tensorwise":
        forward = [1] * ((column + row) * ("weight" in lay.fp8_tensors)
                         + row * ("input" in lay.fp8_tensors))
        backward = [1] * (column * ("grad_output" in lay.fp8_tensors))
    else:
        forward = ([tokens] * row * ("input" in lay.fp8_tensors)
                   + [D] * row * ("weight" in lay.fp8_tensors))
        backward = ([tokens] * column * ("grad_output" in lay.fp8_tensors)
                    + [D] * column * ("weight" in lay.fp8_tensors))
    return forward * _passes(lay) + backward


def _cp_amaxes(cfg: Config, lay: ParallelPlan, attention_only: bool) -> list[int]:
    """Per block, the amaxes (elements each) agreed over cp, those reducing over the tokens:
    tensorwise each linear's input forward (again under recomputation) and its output
    gradient backward; rowwise, for each weight gradient, the output gradient's and the
    input's amax per column (this tp rank's output and input features)."""
    m, t = cfg.model, lay.tp
    q, kv, ffn = m.heads * m.d_head // t, m.n_kv_heads * m.d_head // t, m.ffn_hidden // t
    shapes = [(q, m.hidden), (kv, m.hidden), (kv, m.hidden), (m.hidden, q)]  # wq wk wv wo
    if not attention_only:
        shapes += [*([(ffn, m.hidden)] * (2 if m.ffn_type == "swiglu" else 1)),  # w1 (w3)
                   (m.hidden, ffn)]  # w2; (out, in) features of each
    return _token_amaxes(lay, shapes)


def _moe_amaxes(cfg: Config, lay: ParallelPlan) -> list[int]:
    """Per MoE layer, the amaxes agreed over its token group: each routed expert's three
    GEMMs (unless expert parallelism moves the rows) and the shared experts' three linears,
    those reducing over the rows (fivefold.parallel.fp8.experts)."""
    m, ffn = cfg.model, expert_ffn(cfg.model)
    swiglu = [(ffn, m.hidden), (ffn, m.hidden), (m.hidden, ffn)]  # w1 w3 w2 (out, in)
    shapes = [] if lay.ep > 1 or lay.etp > 1 else swiglu * m.moe.experts
    shared = m.moe.shared_experts * ffn
    if shared:
        shapes += [(shared, m.hidden), (shared, m.hidden), (m.hidden, shared)]
    return _token_amaxes(lay, shapes)


def _token_amaxes(lay: ParallelPlan, shapes: list[tuple[int, int]]) -> list[int]:
    """The row-reducing amaxes of linears of (out, in) `shapes`: tensorwise each input
    forward (again under recomputation) and output gradient backward; rowwise, for each
    weight gradient, the output gradient's and the input's amax per column."""
    x, dy = "input" in lay.fp8_tensors, "grad_output" in lay.fp8_tensors
    if lay.fp8_recipe == "tensorwise":
        return [1] * (len(shapes) * x * _passes(lay) + len(shapes) * dy)
    return [n for out, inp in shapes for n in [out] * dy + [inp] * x]

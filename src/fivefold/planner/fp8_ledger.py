"""The fp8 linears' amax exchanges of one micro-batch, predicted from the configuration.

fivefold.parallel.fp8.scaling agrees each dynamic scale over the ranks that hold other parts
of its tensor: the tp ranks where the amax reduces over a dim tensor parallelism splits, the
cp ranks where it reduces over the tokens context parallelism splits. Each exchange is an
fp32 all-gather (purpose "fp8_amax") of every rank's partial amaxes: one number tensorwise,
one per row or column rowwise. fivefold.planner.ledger_model adds these records to a step's
ledger, per micro-batch.
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.parallel.plan import ParallelPlan

Record = tuple[str, str, int, str, int, str]  # (op, mesh dim, size, dtype, bytes, purpose)


def fp8_amax_records(cfg: Config, lay: ParallelPlan, blocks: int) -> list[Record]:
    """One micro-batch's amax all-gathers over tp and over cp for `blocks` dense blocks."""
    records = []
    if lay.tp > 1:
        records += _over("tp", lay.tp, blocks, _tp_amaxes(cfg, lay))
    if lay.cp > 1:
        records += _over("cp", lay.cp, blocks, _cp_amaxes(cfg, lay))
    return records


def _over(dim: str, size: int, blocks: int, per_block: list[int]) -> list[Record]:
    return [("all_gather", dim, size, "float32", size * numel * 4, "fp8_amax")
            for _ in range(blocks) for numel in per_block]


def _passes(lay: ParallelPlan) -> int:
    """How often a block's forward runs: twice under recomputation, selective too (its
    cache keeps matmul outputs, but the fp8 linear's amax exchange runs again)."""
    return 2 if lay.recompute != "none" else 1


def _tp_amaxes(cfg: Config, lay: ParallelPlan) -> list[int]:
    """Per block, the amaxes (elements each) agreed over tp: forward, the amax of every
    operand whose reduction spans the split dim: tensorwise the 7 weights and the inputs of
    wo and w2; rowwise the inputs and weights of wo and w2 (their contracted dim is split);
    backward, the output gradients of the 5 column-parallel linears, and rowwise also their
    weights (contracted along the split output dim). Recomputation repeats the forward
    ones."""
    D = cfg.model.hidden
    tokens = lay.micro_batch * cfg.model.seq_len // lay.cp
    column = 3 + (2 if cfg.model.ffn_type == "swiglu" else 1)  # wq, wk, wv, w1 (w3)
    if lay.fp8_recipe == "tensorwise":
        forward = [1] * ((column + 2) * ("weight" in lay.fp8_tensors)
                         + 2 * ("input" in lay.fp8_tensors))
        backward = [1] * (column * ("grad_output" in lay.fp8_tensors))
    else:
        forward = ([tokens] * 2 * ("input" in lay.fp8_tensors)
                   + [D] * 2 * ("weight" in lay.fp8_tensors))
        backward = ([tokens] * column * ("grad_output" in lay.fp8_tensors)
                    + [D] * column * ("weight" in lay.fp8_tensors))
    return forward * _passes(lay) + backward


def _cp_amaxes(cfg: Config, lay: ParallelPlan) -> list[int]:
    """Per block, the amaxes (elements each) agreed over cp, those reducing over the tokens:
    tensorwise each linear's input forward (again under recomputation) and its output
    gradient backward; rowwise, for each weight gradient, the output gradient's and the
    input's amax per column (this tp rank's output and input features)."""
    m, t = cfg.model, lay.tp
    q, kv, ffn = m.heads * m.d_head // t, m.n_kv_heads * m.d_head // t, m.ffn_hidden // t
    shapes = [(q, m.hidden), (kv, m.hidden), (kv, m.hidden), (m.hidden, q),  # wq wk wv wo
              *([(ffn, m.hidden)] * (2 if m.ffn_type == "swiglu" else 1)),  # w1 (w3)
              (m.hidden, ffn)]  # w2; (out, in) features of each
    x, dy = "input" in lay.fp8_tensors, "grad_output" in lay.fp8_tensors
    if lay.fp8_recipe == "tensorwise":
        return [1] * (len(shapes) * x * _passes(lay) + len(shapes) * dy)
    return [n for out, inp in shapes for n in [out] * dy + [inp] * x]

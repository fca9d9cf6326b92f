"""What autograd saves beyond fivefold.planner.activations' count where the model keeps fp32
weights under a half-precision autocast: every update path but the data-parallel engine
(`ParallelPlan.update` "plain", "lomo", "galore-dp", "pipedream-2bw"), whose
`Trainer.autocast` runs an fp32 model under torch.autocast at bf16 or fp16. The engine
instead holds compute-dtype copies as the module's parameters, which is what
activations.block_saved_bytes counts. Per token, with a = 2 (the autocast dtype) and D, Hd,
kv, F, H as there:

  RMSNorm (x2)     `x.type_as(x_BTD) * weight` runs in fp32 (x_BTD and weight are fp32), so
                   the normalized value it saves is 4D, not aD: +(4 - a)D each
  linear inputs    autocast casts the fp32 norm output to a for each linear that reads it
                   (its cast cache keeps leaf tensors only): wq, wk and wv save three
                   copies, SwiGLU's w1 and w3 two, instead of one: +2aD, +aD (GELU: +0)
  MoE layer        the gated copies `(y * gate).to(x.dtype)` stay fp32 (+k(4 - a)D); a
                   shared expert's w1 and w3 each cast the MLP input (+aD); the router's
                   `weight.float()` is the fp32 parameter itself, so the engine's fp32
                   router-weight copy (activations.moe_saved_constant) is not saved here
  recomputation    `full` and `selective` keep the block input, the fp32 residual: +(4 - a)D

and per micro-batch, once per linear weight (autocast's weight cache lives for the
micro-batch's forward, and each linear saves its cast for the input gradient): a x the
block's attention and MLP weights (every expert's w1, w3, w2 and the shared experts'), not
under recomputation (the checkpointed forward saves nothing of its own; backward casts
again). Biases are cast too but not saved (a bias gradient needs only the output gradient).
The root adds the final norm's +(4 - a)D per token and the head's weight cast, a x V x D.

Measured (tests/test_planner_autocast.py, to the byte): bf16 and fp16 on the plain one-rank
path, SwiGLU, GELU, GQA with qkv biases and an untied head, MoE with a shared expert and
both auxiliary losses, full and selective recomputation. Not counted: fp8 on a GPU's plain
path (its linears turn autocast off and save the fp32 input: not measured, the CPU runs fp8
in fp32 with no autocast), tp > 1 (only PipeDream-2BW runs it on fp32 weights, whose
forwards run in the schedule, unmeasured), and the chunked loss one GPU rank runs
(fivefold.train.loss), which this root does not model either.
"""

from __future__ import annotations

from fivefold.config import ModelConfig
from fivefold.models.description import is_moe_layer
from fivefold.parallel.plan import ParallelPlan


def fp32_weights_under_autocast(plan: ParallelPlan, act_bytes: int) -> bool:
    """Whether the runtime trains `plan` on fp32 weights under a bf16 or fp16 autocast: an
    update path other than the engine at a half compute dtype, tp 1 (module docstring)."""
    return (plan.update != "engine" and act_bytes < 4 and plan.precision in ("bf16", "fp16")
            and plan.tp == 1)


def autocast_block_bytes(model: ModelConfig, tokens: int, a: int, recompute: str = "none",
                         layer: int = 0) -> float:
    """Bytes block `layer` saves under autocast on fp32 weights beyond what
    activations.block_saved_bytes counts for the compute-dtype model (module docstring)."""
    D = model.hidden
    if recompute != "none":
        return tokens * (4 - a) * D
    per_token = 2 * (4 - a) * D + 2 * a * D  # the norms' fp32 output; wk's and wv's casts
    weights = attention_weight_elements(model)
    if is_moe_layer(model, layer):
        m = model.moe
        F = m.expert_ffn_hidden or model.ffn_hidden
        per_token += m.top_k * (4 - a) * D + (a * D if m.shared_experts else 0)
        weights += 3 * D * F * m.experts + 3 * D * F * m.shared_experts
        router_copy = 4 * m.experts * D  # counted by block_saved_bytes, a parameter here
        return tokens * per_token + a * weights - router_copy
    swiglu = model.ffn_type == "swiglu"
    per_token += a * D if swiglu else 0  # w3's cast of the MLP input
    weights += (3 if swiglu else 2) * D * model.ffn_hidden
    return tokens * per_token + a * weights


def autocast_root_bytes(model: ModelConfig, tokens: int, a: int, last: bool = True) -> float:
    """The root's bytes under autocast on fp32 weights beyond activations.root_saved_bytes:
    the final norm's fp32 output and the head's weight cast (module docstring)."""
    return tokens * (4 - a) * model.hidden + a * model.vocab * model.hidden if last else 0.0


def attention_weight_elements(model: ModelConfig) -> int:
    """Elements of one block's wq, wk, wv and wo."""
    hd, kv = model.heads * model.d_head, model.n_kv_heads * model.d_head
    return 2 * model.hidden * hd + 2 * model.hidden * kv

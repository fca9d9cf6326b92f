"""The `[model]` section of a config and its `[model.moe]` table: the transformer's shape
(usually a named preset, fivefold.models.presets, with single keys overridden) and the
mixture-of-experts layers'. fivefold.config assembles the sections, and
fivefold.models.validate_model checks these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config_fields import doc_field as _doc


@dataclass
class MoEConfig:
    experts: int = _doc("routed experts per MoE layer", 8)
    top_k: int = _doc("experts per token", 2)
    expert_ffn_hidden: int = _doc("inner width of one expert", 0)
    shared_experts: int = _doc("always-active experts", 0)
    dense_layers: int = _doc("leading dense layers before the first MoE layer", 0)
    layer_freq: int = _doc("every k-th layer is MoE", 1)
    capacity_factor: float | None = _doc("expert capacity factor: each expert takes at most "
                                         "ceil(factor x tokens x top_k / experts) of one "
                                         "micro-batch's assignments, the rest are dropped "
                                         "(GShard); absent = dropless", None)
    score: str = _doc('router scores: "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3); the top-k '
                      "scores are renormalized to sum to one", "softmax")
    aux_loss_weight: float = _doc("load-balancing loss weight (Switch / GShard; 0.01 there); "
                                  "0 disables", 0.0)
    z_loss_weight: float = _doc("router z-loss weight (ST-MoE; 0.001 there); 0 disables", 0.0)
    bias_update_rate: float = _doc("auxiliary-loss-free balancing (DeepSeek-V3 Sec. 2.1.2): "
                                   "after each step every expert's routing bias moves by this "
                                   "towards the mean load (0.001 there); 0 disables", 0.0)
    rank_imbalance: float = _doc("planner only: the busiest expert-parallel rank's routed "
                                 "assignments over the ranks' mean, at which the simulator "
                                 "times every rank's expert GEMMs and all-to-alls (1: balanced, "
                                 "as forced balance or a padded capacity runs; capped at "
                                 "parallel.ep); memory is counted at the mean", 1.0)
    expert_matmul: str = _doc('dropless experts\' matrix multiplies: "grouped" '
                              "(torch._grouped_mm where the device runs it, else a padded "
                              'batched matmul) | "loop" (one expert after another)', "grouped")


@dataclass
class ModelConfig:
    preset: str = _doc("named size (see fivefold.models.presets); other keys override it", "tiny")
    layers: int = _doc("transformer blocks", 0)
    hidden: int = _doc("model width", 0)
    heads: int = _doc("attention heads", 0)
    kv_heads: int | None = _doc("key/value heads (grouped-query attention); default = heads", None)
    head_dim: int | None = _doc("per-head width; default hidden / heads", None)
    ffn_hidden: int = _doc("MLP inner width", 0)
    ffn_type: str = _doc('"swiglu" (3 matrices, Llama) or "gelu" (2 matrices, GPT)', "swiglu")
    vocab: int = _doc("vocabulary size (the built-in tokenizer is trained to this size)", 0)
    seq_len: int = _doc("training sequence length", 0)
    tied_embeddings: bool = _doc("share the input embedding with the output head", False)
    rope_theta: float = _doc("rotary embedding base", 10000.0)
    norm_eps: float = _doc("RMSNorm epsilon", 1e-5)
    qkv_bias: bool = _doc("learned biases on the query/key/value projections (Qwen2)", False)
    moe: MoEConfig | None = _doc("mixture-of-experts table; absent for dense models", None)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

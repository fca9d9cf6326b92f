"""Every parameter of the plain model, as data: name, full shape, part, tensor-parallel split.

The one description of what fivefold.models.llama and fivefold.models.moe build, free of torch,
so that everything that needs the parameters without building them reads it instead of
re-deriving them: tensor parallelism's placements (fivefold.parallel.tensor), the planner's
per-rank counts (fivefold.planner.params), parameter and FLOP counts (fivefold.models.flops)
and the Hugging Face name maps (fivefold.models.hf). tests/test_model_description.py holds it
against a real `Transformer`'s named_parameters.

`parameters(cfg)` lists them in `Transformer.named_parameters()` order: the token embedding,
each block, the final norm and, when it is not tied to the embedding, the output head. Each
`Param` names its part of the model:

  embedding, head   the (V, D) vocabulary matrices; vocabulary-parallel (rows split, dim 0)
  norm              RMSNorm gains, in the root and twice per block; replicated
  attention         wq, wk, wv (and their biases with `model.qkv_bias`) column-parallel
                    (output features, dim 0), wo row-parallel (input features, dim 1)
  mlp               the dense MLP: w1 (and w3 for SwiGLU) column-parallel, w2 row-parallel
  router            an MoE layer's (experts, D) router; replicated
  experts           an MoE layer's routed SwiGLU experts, stacked along dim 0 (the dim
                    expert parallelism splits): w1, w3 (X, F, D) split on F (dim 1), w2
                    (X, D, F) on F (dim 2)
  shared_experts    an MoE layer's always-active experts (`moe.shared_experts`), one SwiGLU
                    MLP of width shared_experts * F, split as the dense MLP; the planner
                    models them, fivefold.models.moe does not build them yet

The split dims are the plain model's: the runtime's tensor parallelism splits dense models only
and so looks placements up by name (`placement`), which is unambiguous there.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import ModelConfig


@dataclass(frozen=True)
class Placement:
    """Where a parameter sits and how tensor parallelism splits it."""

    part: str  # embedding | norm | head | attention | mlp | router | experts | shared_experts
    tp_dim: int | None  # the dim split over the tp ranks; None: replicated


VOCAB_PARTS = ("embedding", "head")
MOE_PARTS = ("router", "experts", "shared_experts")

# The root's parameters and a dense block's, by their name in the root or the block.
DENSE_PLACEMENTS = {
    "tok_embeddings.weight": Placement("embedding", 0),
    "norm.weight": Placement("norm", None),
    "output.weight": Placement("head", 0),
    "attention_norm.weight": Placement("norm", None),
    **{f"attention.{proj}.{kind}": Placement("attention", 0)
       for proj in ("wq", "wk", "wv") for kind in ("weight", "bias")},
    "attention.wo.weight": Placement("attention", 1),
    "mlp_norm.weight": Placement("norm", None),
    "mlp.w1.weight": Placement("mlp", 0),
    "mlp.w3.weight": Placement("mlp", 0),
    "mlp.w2.weight": Placement("mlp", 1),
}

# An MoE layer's MLP, which replaces the dense one (its other parameters are a dense block's).
MOE_PLACEMENTS = {
    "mlp.w1": Placement("experts", 1),
    "mlp.w3": Placement("experts", 1),
    "mlp.w2": Placement("experts", 2),
    "mlp.router.weight": Placement("router", None),
    "mlp.shared.w1.weight": Placement("shared_experts", 0),
    "mlp.shared.w3.weight": Placement("shared_experts", 0),
    "mlp.shared.w2.weight": Placement("shared_experts", 1),
}


@dataclass(frozen=True)
class Param:
    """One parameter of the plain (unsharded) model."""

    name: str  # as in Transformer.named_parameters()
    shape: tuple[int, ...]  # the full shape
    layer: int | None  # the block holding it; None: the root (embedding, final norm, head)
    placement: Placement

    @property
    def part(self) -> str:
        return self.placement.part

    @property
    def tp_dim(self) -> int | None:
        return self.placement.tp_dim

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Layers from `moe.dense_layers` on, every `moe.layer_freq`-th one, are MoE layers."""
    moe = cfg.moe
    return (moe is not None and layer >= moe.dense_layers
            and (layer - moe.dense_layers) % moe.layer_freq == 0)


def name_in_part(name: str) -> str:
    """A parameter's name inside its block ("layers.3.mlp.w1.weight" -> "mlp.w1.weight");
    a root parameter's name is its own."""
    if name.startswith("layers."):
        return name.split(".", 2)[2]
    return name


def placement(name: str) -> Placement:
    """The placement of a dense model's parameter, by its full name."""
    return DENSE_PLACEMENTS[name_in_part(name)]


def expert_ffn(cfg: ModelConfig) -> int:
    """The inner width of one expert (`moe.expert_ffn_hidden`, default the dense width)."""
    return cfg.moe.expert_ffn_hidden or cfg.ffn_hidden


def root_parameters(cfg: ModelConfig) -> list[Param]:
    """The token embedding, the final norm and the untied output head."""
    V, D = cfg.vocab, cfg.hidden
    shapes = {"tok_embeddings.weight": (V, D), "norm.weight": (D,)}
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (V, D)
    return [Param(name, shape, None, DENSE_PLACEMENTS[name]) for name, shape in shapes.items()]


def block_parameters(cfg: ModelConfig, layer: int) -> list[Param]:
    """Block `layer`'s parameters, in the order the block registers them."""
    D, E = cfg.hidden, cfg.d_head
    q, kv = cfg.heads * E, cfg.n_kv_heads * E
    shapes: dict[str, tuple[int, ...]] = {"attention_norm.weight": (D,)}
    for proj, width in (("wq", q), ("wk", kv), ("wv", kv)):
        shapes[f"attention.{proj}.weight"] = (width, D)
        if cfg.qkv_bias:
            shapes[f"attention.{proj}.bias"] = (width,)
    shapes["attention.wo.weight"] = (D, q)
    shapes["mlp_norm.weight"] = (D,)
    moe = is_moe_layer(cfg, layer)
    if moe:
        X, F = cfg.moe.experts, expert_ffn(cfg)
        shapes.update({"mlp.w1": (X, F, D), "mlp.w3": (X, F, D), "mlp.w2": (X, D, F),
                       "mlp.router.weight": (X, D)})  # a module's own parameters come first
        if cfg.moe.shared_experts:
            S = cfg.moe.shared_experts * F
            shapes.update({"mlp.shared.w1.weight": (S, D), "mlp.shared.w3.weight": (S, D),
                           "mlp.shared.w2.weight": (D, S)})
    else:
        F = cfg.ffn_hidden
        shapes["mlp.w1.weight"] = (F, D)
        if cfg.ffn_type == "swiglu":
            shapes["mlp.w3.weight"] = (F, D)
        shapes["mlp.w2.weight"] = (D, F)
    return [Param(f"layers.{layer}.{name}", shape, layer,
                  (MOE_PLACEMENTS.get(name) if moe else None) or DENSE_PLACEMENTS[name])
            for name, shape in shapes.items()]


def parameters(cfg: ModelConfig) -> list[Param]:
    """Every parameter of the model, in Transformer.named_parameters() order."""
    embedding, *rest = root_parameters(cfg)
    blocks = [p for layer in range(cfg.layers) for p in block_parameters(cfg, layer)]
    return [embedding, *blocks, *rest]

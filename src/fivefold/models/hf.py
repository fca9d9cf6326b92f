"""Hugging Face checkpoints <-> fivefold models, for the Llama, Mistral, Qwen2 and Mixtral families.

A Hugging Face model folder holds `config.json` and the weights as safetensors: one
`model.safetensors`, or shards listed by `model.safetensors.index.json`. This file maps the
config to a `ModelConfig` and back, and renames the tensors one to one:

    model.embed_tokens.weight                       tok_embeddings.weight
    model.layers.i.input_layernorm.weight           layers.i.attention_norm.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.weight  layers.i.attention.w{q,k,v,o}.weight
    model.layers.i.self_attn.{q,k,v}_proj.bias      layers.i.attention.w{q,k,v}.bias  (Qwen2)
    model.layers.i.post_attention_layernorm.weight  layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight   layers.i.mlp.w{1,3,2}.weight
    model.layers.i.block_sparse_moe.gate.weight     layers.i.mlp.router.weight        (Mixtral)
    model.layers.i.block_sparse_moe.experts.e.wJ.weight   row e of layers.i.mlp.wJ    (Mixtral)
    model.norm.weight                               norm.weight
    lm_head.weight                                  output.weight (absent when tied)

No tensor is permuted: Hugging Face's Llama rotates the halves (x[:E/2], x[E/2:]) of each
head (`rotate_half`), as `fivefold.models.llama.apply_rotary` does, so the query and key
weights keep their row order. Mixtral's per-expert matrices are stacked along a new first
dimension on import and cut apart on export; both are exact copies, so a round trip
returns every tensor bit for bit, in its stored dtype.

Config keys: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, rms_norm_eps, rope_theta (or rope_parameters.rope_theta),
vocab_size, tie_word_embeddings, and max_position_embeddings, which becomes model.seq_len.
A sliding attention window W caps seq_len at W: within W tokens sliding-window attention
is full causal attention, so the model is exact up to that length. Anything fivefold does not
compute (rotary scaling, biases other than Qwen2's q/k/v, an activation other than SiLU,
dropout, router jitter) is refused with a message naming the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fivefold.config import ConfigError, ModelConfig, MoEConfig
from fivefold.models.description import name_in_part, parameters
from fivefold.models.validate_model import check_model

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_BYTES = 5 * 2**30  # Hugging Face's default largest shard

# Hugging Face -> fivefold names of the root's tensors, and of a block's after "model.layers.i."
# / "layers.i."; which of them a model has is its description's (fivefold.models.description)
ROOT_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight",
              "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "block_sparse_moe.gate.weight": "mlp.router.weight",
}
EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # a buffer that old checkpoints carry


class CheckpointError(ConfigError):
    """A model folder or checkpoint that cannot be read as asked; `key` names the file/key."""

    def __init__(self, where: str, message: str):
        ValueError.__init__(self, f"checkpoint error in {where}: {message}")
        self.key = where


# ------------------------------------------------------------------ config

def _rope_theta(hf: dict, where: str) -> float:
    """The rotary base; any rotary scaling is refused (fivefold computes plain RoPE)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for key, table in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind != "default":
            raise CheckpointError(where, f"`{key}` asks for {kind!r} rotary scaling, which "
                                         "fivefold does not implement (plain RoPE only)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def sliding_window(hf: dict) -> int | None:
    """The attention window in force, or None when every layer attends to all of the past."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if "layer_types" in hf:
        return window if "sliding_attention" in hf["layer_types"] else None
    if hf.get("model_type") == "qwen2":  # Qwen2 slides from layer max_window_layers on
        sliding = hf.get("num_hidden_layers", 0) > hf.get("max_window_layers", 28)
        return window if hf.get("use_sliding_window") and sliding else None
    return window


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The fivefold model a Hugging Face config.json describes (error names the key)."""
    family = hf.get("model_type")
    archs = hf.get("architectures") or [ARCHITECTURES.get(family, "?")]
    if family not in ARCHITECTURES:
        raise CheckpointError(where, f"model_type {family!r} (architectures {archs}) is not "
                                     f"supported; fivefold reads {', '.join(ARCHITECTURES)}")
    if archs != [ARCHITECTURES[family]]:
        raise CheckpointError(where, f"`architectures` is {archs}; fivefold reads the causal "
                                     f"language model {ARCHITECTURES[family]} of {family}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size", "max_position_embeddings"):
        if not isinstance(hf.get(key), int):
            raise CheckpointError(where, f"`{key}` is missing or not an integer")
    refusals = {"hidden_act": (hf.get("hidden_act", "silu") != "silu",
                               "only SiLU (SwiGLU) MLPs are implemented"),
                "mlp_bias": (bool(hf.get("mlp_bias")), "MLP biases are not implemented"),
                "attention_bias": (bool(hf.get("attention_bias")),
                                   "biases on all four attention projections are not "
                                   "implemented (only Qwen2's q/k/v biases are)"),
                "attention_dropout": (bool(hf.get("attention_dropout")),
                                      "attention dropout is not implemented; set it to 0.0"),
                "router_jitter_noise": (bool(hf.get("router_jitter_noise")),
                                        "router jitter is not implemented; set it to 0.0")}
    for key, (refused, why) in refusals.items():
        if refused:
            raise CheckpointError(where, f"`{key}` = {hf[key]!r}: {why}")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    seq_len = hf["max_position_embeddings"]
    window = sliding_window(hf)
    moe = None
    if family == "mixtral":
        moe = MoEConfig(experts=hf.get("num_local_experts", 8),
                        top_k=hf.get("num_experts_per_tok", 2),
                        expert_ffn_hidden=hf["intermediate_size"])
    cfg = ModelConfig(preset="tiny", layers=hf["num_hidden_layers"], hidden=hidden, heads=heads,
                      kv_heads=hf.get("num_key_value_heads") or heads,
                      head_dim=hf.get("head_dim") or hidden // heads,
                      ffn_hidden=hf["intermediate_size"], ffn_type="swiglu",
                      vocab=hf["vocab_size"], seq_len=min(seq_len, window or seq_len),
                      tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      rope_theta=_rope_theta(hf, where),
                      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                      qkv_bias=family == "qwen2", moe=moe)
    try:
        check_model(cfg)
    except ConfigError as err:
        raise CheckpointError(where, f"describes a model fivefold cannot build: {err}") from None
    return cfg


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """A Hugging Face config.json for `cfg`.

    `base` is the config.json the model was imported from, if any: when it still describes
    `cfg` it is returned unchanged (so its token ids, family and windows survive a round
    trip); otherwise its family is kept where the model allows and its other keys are kept
    except those rewritten here.
    """
    if cfg.moe is not None:
        check_mixtral(cfg)
    if base is not None:
        try:
            if model_fields(model_config_from_hf(base, "config.json")) == model_fields(cfg):
                return dict(base)
        except CheckpointError:
            pass
    family = (base or {}).get("model_type", "llama")
    if cfg.moe is not None:
        family = "mixtral"
    elif cfg.qkv_bias:
        family = "qwen2"
    elif family not in ("llama", "mistral"):
        family = "llama"
    keep = dict(base) if base and base.get("model_type") == family else {}
    for key in ("rope_scaling", "layer_types", "max_window_layers", "use_sliding_window",
                "sliding_window", "torch_dtype", "pretraining_tp"):
        keep.pop(key, None)
    out = {**keep, "architectures": [ARCHITECTURES[family]], "model_type": family,
           "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
           "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
           "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
           "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
           "vocab_size": cfg.vocab, "tie_word_embeddings": cfg.tied_embeddings,
           "max_position_embeddings": cfg.seq_len, "attention_dropout": 0.0,
           "dtype": str(dtype).removeprefix("torch.")}
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if family in ("mistral", "mixtral", "qwen2"):
        out["sliding_window"] = None
    if family == "mixtral":
        out.update(intermediate_size=cfg.moe.expert_ffn_hidden or cfg.ffn_hidden,
                   num_local_experts=cfg.moe.experts, num_experts_per_tok=cfg.moe.top_k,
                   router_jitter_noise=0.0)
    return out


def check_mixtral(cfg: ModelConfig) -> None:
    """Refuse, naming the key, an MoE model that Mixtral (arXiv 2401.04088, Sec. 2.1) does not
    compute exactly: Mixtral routes every token of every layer dropless to its top-k of a
    softmax over the router logits, without a routing bias or shared experts. (Qwen2-MoE
    gates its shared expert with a sigmoid and Qwen3-MoE normalizes queries and keys, which
    fivefold's model does not, so an MoE model is written as Mixtral or not at all.)"""
    m = cfg.moe
    unmapped = {"model.moe.shared_experts": (m.shared_experts, 0),
                "model.moe.score": (m.score, "softmax"),
                "model.moe.dense_layers": (m.dense_layers, 0),
                "model.moe.layer_freq": (m.layer_freq, 1),
                "model.moe.capacity_factor": (m.capacity_factor, None),
                "model.moe.bias_update_rate": (m.bias_update_rate, 0.0)}
    for key, (value, mixtral) in unmapped.items():
        if value != mixtral:
            raise CheckpointError(key, f"is {value!r}; Mixtral, the Hugging Face family an MoE "
                                       f"model is written as, computes {key} = {mixtral!r} "
                                       "only, so its logits would differ: export a model "
                                       f"trained with {key} = {mixtral!r}")


def model_fields(cfg: ModelConfig) -> dict:
    """The model keys that decide the weights and the function, defaults made explicit."""
    out = {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
           "kv_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "ffn_hidden": cfg.ffn_hidden,
           "ffn_type": cfg.ffn_type, "vocab": cfg.vocab, "seq_len": cfg.seq_len,
           "tied_embeddings": cfg.tied_embeddings, "rope_theta": cfg.rope_theta,
           "norm_eps": cfg.norm_eps, "qkv_bias": cfg.qkv_bias}
    if cfg.moe is not None:
        m = cfg.moe
        out["moe"] = {"experts": m.experts, "top_k": m.top_k,
                      "expert_ffn_hidden": m.expert_ffn_hidden or cfg.ffn_hidden,
                      "shared_experts": m.shared_experts, "dense_layers": m.dense_layers,
                      "layer_freq": m.layer_freq, "capacity_factor": m.capacity_factor}
    return out


# ------------------------------------------------------------------ tensor names

def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                  where: str) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to the fivefold names `cfg` has; stack Mixtral's experts."""
    parts = {p.name: p.part for p in parameters(cfg)}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown = []
    for name, tensor in hf_state.items():
        ours, expert = ROOT_NAMES.get(name), None
        if (m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)) is not None:
            layer, rest = int(m.group(1)), m.group(2)
            expert = EXPERT.fullmatch(rest)
            ours = (f"layers.{layer}.mlp.{expert.group(2)}" if expert else
                    f"layers.{layer}.{LAYER_NAMES[rest]}" if rest in LAYER_NAMES else None)
        if expert is not None and parts.get(ours) == "experts":
            experts.setdefault((layer, expert.group(2)), {})[int(expert.group(1))] = tensor
        elif ours in parts or ours == "output.weight":  # a tied head is checked below
            out[ours] = tensor
        elif not IGNORED.fullmatch(name):
            unknown.append(name)
    if unknown:
        raise CheckpointError(where, f"{len(unknown)} tensor(s) this {_family(cfg)} model has "
                                     f"no place for, e.g. {', '.join(sorted(unknown)[:3])}")
    for (layer, matrix), by_index in experts.items():
        missing = sorted(set(range(cfg.moe.experts)) - set(by_index))
        if missing or len(by_index) != cfg.moe.experts:
            raise CheckpointError(where, f"layer {layer} {matrix}: experts {missing} are missing "
                                         f"or extra ones exist (num_local_experts = "
                                         f"{cfg.moe.experts})")
        out[f"layers.{layer}.mlp.{matrix}"] = torch.stack([by_index[e] for e in
                                                           range(cfg.moe.experts)])
    if cfg.tied_embeddings and "output.weight" in out:
        head = out.pop("output.weight")
        if not torch.equal(head, out.get("tok_embeddings.weight", head)):
            raise CheckpointError(where, "tie_word_embeddings is true but lm_head.weight differs "
                                         "from model.embed_tokens.weight; set it to false")
    return out


def state_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename fivefold tensors to Hugging Face names; cut Mixtral's experts apart."""
    root_names = {ours: theirs for theirs, ours in ROOT_NAMES.items()}
    layer_names = {ours: theirs for theirs, ours in LAYER_NAMES.items()}
    params = {p.name: p for p in parameters(cfg)}
    out = {}
    for name, tensor in state.items():
        p = params[name]
        if p.layer is None:
            out[root_names[name]] = tensor
        elif p.part == "experts":  # layers.i.mlp.wJ of shape (experts, ...)
            matrix = name.rsplit(".", 1)[1]
            for e in range(tensor.shape[0]):
                key = f"model.layers.{p.layer}.block_sparse_moe.experts.{e}.{matrix}.weight"
                out[key] = tensor[e].clone()
        else:
            out[f"model.layers.{p.layer}.{layer_names[name_in_part(name)]}"] = tensor
    return out


def _family(cfg: ModelConfig) -> str:
    return "Mixtral" if cfg.moe else "Qwen2" if cfg.qkv_bias else "Llama/Mistral"


# ------------------------------------------------------------------ folders

def read_config_json(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(str(folder), "is not a folder; give a Hugging Face model folder "
                                           "(config.json + *.safetensors)")
    if not path.is_file():
        raise CheckpointError(str(folder), "has no config.json, so it is not a Hugging Face "
                                           "model folder (config.json + *.safetensors)")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(str(path), f"does not parse as JSON: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(str(path), "must hold a JSON object")
    return hf


def read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder, by its Hugging Face name (single or sharded)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        other = sorted(p.name for p in folder.glob("*.bin"))
        hint = (f" (it holds {', '.join(other[:2])}: re-save with safetensors, e.g. "
                "save_pretrained(..., safe_serialization=True))" if other else "")
        raise CheckpointError(str(folder), f"has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise CheckpointError(str(index), f"lists shard {name}, which is not in the folder")
        tensors.update(load_file(folder / name))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(str(index), f"lists {len(missing)} tensor(s) its shards do not "
                                              f"hold, e.g. {missing[0]}")
    return tensors


def write_hf_tensors(folder: Path, tensors: dict[str, torch.Tensor],
                     shard_bytes: int = SHARD_BYTES) -> None:
    """Save tensors as Hugging Face does: one file, or shards plus an index."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], folder / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                 "weight_map": weight_map}, indent=2) + "\n")

"""Typed run configuration: model, parallel, train, data, cluster.

A config is a TOML file (or nothing: every field has a default) plus `--set section.key=value`
overrides. Keys follow docs/run_spec.md, with `train.*` and `data.*` added for
the trainer. Loading checks every key and type; `validate` checks every value and every
combination. Both raise `ConfigError`, whose message names the key and the fix, before any
process is spawned or any tensor is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.cluster_config import ClusterConfig, GroupConfig  # noqa: F401 (re-exported)
from fivefold.config_fields import doc_field as _doc
from fivefold.config_paths import resolve_file_paths
from fivefold.models.presets import PRESETS


class ConfigError(ValueError):
    """A user-caused configuration problem; `key` is the dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error in `{key}`: {message}")


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


@dataclass
class ParallelConfig:
    auto: bool = _doc('let the planner choose the layout for the launched ranks (also written '
                      '`parallel = "auto"`); keys set alongside are held fixed (docs/planner.md)',
                      False)
    dp: int | None = _doc("data-parallel degree; default = ranks / (tp*pp*cp)", None)
    tp: int = _doc("tensor-parallel degree", 1)
    pp: int = _doc("pipeline-parallel degree", 1)
    cp: int = _doc("context-parallel degree", 1)
    ep: int = _doc("expert-parallel degree", 1)
    etp: int = _doc("expert tensor-parallel degree: each routed expert's MLP split over etp "
                   "ranks (column then row parallel); the experts' grid etp x ep x "
                   "expert-data folds onto the tp x cp x dp ranks of a stage (docs/moe.md)", 1)
    zero_group: int | None = _doc("shard within groups of this many dp ranks (MiCS/HSDP)", None)
    cp_mode: str = _doc('"ulysses" | "ring" | "hybrid" (Ulysses inside groups of cp_ulysses '
                        'ranks, ring across them)', "ring")
    cp_ulysses: int | None = _doc("hybrid context parallelism: the Ulysses degree (neighbouring "
                                  "ranks, one node); the ring degree is cp / cp_ulysses", None)
    vpp: int = _doc("virtual pipeline stages per rank (interleaved schedule; 2 for zbv and "
                    "dualpipev)", 1)
    schedule: str = _doc('"gpipe" | "1f1b" | "interleaved" | "zb" | "zbv" | "dualpipev" | '
                         '"pipedream-2bw" | "terapipe"', "1f1b")
    stage_layers: list[int] | None = _doc("blocks per pipeline stage, pp*vpp numbers from the "
                                          "first stage; default balanced by cost", None)
    token_slices: int | None = _doc("TeraPipe: slices each sequence is cut into; default pp",
                                    None)
    weight_prediction: bool = _doc("PipeDream-2BW: compute with weights extrapolated one "
                                   "update ahead, offsetting part of the one-step staleness "
                                   "(one more copy of the weights)", False)
    zero_stage: int = _doc("0 plain data parallel, 1 shard optimizer, 2 +grads, 3 +params", 0)
    micro_batch: int | None = _doc("sequences per micro-batch per dp rank; default no accumulation",
                                   None)
    global_batch: int = _doc("sequences per optimizer step, all ranks together", 8)
    dp_batch_shares: list[int] | None = _doc("each dp replica's share of the global batch, "
                                             "e.g. [2, 1, 1] (docs/data_parallel.md); default "
                                             "even", None)
    recompute: str = _doc('"none" | "selective" | "full" activation recomputation', "none")
    offload: str = _doc('"none" | "cpu" (fp32 master weights and optimizer states in host '
                        'memory, the optimizer step on the CPU) | "nvme" (optimizer states in '
                        'files under offload_path, streamed through the CPU step) '
                        '(ZeRO-Offload / ZeRO-Infinity; docs/memory.md)', "none")
    offload_path: str | None = _doc('offload = "nvme": a writable directory for the '
                                    'optimizer-state files (one subdirectory per rank)', None)
    offload_fraction: float = _doc("share of the optimizer (by parameters, Megatron-style) "
                                   "that offload moves off the device; in (0, 1]", 1.0)
    offload_kernel: str = _doc('the offloaded CPU AdamW: "foreach" (torch\'s multi-tensor '
                               'kernel, bit for bit the in-memory update) | "fused" (torch\'s '
                               'fused CPU kernel, about 5x faster, rounds differently: within '
                               'the parity tolerance); docs/memory.md', "foreach")
    sequence_parallel: bool = _doc("Megatron sequence parallelism with tp", False)
    precision: str | None = _doc('"bf16" | "fp16" | "fp8" | "fp32"; default bf16 on GPU, '
                                 'fp32 on CPU; fp8: the blocks\' linears in fp8, the rest in '
                                 'bf16 on GPU, fp32 on CPU', None)
    fp8_emulate: bool | None = _doc("precision fp8: round each GEMM input to fp8 and run the "
                                    "GEMM in fp32 (any device) instead of fp8 GEMMs; default "
                                    "true where the device has no fp8 units (CPU, GPUs before "
                                    "compute capability 8.9) (docs/fp8.md)", None)
    fp8_recipe: str = _doc('precision fp8: "tensorwise" (one scale per tensor) | "rowwise" '
                           "(one per row along each GEMM's contracted dim)", "tensorwise")
    fp8_tensors: list[str] = _doc('precision fp8: the tensor classes rounded to fp8, of '
                                  '"input", "weight" (e4m3) and "grad_output" (e5m2); a GEMM '
                                  "with both operands in fp8 runs on fp8 units", factory=lambda:
                                  ["input", "weight", "grad_output"])
    reduce_dtype: str | None = _doc('gradient reduce-scatter dtype for zero_stage 2-3 "fp32" | '
                                    '"bf16" | "fp16"; default: the compute dtype (stages 0-1 '
                                    "reduce the gradient buffer itself, in the compute dtype)",
                                    None)
    qwz: bool = _doc("ZeRO++ qwZ: int8 block-quantized weight all-gather (zero_stage 3)", False)
    hpz: bool = _doc("ZeRO++ hpZ: node-local secondary weight shard for backward (zero_stage 3)",
                     False)
    qgz: bool = _doc("ZeRO++ qgZ: int8 gradient reduce-scatter by hierarchical all-to-all "
                     "(zero_stage >= 1)", False)


@dataclass
class TrainConfig:
    optimizer: str = _doc('"adamw" | "muon" (Muon on the blocks\' matrices and stacked '
                          'experts, AdamW on the rest; every data, tensor, pipeline and expert '
                          'layout) | "galore" (low-rank Adam on the blocks\' matrices; data, '
                          'tensor and pipeline parallel, ZeRO 0-3) | "sgd" | "lomo" (SGD '
                          'fused into backward; data parallel, zero_stage 0-2)', "adamw")
    seed: int = _doc("seed for initialization, data order and sampling", 0)
    steps: int = _doc("total optimizer steps (the schedule's length); --steps sets it", 200)
    lr: float = _doc("peak learning rate", 1e-3)
    lr_schedule: str = _doc('after warm-up: "cosine" | "linear" decay to the floor | '
                            '"constant" | "wsd" (warmup-stable-decay; fivefold.lr_schedule)',
                            "cosine")
    min_lr_ratio: float = _doc("final learning rate as a fraction of lr (the decay's floor)",
                               0.1)
    warmup_steps: int | None = _doc("linear warm-up steps; absent: min(20, steps // 10)", None)
    decay_fraction: float = _doc("wsd: the share of the steps, at the end, that decay", 0.1)
    decay_shape: str = _doc('wsd: the decay\'s shape "linear" | "cosine" | "sqrt" '
                            "(1 - sqrt of its progress)", "sqrt")
    weight_decay: float = _doc("AdamW decoupled weight decay (matrices only)", 0.1)
    beta1: float = _doc("AdamW beta1 / SGD momentum", 0.9)
    muon_momentum: float = _doc("Muon's (Nesterov) momentum on the blocks' matrices", 0.95)
    galore_update_gap: int = _doc("GaLore: steps between refreshes of each matrix's gradient "
                                  "subspace (its rank is a quarter of the smaller side)", 200)
    galore_scale: float = _doc("GaLore: scale of the projected-back update", 0.25)
    galore_svd: str = _doc('GaLore: the subspace refresh by "exact" SVD or "randomized" SVD '
                           "(GaLore 2, arXiv 2504.20437: cheaper on large matrices)", "exact")
    galore_reduce: str = _doc('GaLore with data parallelism alone (ZeRO 0-2): what the ranks '
                              'reduce on steps without a subspace refresh, the "full" gradient '
                              'or its "projected" one (a quarter of each matrix\'s bytes; needs '
                              'grad_clip = 0, and grad_norm is then the projected one\'s)',
                              "full")
    beta2: float = _doc("AdamW beta2", 0.95)
    eps: float = _doc("AdamW epsilon", 1e-8)
    grad_clip: float = _doc("clip the global gradient norm to this; 0 disables", 1.0)
    eval_every: int = _doc("validation every this many steps (and at the end)", 50)
    eval_batches: int = _doc("global batches per validation pass", 4)
    checkpoint_every: int = _doc("checkpoint every this many steps (and at the end)", 100)
    checkpoint_minutes: float | None = _doc("also checkpoint once this many minutes of training"
                                            " have passed since the last save (rank 0's clock,"
                                            " broadcast: every rank saves at the same step); "
                                            "absent = by steps only", None)
    keep_checkpoints: int = _doc("most recent checkpoints kept on disk", 2)
    reset_data: bool = _doc("resuming from a checkpoint written with other data keys (data.*, "
                            "train.seed): keep its weights and optimizer state and start the "
                            "data order afresh, instead of refusing", False)
    log_every: int = _doc("print a progress line every this many steps", 10)
    sample_tokens: int = _doc("tokens of text sampled at the end; 0 disables", 64)
    device: str = _doc('"auto" (cuda if available) | "cpu" | "cuda"', "auto")
    compile: bool = _doc("torch.compile each transformer block", False)
    timeout_s: float = _doc("collective timeout; a hung rank fails after this, and each rank "
                            "writes RUN_DIR/flight_recorder/rank_R.json", 600.0)
    on_nonfinite: str = _doc('a step whose loss or global gradient norm is NaN or infinite: '
                             '"stop" (raise, naming the step and the first parameter with a '
                             'non-finite gradient) | "skip" (drop its update, counted as '
                             'skipped_steps in the metrics); not with PipeDream-2BW, nor LOMO '
                             'without grad_clip', "stop")
    tensorboard: bool = _doc("write TensorBoard event files to RUN_DIR/tb", True)
    preflight: bool = _doc("before any rank starts, refuse a run whose predicted memory "
                           "exceeds this machine's (fivefold.preflight)", True)
    stack: str = _doc('the software stack the step runs on: "fivefold" (this runtime; the only '
                      'one `fivefold train` runs) | "megatron" (Megatron-Core / NeMo / '
                      'Megatron-Bridge) | "torchtitan" | "deepspeed"; plan and simulate '
                      'predict with its switches (docs/planner.md, "Software stacks")',
                      "fivefold")
    stack_release: str | None = _doc('the release of that stack, "YYYY-MM" (its container or '
                                     'version date): which attention kernel it runs '
                                     '(docs/planner.md, "Software stacks"); absent = its '
                                     'newest; not with "fivefold"', None)


@dataclass
class SourceConfig:
    path: str = _doc('"stdlib" or a file or folder, as data.source', "stdlib")
    weight: float = _doc("share of the sequences drawn from this source, relative to the "
                         "other sources' weights", 1.0)
    format: str = _doc('"auto" | "text" | "jsonl" | "tokens", as data.format', "auto")
    text_field: str = _doc("JSONL field holding the text", "text")
    token_dtype: str = _doc('"uint16" | "uint32" for format "tokens"', "uint16")


@dataclass
class DataConfig:
    source: str = _doc('"stdlib" (built-in corpus) or a path to a file or folder', "stdlib")
    sources: list[SourceConfig] | None = _doc("a weighted mixture instead of data.source: "
                                              "[[data.sources]] tables (docs/data.md)", None)
    format: str = _doc('"auto" | "text" | "jsonl" | "tokens" (raw little-endian token ids)',
                       "auto")
    text_field: str = _doc("JSONL field holding the text", "text")
    token_dtype: str = _doc('"uint16" | "uint32" for format "tokens"', "uint16")
    tokenizer: str | None = _doc("tokenizer.json (HF `tokenizers`) to use instead of training one",
                                 None)
    eos_token: str | None = _doc("the token that ends each document; default: from "
                                 "tokenizer_config.json / config.json beside the tokenizer, "
                                 "else <|endoftext|>, </s>, <|end_of_text|> or <eos>", None)
    val_fraction: float = _doc("share of documents held out for validation", 0.02)
    tokenizer_sample_mib: float = _doc("MiB of training text the BPE tokenizer learns from", 5.0)
    cache_dir: str | None = _doc("tokenizer and token cache; default ~/.cache/fivefold", None)


@dataclass
class CommConfig:
    algorithm: str | dict[str, str] = _doc(
        'collective algorithm: "builtin" (torch.distributed\'s) | "ring" | "tree" (recursive '
        'doubling/halving) | "hierarchical" (intra-node, then inter-node; 2D for all_to_all) | '
        '"synthesized" (from comm.topology and comm.sketch, or comm.schedule), for every '
        'collective, or a table by kind, e.g. {all_gather = "synthesized", all_reduce = '
        '"ring"} (docs/collectives.md)', "builtin")
    topology: str | None = _doc("topology file (TOML/JSON: nodes, devices, links with "
                                "bandwidth and latency) of the ranks a synthesized collective "
                                "runs on", None)
    sketch: str | None = _doc("synthesis sketch file (allowed links, symmetry, chunks per rank, "
                              "steps); default: all links, no symmetry, 1 chunk", None)
    schedule: str | None = _doc("a schedule file (JSON, e.g. written by bench/collectives.py) "
                                "that \"synthesized\" runs instead of synthesizing", None)


@dataclass
class Config:
    model: ModelConfig = _doc("model shape", factory=ModelConfig)
    parallel: ParallelConfig = _doc("parallel layout", factory=ParallelConfig)
    train: TrainConfig = _doc("optimizer and loop", factory=TrainConfig)
    data: DataConfig = _doc("corpus and tokenizer", factory=DataConfig)
    cluster: ClusterConfig = _doc("hardware", factory=ClusterConfig)
    comm: CommConfig = _doc("collective algorithms", factory=CommConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (1, 2.5, true, "x", [1, 2]) or else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.key=value` to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(assignment, "a --set override must look like section.key=value, "
                                      "e.g. --set train.lr=1e-3")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(key, "name a section and a key, e.g. model.layers=8 or train.lr=1e-3")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"`{part}` is a value, not a table")
    node[parts[-1]] = parse_value(value.strip())


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Return `value` converted to `hint` (int -> float allowed) or raise naming the key."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        tables = [a for a in args if typing.get_origin(a) is dict]
        if tables and isinstance(value, dict):  # `str | dict[str, str]`: a name or a table
            return _check_type(key, value, tables[0])
        return _check_type(key, value, args[0])
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {value!r}")
        return {k: _check_type(f"{key}.{k}", v, typing.get_args(hint)[1])
                for k, v in value.items()}
    if origin is list:
        item = typing.get_args(hint)[0]
        tables = dataclasses.is_dataclass(item)  # a list of tables, e.g. [[data.sources]]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}; write e.g. " +
                              (f"[[{key}]] tables" if tables else f"{key}=[2, 2]"))
        if tables:
            return [_build(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return [_check_type(key, v, item) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if not ok:
        example = {int: "8", float: "1e-3", bool: "true", str: '"name"'}[hint]
        raise ConfigError(key, f"expected {hint.__name__}, got {value!r} "
                               f"({type(value).__name__}); write e.g. {key}={example}")
    return value


def _build(cls: type, raw: dict, prefix: str) -> Any:
    """Build dataclass `cls` from a dict, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"expected a table of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in hints:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
            if close:
                raise ConfigError(dotted, f"unknown key; did you mean {' or '.join(close)}?")
            raise ConfigError(dotted, f"unknown key; known keys are {', '.join(names)}")
        hint = hints[key]
        sub = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, dotted)
        elif sub and value is not None:
            kwargs[key] = _build(sub[0], value, dotted)
        else:
            kwargs[key] = _check_type(dotted, value, hint)
    return cls(**kwargs)


SHAPE_KEYS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")


def resolve_preset(model_raw: dict) -> dict:
    """Overlay the user's model keys on the named preset's values.

    A table that names no preset but sets every shape key (a run spec's full description)
    takes the field defaults for what it leaves out (kv_heads = heads, untied embeddings), as
    run_spec.md says, instead of the tiny preset's values; its preset is then "custom".
    """
    if not isinstance(model_raw, dict):
        raise ConfigError("model", f"expected a table of keys, got {model_raw!r}")
    if "preset" not in model_raw and all(k in model_raw for k in SHAPE_KEYS):
        return {**model_raw, "preset": "custom"}
    preset = model_raw.get("preset", "tiny")
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {preset!r}; choose one of "
                                          f"{', '.join(PRESETS)} or set every model key")
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PRESETS[preset].items()}
    for key, value in model_raw.items():
        if key == "moe" and isinstance(value, dict) and isinstance(merged.get("moe"), dict):
            merged["moe"].update(value)
        else:
            merged[key] = value
    merged["preset"] = preset
    return merged


def read_file(path: str | Path) -> dict:
    """Read a TOML or JSON config file into a dict, with a clear message if it cannot."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("CONFIG", f"config file {str(p)!r} does not exist; pass a TOML file "
                                    "or omit it to use the defaults")
    try:
        text = p.read_text()
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("CONFIG", f"{p} does not parse: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError("CONFIG", f"{p} must hold a table of sections (model, parallel, ...), "
                                    f"not a {type(raw).__name__}")
    return raw


AUTO_SHORTHAND = {"parallel=auto": "parallel.auto=true", 'parallel="auto"': "parallel.auto=true"}


def _auto_shorthand(raw: dict) -> None:
    """A file's `parallel = "auto"` is the table `[parallel] auto = true` (docs/planner.md)."""
    if raw.get("parallel") == "auto":
        raw["parallel"] = {"auto": True}
    elif isinstance(raw.get("parallel"), str):
        raise ConfigError("parallel", f"expected a table of keys or \"auto\", got "
                                      f"{raw['parallel']!r}")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a config file (optional) and `--set` overrides into a typed `Config`.

    Only structure and types are checked here; call `validate` for values. Relative `[data]`
    paths in the file are taken from its folder (fivefold.config_paths).
    """
    raw: dict = resolve_file_paths(read_file(path), Path(path).parent) if path else {}
    return config_from_raw(raw, overrides)


def config_from_raw(raw: dict, overrides: list[str] = ()) -> Config:
    """A typed `Config` from a dict of sections (a file's, or a checkpoint's saved config,
    `Config.to_dict`) and `--set` overrides, checked as `load_config` checks."""
    _auto_shorthand(raw)
    for assignment in overrides:
        apply_override(raw, AUTO_SHORTHAND.get(assignment.replace(" ", ""), assignment))
    unknown = set(raw) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(key, "unknown section; sections are model, parallel, train, data, "
                               "cluster, comm")
    raw["model"] = resolve_preset(raw.get("model", {}))
    return _build(Config, raw, "")

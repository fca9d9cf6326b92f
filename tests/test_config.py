"""Config loading (TOML/JSON files, presets, --set overrides) and validation."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fivefold.config import Config, ConfigError, load_config, parse_value
from fivefold.models.presets import PRESETS
from fivefold.validate import validate, validate_for_training

ROOT = Path(__file__).resolve().parent.parent


def load(*overrides: str, path=None) -> Config:
    return load_config(path, list(overrides))


def rejects(key: str, fragment: str, *overrides: str, world_size=None, path=None,
            training: bool = False) -> ConfigError:
    """Assert that loading + validating fails on `key` with `fragment` in the message."""
    with pytest.raises(ConfigError) as info:
        cfg = load_config(path, list(overrides))
        if training:
            validate_for_training(cfg, world_size or 1)
        else:
            validate(cfg, world_size)
    err = info.value
    assert err.key == key, str(err)
    assert fragment in str(err), str(err)
    assert f"`{key}`" in str(err)
    return err


# ---------------------------------------------------------------- loading

def test_defaults_load_and_validate():
    cfg = load()
    validate(cfg)
    validate(cfg, world_size=1)
    validate_for_training(cfg, world_size=1)
    validate_for_training(cfg, world_size=2)
    assert cfg.model.preset == "tiny"
    assert cfg.model.moe is None
    assert cfg.parallel.tp == cfg.parallel.pp == cfg.parallel.cp == 1
    assert cfg.train.optimizer == "adamw"
    assert cfg.data.source == "stdlib"
    assert isinstance(cfg.to_dict()["train"]["lr"], float)


def test_tiny_preset_values_applied():
    cfg = load()
    for key, value in PRESETS["tiny"].items():
        assert getattr(cfg.model, key) == value, key
    assert cfg.model.n_kv_heads == 4
    assert cfg.model.d_head == 256 // 8


@pytest.mark.parametrize("assignment, key, value", [
    ("model.layers=2", "layers", 2),
    ("model.hidden=128", "hidden", 128),
    ("model.heads=4", "heads", 4),
    ("model.kv_heads=2", "kv_heads", 2),
    ("model.ffn_hidden=512", "ffn_hidden", 512),
    ("model.vocab=1000", "vocab", 1000),
    ("model.seq_len=64", "seq_len", 64),
    ("model.tied_embeddings=false", "tied_embeddings", False),
    ("model.rope_theta=5e5", "rope_theta", 500000.0),
])
def test_override_one_preset_key_wins(assignment, key, value):
    cfg = load(assignment)
    assert getattr(cfg.model, key) == value
    for other, preset_value in PRESETS["tiny"].items():  # the rest stays the preset's
        if other != key:
            assert getattr(cfg.model, other) == preset_value, other
    validate(cfg)


def test_named_preset_1b():
    cfg = load('model.preset="1B"')
    for key, value in PRESETS["1B"].items():
        assert getattr(cfg.model, key) == value, key
    assert cfg.model.preset == "1B"
    validate(cfg)
    # a bare string works too, and a key set after the preset still wins
    cfg = load("model.preset=1B", "model.layers=2")
    assert cfg.model.hidden == 2048 and cfg.model.layers == 2


def test_moe_preset_fills_moe_table_and_override_merges():
    cfg = load("model.preset=mixtral-8x7B", "model.moe.experts=16")
    assert cfg.model.moe is not None
    assert cfg.model.moe.experts == 16
    assert cfg.model.moe.top_k == 2
    assert cfg.model.moe.expert_ffn_hidden == 14336
    validate(cfg)


def test_toml_file_with_nested_moe_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("""
[model]
preset = "tiny"
layers = 6
kv_heads = 8

[model.moe]
experts = 4
top_k = 1
expert_ffn_hidden = 128
capacity_factor = 2

[parallel]
global_batch = 8
micro_batch = 2

[train]
lr = 5e-4
steps = 30
warmup_steps = 5
compile = true

[data]
val_fraction = 0.1

[cluster]
gpus = 2
""")
    cfg = load(path=path)
    assert cfg.model.layers == 6 and cfg.model.kv_heads == 8 and cfg.model.hidden == 256
    assert cfg.model.moe.experts == 4 and cfg.model.moe.top_k == 1
    assert cfg.model.moe.expert_ffn_hidden == 128
    assert cfg.model.moe.capacity_factor == 2.0
    assert isinstance(cfg.model.moe.capacity_factor, float)
    assert cfg.parallel.global_batch == 8 and cfg.parallel.micro_batch == 2
    assert cfg.train.lr == 5e-4 and cfg.train.compile is True
    assert cfg.data.val_fraction == 0.1
    assert cfg.cluster.gpus == 2
    validate(cfg)
    # --set overrides are applied after the file
    cfg = load("train.lr=2e-3", "model.moe.top_k=2", path=str(path))
    assert cfg.train.lr == 2e-3 and cfg.model.moe.top_k == 2 and cfg.model.moe.experts == 4


def test_json_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"preset": "125M", "layers": 2},
                                "train": {"lr": 1, "seed": 7},
                                "parallel": {"precision": None}}))
    cfg = load(path=path)
    assert cfg.model.preset == "125M" and cfg.model.hidden == 768 and cfg.model.layers == 2
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.seed == 7
    assert cfg.parallel.precision is None
    validate(cfg)


def test_int_accepted_for_float_key():
    cfg = load("train.lr=1", "train.grad_clip=0")
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.grad_clip == 0.0 and isinstance(cfg.train.grad_clip, float)


def test_integral_float_accepted_for_int_key():
    cfg = load("model.layers=2.0")
    assert cfg.model.layers == 2 and isinstance(cfg.model.layers, int)


@pytest.mark.parametrize("assignment, key, fragment", [
    ("model.layers=abc", "model.layers", "expected int, got 'abc'"),
    ("model.layers=2.5", "model.layers", "expected int"),
    ("model.layers=true", "model.layers", "expected int, got True"),
    ("train.lr=true", "train.lr", "expected float"),
    ("train.lr=fast", "train.lr", "expected float"),
    ("train.compile=yes", "train.compile", "expected bool"),
    ("parallel.precision=16", "parallel.precision", "expected str"),
    ("model.moe=3", "model.moe", "expected a table"),
    ("model.preset=[1]", "model.preset", "unknown preset"),
])
def test_wrong_type_names_the_key(assignment, key, fragment):
    rejects(key, fragment, assignment)


@pytest.mark.parametrize("text, value", [
    ("true", True),
    ("false", False),
    ("1e-3", 1e-3),
    ("8", 8),
    ("2.5", 2.5),
    ('"x"', "x"),
    ("x", "x"),
    ("1B", "1B"),
    ("mixtral-8x7B", "mixtral-8x7B"),
    ("/tmp/some path/file.txt", "/tmp/some path/file.txt"),
    ("[1, 2]", [1, 2]),
])
def test_parse_value(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


def test_set_values_parse_as_toml_literals():
    cfg = load("train.compile=true", "train.lr=5e-4", 'data.text_field="body"',
               "data.format=jsonl", "train.device = cpu")
    assert cfg.train.compile is True
    assert cfg.train.lr == 5e-4
    assert cfg.data.text_field == "body"
    assert cfg.data.format == "jsonl"
    assert cfg.train.device == "cpu"


def test_set_on_a_value_not_a_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nmoe = 3\n")
    rejects("model.moe.experts", "is a value, not a table", "model.moe.experts=2", path=path)


# ---------------------------------------------------------------- rejected inputs

@pytest.mark.parametrize("overrides, key, fragment", [
    (["train.optimizer=galore", "train.galore_reduce=projected"], "train.galore_reduce",
     "set train.grad_clip = 0"),
    (["train.galore_reduce=sum"], "train.galore_reduce", "is not one of"),
    # structure
    (["model.layer=2"], "model.layer", "unknown key; did you mean layers?"),
    (["train.learning_rat=1"], "train.learning_rat", "unknown key; known keys are"),
    (["train.learning_rate=1"], "train.learning_rate", "unknown key"),
    (["model.moe.expert=4"], "model.moe.expert", "unknown key"),
    (["optim.lr=1"], "optim", "unknown section"),
    (["model.preset=huge"], "model.preset", "unknown preset 'huge'"),
    (["train.lr"], "train.lr", "must look like section.key=value"),
    (["lr=1e-3"], "lr", "name a section and a key"),
    (["model.=3"], "model.", "name a section and a key"),
    # model
    (["model.kv_heads=3"], "model.kv_heads", "3 does not divide model.heads = 8"),
    (["model.hidden=250"], "model.heads", "8 does not divide model.hidden = 250"),
    (["model.head_dim=33"], "model.head_dim", "must be even"),
    (["model.hidden=264"], "model.head_dim", "head dimension 33 must be even"),
    (["model.layers=0"], "model.layers", "greater than zero"),
    (["model.heads=-8"], "model.heads", "greater than zero"),
    (["model.kv_heads=0"], "model.kv_heads", "greater than zero"),
    (["model.ffn_type=relu"], "model.ffn_type", "'relu' is not one of 'swiglu', 'gelu'"),
    (["model.preset=mixtral-8x7B", "model.moe.top_k=9"], "model.moe.top_k",
     "9 exceeds model.moe.experts = 8"),
    (["model.moe.experts=2", "model.moe.top_k=3", "model.moe.expert_ffn_hidden=64"],
     "model.moe.top_k", "exceeds model.moe.experts"),
    (["model.preset=mixtral-8x7B", "model.moe.dense_layers=32"], "model.moe.dense_layers",
     "leaves no MoE layer"),
    (["model.moe.experts=4"], "model.moe.expert_ffn_hidden", "greater than zero"),
    (["model.moe.experts=6", "model.moe.expert_ffn_hidden=64", "parallel.ep=4",
      "parallel.dp=4"], "parallel.ep", "does not divide model.moe.experts = 6"),
    (["model.moe.experts=8", "model.moe.expert_ffn_hidden=64", "parallel.ep=4",
      "parallel.dp=2"], "parallel.ep", "does not divide the dp x cp x tp / etp = 2"),
    (["model.moe.experts=8", "model.moe.expert_ffn_hidden=64", "parallel.etp=4",
      "parallel.dp=2"], "parallel.etp", "does not divide the dp x cp x tp = 2"),
    (["model.moe.experts=8", "model.moe.expert_ffn_hidden=60", "parallel.etp=8",
      "parallel.dp=8"], "parallel.etp", "does not divide the experts' width 60"),
    (["parallel.etp=2", "parallel.dp=2"], "parallel.etp", "needs model.moe"),
    (["model.moe.experts=4", "model.moe.expert_ffn_hidden=64", "parallel.ep=2",
      "parallel.dp=2", "parallel.zero_stage=1", "parallel.zero_group=1"], "parallel.zero_group",
     "must hold whole ep x etp = 2 expert grids"),
    (["model.moe.experts=8", "model.moe.expert_ffn_hidden=64", "model.seq_len=62",
      "parallel.tp=4", "parallel.dp=1"], "parallel.tp", "must divide them"),
    (["model.moe.expert_ffn_hidden=64", "model.moe.score='tanh'"], "model.moe.score",
     "is not one of"),
    # train
    (["train.lr=-1e-3"], "train.lr", "must be greater than zero, got -0.001"),
    (["train.lr=0"], "train.lr", "must be greater than zero, got 0"),
    (["train.lr=nan"], "train.lr", "must be greater than zero, got nan"),
    (["train.beta1=1.5"], "train.beta1", "must lie in [0, 1], got 1.5"),
    (["train.muon_momentum=-0.1"], "train.muon_momentum", "must lie in [0, 1]"),
    (["train.galore_update_gap=0"], "train.galore_update_gap", "must be greater than zero"),
    (["train.beta2=-0.1"], "train.beta2", "must lie in [0, 1]"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio", "must lie in [0, 1]"),
    (["train.steps=10", "train.warmup_steps=11"], "train.warmup_steps",
     "11 warm-up steps exceed the 10 steps"),
    (["train.warmup_steps=-1"], "train.warmup_steps", "zero or more"),
    (["train.steps=0"], "train.steps", "greater than zero"),
    (["train.optimizer=adam"], "train.optimizer", "'adam' is not one of"),
    (["train.device=tpu"], "train.device", "'tpu' is not one of"),
    (["train.eval_every=0"], "train.eval_every", "greater than zero"),
    # data
    (["data.source=/no/such/corpus.txt"], "data.source",
     "path '/no/such/corpus.txt' does not exist"),
    (["data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer",
     "file '/no/such/tokenizer.json' does not exist"),
    (["data.val_fraction=0"], "data.val_fraction", "must lie in (0, 0.5), got 0.0"),
    (["data.val_fraction=0.5"], "data.val_fraction", "must lie in (0, 0.5)"),
    (["data.val_fraction=-0.1"], "data.val_fraction", "must lie in (0, 0.5)"),
    (["data.format=csv"], "data.format", "'csv' is not one of"),
    (["data.token_dtype=int8"], "data.token_dtype", "'int8' is not one of"),
    (["model.vocab=70000", "data.format=tokens"], "data.token_dtype",
     "uint16 cannot hold ids of a 70000-token vocabulary; use 'uint32'"),
    # parallel
    (["parallel.zero_stage=5"], "parallel.zero_stage", "5 is not a ZeRO stage"),
    (["parallel.qwz=true", "parallel.zero_stage=2"], "parallel.qwz", "set parallel.zero_stage = 3"),
    (["parallel.hpz=true"], "parallel.hpz", "set parallel.zero_stage = 3"),
    (["parallel.qgz=true"], "parallel.qgz", "set parallel.zero_stage to 1, 2 or 3"),
    (["parallel.reduce_dtype=fp64"], "parallel.reduce_dtype", "'fp64' is not one of"),
    (["parallel.offload=gpu"], "parallel.offload", "'gpu' is not one of"),
    (["parallel.offload=cpu", "parallel.offload_kernel=fused", "train.optimizer=sgd"],
     "parallel.offload_kernel", "fused CPU AdamW"),
    (["parallel.offload=cpu", "parallel.offload_kernel=avx"], "parallel.offload_kernel",
     "'avx' is not one of"),
    (["parallel.offload=cpu", "parallel.offload_fraction=0"], "parallel.offload_fraction",
     "must lie in (0, 1], got 0.0"),
    (["parallel.offload=cpu", "parallel.offload_fraction=1.5"], "parallel.offload_fraction",
     "must lie in (0, 1], got 1.5"),
    (["parallel.offload_fraction=nan"], "parallel.offload_fraction", "must lie in (0, 1]"),
    (["parallel.offload=nvme"], "parallel.offload_path", "needs a directory"),
    (["parallel.offload=nvme", "parallel.offload_path=/etc/passwd/x"], "parallel.offload_path",
     "is not a writable directory"),
    (["parallel.fp8_recipe=blockwise"], "parallel.fp8_recipe", "'blockwise' is not one of"),
    (['parallel.fp8_tensors=["input", "activation"]'], "parallel.fp8_tensors",
     "'activation' is not one of"),
    (['parallel.fp8_tensors=["input", "input"]'], "parallel.fp8_tensors", "names a class twice"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "needs parallel.tp > 1"),
    (["parallel.vpp=2", "parallel.schedule=1f1b"], "parallel.vpp",
     "virtual stages need parallel.schedule = 'interleaved', 'zbv' or 'dualpipev', not '1f1b'"),
    (["parallel.schedule=zigzag"], "parallel.schedule", "'zigzag' is not one of"),
    (["parallel.vpp=2", "parallel.schedule=zb"], "parallel.vpp", "not 'zb'"),
    (["parallel.pp=8"], "parallel.pp", "8 pipeline stages but model.layers = 4: every stage"),
    (["parallel.pp=2", "parallel.vpp=4", "parallel.schedule=interleaved"], "parallel.vpp",
     "pp*vpp = 8 virtual stages but model.layers = 4"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "model.layers=6"],
     "parallel.vpp", "2 does not divide the 3 blocks per stage (model.layers 6 / pp 2)"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "model.layers=5"],
     "parallel.vpp", "model.layers = 5 does not split evenly over pp = 2"),
    (["parallel.pp=2", "parallel.stage_layers=[3, 3]"], "parallel.stage_layers",
     "must list pp*vpp = 2 block counts of at least 1 that sum to model.layers = 4"),
    (["parallel.stage_layers=3"], "parallel.stage_layers", "expected a list"),
    (["parallel.token_slices=4"], "parallel.token_slices", "set parallel.schedule = 'terapipe'"),
    (["parallel.schedule=terapipe", "parallel.token_slices=300"], "parallel.token_slices",
     "300 slices of a 256-token sequence"),
    (["parallel.recompute=partial"], "parallel.recompute", "'partial' is not one of"),
    (["parallel.precision=bf8"], "parallel.precision", "'bf8' is not one of"),
    (["parallel.cp_mode=star"], "parallel.cp_mode", "'star' is not one of"),
    (["parallel.tp=0"], "parallel.tp", "greater than zero"),
    (["parallel.micro_batch=0"], "parallel.micro_batch", "greater than zero"),
    (["parallel.global_batch=0"], "parallel.global_batch", "greater than zero"),
    # cluster (and its gpus used as the world size by plan/simulate)
    (["cluster.gpus=0"], "cluster.gpus", "greater than zero"),
    (["cluster.gpus=-2"], "cluster.gpus", "greater than zero"),
    (["cluster.gpus=6", "parallel.tp=4"], "parallel.tp", "tp*pp*cp = 4 does not divide the 6"),
    (["cluster.gpus_per_node=0"], "cluster.gpus_per_node", "greater than zero"),
    (["cluster.inter_node_GBps=-1"], "cluster.inter_node_GBps", "greater than zero"),
    # found by tests/test_config_fuzz.py: values that reached numpy, datetime or the model
    (["train.seed=-1"], "train.seed", "zero or more, got -1"),
    (["train.timeout_s=inf"], "train.timeout_s", "must be finite, got inf"),
    (["train.timeout_s=1e300"], "train.timeout_s", "beyond any wait"),
    (["train.lr=inf"], "train.lr", "must be finite, got inf"),
    (["train.grad_clip=inf"], "train.grad_clip", "must be finite, got inf"),
])
def test_rejected(overrides, key, fragment):
    rejects(key, fragment, *overrides)


def test_uint16_tokens_fit_exact_vocab_and_uint32_is_fine(tmp_path):
    ids = tmp_path / "ids.bin"
    ids.write_bytes(bytes(8))
    src = f'data.source="{ids}"'
    validate(load("model.vocab=65536", "data.format=tokens", src))
    validate(load("model.vocab=70000", "data.format=tokens", "data.token_dtype=uint32", src))
    validate(load("model.vocab=70000"))  # uint16 only matters for format "tokens"


def test_tokens_format_needs_one_file(tmp_path):
    for source in (str(tmp_path), "stdlib"):
        rejects("data.format", "is not a file", f'data.source="{source}"', "data.format=tokens")


@pytest.mark.parametrize("overrides, world_size, key, fragment", [
    (["parallel.zero_group=3"], 4, "parallel.zero_group",
     "3 does not divide the data-parallel degree 4; choose one of 1, 2, 4"),
    (["parallel.zero_group=2"], None, "parallel.zero_group", "data-parallel degree 1"),
    (["parallel.global_batch=10"], 4, "parallel.global_batch",
     "10 sequences do not split evenly over dp = 4 ranks; use a multiple of 4"),
    (["parallel.global_batch=16", "parallel.micro_batch=3"], 2, "parallel.micro_batch",
     "3 does not divide the 8 sequences per dp rank"),
    (["parallel.dp=4"], 2, "parallel.dp", "4 ranks of data parallelism, but 2 ranks"),
    (["parallel.dp=2", "parallel.tp=2"], 8, "parallel.dp", "= 4; omit parallel.dp"),
    (["parallel.tp=2", "parallel.pp=2"], 6, "parallel.tp", "tp*pp*cp = 4 does not divide"),
    (["parallel.cp=4"], 2, "parallel.tp", "tp*pp*cp = 4 does not divide the 2 ranks"),
    (["parallel.pp=2", "parallel.micro_batch=3"], 2, "parallel.micro_batch",
     "3 does not divide the 8 sequences per dp rank"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
      "parallel.global_batch=6", "parallel.micro_batch=2"], 2, "parallel.micro_batch",
     "3 per step (6 sequences per dp rank / micro_batch 2) must be a multiple of 2"),
    (["parallel.pp=2", "parallel.schedule=pipedream-2bw"], 4, "parallel.micro_batch",
     "PipeDream-2BW needs at least pp = 2 micro-batches per step, got 1"),
    (["parallel.pp=2", "parallel.weight_prediction=true"], 2, "parallel.weight_prediction",
     "offsets PipeDream-2BW's stale gradients"),
    (["parallel.schedule=pipedream-2bw", "parallel.weight_prediction=true"], 2,
     "parallel.weight_prediction", "use it with parallel.pp > 1"),
])
def test_rejected_with_world_size(overrides, world_size, key, fragment):
    rejects(key, fragment, *overrides, world_size=world_size)


def test_accepted_parallel_layouts():
    validate(load("parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"), 8)
    with pytest.raises(ConfigError, match="gpus_per_node"):  # 3 ranks a node, shard group of 4
        validate(load("parallel.zero_stage=3", "parallel.hpz=true", "cluster.gpus_per_node=3"), 4)
    validate(load("parallel.dp=2", "parallel.zero_group=2", "parallel.zero_stage=3"), 2)
    validate(load("parallel.vpp=2", "parallel.schedule=interleaved", "parallel.pp=2"), 2)
    validate(load("parallel.pp=2", "parallel.stage_layers=[3, 1]"), 2)
    validate(load("parallel.pp=4", "parallel.schedule=terapipe", "parallel.token_slices=8"), 4)
    validate(load("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                  "parallel.micro_batch=2"), 2)  # 4 micro-batches, a multiple of pp
    validate(load("parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=2"),
             4)
    validate(load("parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=2",
                  "parallel.weight_prediction=true"), 4)
    validate(load("parallel.micro_batch=4"), 2)
    validate(load("cluster.gpus=8", "parallel.tp=8"))


def test_config_file_missing(tmp_path):
    rejects("CONFIG", "does not exist", path=tmp_path / "nope.toml")


@pytest.mark.parametrize("name, text", [
    ("bad.toml", "[model\nlayers = 2\n"),
    ("bad2.toml", "layers = = 2\n"),
    ("bad.json", '{"model": {"layers": 2'),
])
def test_config_file_does_not_parse(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    rejects("CONFIG", "does not parse", path=path)


def test_config_file_binary(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xff\xfe\x00")
    rejects("CONFIG", "does not parse", path=path)


@pytest.mark.parametrize("text", ["[]", "[1]", "3", '"model"'])
def test_json_file_not_an_object(tmp_path, text):
    path = tmp_path / "run.json"
    path.write_text(text)
    rejects("CONFIG", "must hold a table of sections", path=path)


@pytest.mark.parametrize("text, key, fragment", [
    ("model = 3\n", "model", "expected a table of keys, got 3"),
    ("train = 3\n", "train", "expected a table of keys"),
    ("[optim]\nlr = 1\n", "optim", "unknown section"),
    ("[model]\nlayers = 'four'\n", "model.layers", "expected int"),
    ("[model.moe]\nexpertz = 4\n", "model.moe.expertz", "unknown key"),
])
def test_toml_file_rejected(tmp_path, text, key, fragment):
    path = tmp_path / "run.toml"
    path.write_text(text)
    rejects(key, fragment, path=path)


def test_data_paths_that_exist_are_accepted(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n")
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    validate(load(f'data.source="{corpus}"', f'data.tokenizer="{tok}"'))
    validate(load(f'data.source="{tmp_path}"'))  # a folder is fine
    # a folder is not a tokenizer file
    rejects("data.tokenizer", "does not exist", f'data.tokenizer="{tmp_path}"')


# ---------------------------------------------------------------- what training runs today

@pytest.mark.parametrize("overrides, world_size, key, fragment", [
    (["parallel.tp=8"], 8, "parallel.tp",
     "8 does not divide model.kv_heads = 4: each tensor-parallel rank needs whole key/value "
     "heads; choose tp among 1, 2, 4"),
    (["parallel.tp=3"], 3, "parallel.tp", "3 does not divide model.heads = 8"),
    (["parallel.tp=2", "model.ffn_hidden=701"], 2, "parallel.tp",
     "2 does not divide model.ffn_hidden = 701: each tensor-parallel rank needs whole MLP"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=255"], 2,
     "parallel.sequence_parallel", "model.seq_len = 255 does not split evenly over tp = 2"),
    (["parallel.pp=2", "parallel.zero_stage=3", "parallel.schedule='terapipe'"], 2,
     "parallel.schedule", "TeraPipe's token slices reach back"),
    (["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=3"], 4,
     "parallel.cp_ulysses", "set cp_ulysses to one of 1, 2, 4, got 3"),
    (["parallel.cp=4", "parallel.cp_mode=hybrid"], 4, "parallel.cp_ulysses",
     "runs a Ulysses degree times a ring degree on cp = 4 ranks"),
    (["parallel.cp=4", "model.seq_len=36"], 4, "model.seq_len",
     "cuts each sequence into 2 x ring = 8 equal chunks, each over 1 Ulysses rank(s), but "
     "seq_len is 36"),
    (["parallel.cp=16", "parallel.cp_mode=ulysses", "parallel.global_batch=16"], 16,
     "parallel.cp", "Ulysses gives each of its 16 ranks heads / 16 query heads"),
    (["parallel.cp=2", "parallel.cp_mode=ulysses", "model.heads=6", "model.kv_heads=3",
      "model.hidden=192"], 2, "parallel.cp",
     "choose a Ulysses degree dividing or divided by model.kv_heads"),
    (["parallel.cp=2", "parallel.pp=2", "parallel.schedule=terapipe"], 4, "parallel.schedule",
     "terapipe with context parallelism is not built"),
    (["parallel.cp=2", "parallel.pp=2", "parallel.schedule=pipedream-2bw",
      "parallel.micro_batch=2"], 4,
     "parallel.schedule", "pipedream-2bw with context parallelism is not built"),
    (["parallel.cp=4", "parallel.cp_mode=ulysses", "parallel.tp=4"], 16, "parallel.cp",
     "a tp rank holds 2 (model.heads 8 / tp 4)"),
    (["parallel.cp=8", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=4", "parallel.tp=4"],
     32, "parallel.cp_ulysses", "a tp rank holds 2 (model.heads 8 / tp 4)"),
    (["parallel.zero_group=2"], 2, "parallel.zero_group", "set parallel.zero_stage to 1, 2"),
    (["parallel.recompute=selective", "parallel.pp=2", "parallel.schedule=terapipe"], 2,
     "parallel.schedule", "'selective' is not supported with terapipe"),
    (["parallel.recompute=full", "parallel.pp=2", "parallel.schedule=pipedream-2bw",
      "parallel.micro_batch=1"], 2, "parallel.schedule", "not supported with pipedream-2bw"),
    (["parallel.precision=fp8", "parallel.fp8_emulate=false"], 1, "parallel.fp8_emulate",
     "this device has no fp8 matrix units"),
    (["parallel.precision=fp8", "train.optimizer=lomo"], 1, "train.optimizer",
     "keeps no fp32 master weights"),
    (["parallel.precision=fp8", "parallel.pp=2", "parallel.schedule=zb",
      "parallel.micro_batch=1"], 2, "parallel.schedule", "zero-bubble weight pass"),
    (["parallel.precision=fp8", "parallel.pp=2", "parallel.schedule=terapipe"], 2,
     "parallel.schedule", "TeraPipe's token slices would give each slice"),
    (["train.optimizer=lomo", "parallel.tp=2"], 2, "train.optimizer",
     "LOMO updates each parameter inside"),
    (["train.optimizer=lomo", "parallel.micro_batch=2"], 1, "parallel.micro_batch",
     "cannot accumulate micro-batches: leave micro_batch unset or set it to 8"),
    (["train.optimizer=lomo", "parallel.precision=fp16", "train.grad_clip=0"], 1,
     "train.grad_clip", "LOMO with fp16 loss scaling"),
    (["train.optimizer=galore", "parallel.cp=2"], 2, "train.optimizer",
     "GaLore runs with data, tensor and pipeline parallelism and ZeRO 0-3"),
    (["parallel.ep=2"], 2, "parallel.ep", "needs model.moe"),
])
def test_validate_for_training_rejects(overrides, world_size, key, fragment):
    cfg = load(*overrides)
    validate(cfg, world_size)  # fine for plan/simulate
    rejects(key, fragment, *overrides, world_size=world_size, training=True)


def test_validate_for_training_accepts_runnable_configs():
    validate_for_training(load("train.optimizer=sgd", "parallel.precision=bf16"), 1)
    validate_for_training(load("train.optimizer=muon"), 1)
    validate_for_training(load("parallel.precision=fp8", "parallel.fp8_emulate=false"), 1,
                          fp8_units=True)
    validate_for_training(load("train.optimizer=lomo", "parallel.micro_batch=8"), 1)
    validate_for_training(load("train.optimizer=galore"), 1)
    validate_for_training(load("parallel.recompute=full", "parallel.zero_stage=2"), 2)
    validate_for_training(load("parallel.cp=2"), 2)
    validate_for_training(load("parallel.cp=4", "parallel.cp_mode=ulysses"), 8)
    validate_for_training(load("parallel.cp=4", "parallel.cp_mode=hybrid",
                               "parallel.cp_ulysses=2"), 4)
    validate_for_training(load("parallel.recompute=full", "parallel.pp=2",
                               "parallel.schedule=interleaved", "parallel.vpp=2",
                               "parallel.micro_batch=2"), 2)
    validate_for_training(load("train.optimizer=muon", "parallel.pp=2"), 4)  # DDP engine
    validate_for_training(load("train.optimizer=muon", "parallel.zero_stage=3",
                               "parallel.tp=2", "parallel.sequence_parallel=true"), 4)
    validate_for_training(load("train.optimizer=muon", "model.moe.experts=4",
                               "model.moe.expert_ffn_hidden=64", "parallel.ep=2"), 2)
    validate_for_training(load("train.optimizer=muon", "parallel.pp=2",
                               "parallel.schedule=pipedream-2bw", "parallel.micro_batch=2"),
                          4)  # pp 2 x dp 2
    validate_for_training(load("parallel.micro_batch=2", "parallel.global_batch=8"), 2)
    validate_for_training(load("parallel.tp=4", "parallel.sequence_parallel=true"), 8)
    # a vocabulary that tp does not divide is padded, not rejected
    validate_for_training(load("parallel.tp=2", "model.vocab=8191"), 2)


def test_config_error_is_value_error():
    err = ConfigError("train.lr", "bad")
    assert isinstance(err, ValueError)
    assert err.key == "train.lr"
    assert str(err) == "config error in `train.lr`: bad"


# ---------------------------------------------------------------- docs/config.md

def _docs_script():
    spec = importlib.util.spec_from_file_location("config_docs",
                                                  ROOT / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_match_code():
    text = _docs_script().render()
    docs = ROOT / "docs" / "config.md"
    assert docs.read_text() == text, (
        "docs/config.md is stale; regenerate it with "
        "`PYTHONPATH=src python scripts/config_docs.py --write`")


def test_docs_cover_every_key():
    import dataclasses

    from fivefold.config import MoEConfig
    text = _docs_script().render()
    for section in dataclasses.fields(Config):
        assert f"## `[{section.name}]`" in text
        for f in dataclasses.fields(section.default_factory()):
            assert f"| `{f.name}` |" in text, f"{section.name}.{f.name}"
    for f in dataclasses.fields(MoEConfig):
        assert f"| `{f.name}` |" in text, f"model.moe.{f.name}"
    assert "status 2" in text
    assert "--set section.key=value" in text


def test_a_huge_head_count_is_refused_at_once():
    """The message's divisor list is found up to sqrt(n) and cut at 16: a drawn 2**40 heads
    (tests/test_config_fuzz.py) had stalled the check that names it for hours (the suite's
    timeout would fail it)."""
    with pytest.raises(ConfigError, match="model.kv_heads") as err:
        validate(load_config(None, [f"model.heads={2**40}", "model.kv_heads=3",
                                    "model.head_dim=64"]))
    assert "..., 1099511627776" in str(err.value)

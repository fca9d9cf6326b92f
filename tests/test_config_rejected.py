"""Inputs the config refuses before any rank starts: each names its key and the fix (values,
combinations, world sizes, files that are missing, binary or do not parse, data paths)."""

from __future__ import annotations

import pytest

from fivefold.config import ConfigError
from fivefold.validate import validate

from config_checks import load, rejects


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

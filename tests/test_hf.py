"""Hugging Face import and export (fivefold.models.hf, fivefold.models.pretrained,
fivefold.train.model_source, fivefold.train.checkpoint_export).

Each family's model is made here by `transformers` from a tiny random config (nothing is
downloaded), its weights re-drawn larger than transformers' init so that every layer moves
the logits, and saved with `save_pretrained` (also sharded).

Tolerances: logits are compared in fp32 on the CPU with rtol 1e-4 and atol 1e-5 against
logits of magnitude about 1-10. The two implementations compute the same function and differ
only in rounding (fivefold's RoPE angles are computed in fp64, transformers' in fp32; the
operations run in a different order); the measured gap is below 1e-5. Round trips
(HF -> fivefold -> HF) are bit-exact: same names, dtypes and bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fivefold import cli  # noqa: E402
from fivefold.config import ConfigError, apply_override, load_config  # noqa: E402
from fivefold.models.hf import CheckpointError, read_hf_tensors  # noqa: E402
from fivefold.models.llama import Transformer, build_model  # noqa: E402
from fivefold.models.pretrained import Pretrained, write_weights_folder  # noqa: E402
from fivefold.train.checkpoint_export import _join_flat_units  # noqa: E402
from fivefold.train.dist import Runtime  # noqa: E402
from fivefold.train.model_source import (convert, init_from_overrides,  # noqa: E402
                                         load_pretrained)
from fivefold.train.trainer import Trainer  # noqa: E402

CPU = Runtime(0, 1, 0, torch.device("cpu"))
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=48)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, head_dim=32,
                                                      rope_theta=5e5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rms_norm_eps=1e-5)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4,
                                                            num_experts_per_tok=2)),
}


def hf_model(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def save(model, folder: Path, shard: str | None = None, dtype=None) -> Path:
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def fivefold_model(pre: Pretrained) -> Transformer:
    model = Transformer(pre.cfg)
    model.load_state_dict(pre.state, strict=True)
    return model.eval()


def logits_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.abs().max() > 1.0  # the comparison is not one of near-zero numbers
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_matches_transformers_logits(family, tmp_path):
    model = hf_model(family)
    folder = save(model, tmp_path / family, shard="40KB")
    assert (folder / "model.safetensors.index.json").is_file()  # sharded input
    pre = load_pretrained(folder)
    seq = pre.cfg.seq_len
    assert seq == (24 if family == "mistral" else 48)  # a sliding window caps seq_len
    tokens = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_close(fivefold_model(pre)(tokens), model(tokens).logits)
    assert pre.cfg.qkv_bias == (family == "qwen2")
    assert (pre.cfg.moe is not None) == (family == "mixtral")
    if family == "llama":
        assert pre.cfg.tied_embeddings and pre.cfg.d_head == 32 and pre.cfg.rope_theta == 5e5


@pytest.mark.parametrize("family,dtype", [("llama", None), ("mistral", torch.bfloat16),
                                          ("qwen2", None), ("mixtral", torch.bfloat16)])
def test_round_trip_is_bit_exact(family, dtype, tmp_path):
    source = save(hf_model(family), tmp_path / "hf", shard="40KB", dtype=dtype)
    convert(source, tmp_path / "ff")  # default: HF -> fivefold
    assert {p.name for p in (tmp_path / "ff").iterdir()} >= {"config.toml", "model.safetensors"}
    convert(tmp_path / "ff", tmp_path / "back", shard_bytes=30_000)  # default: fivefold -> HF
    a, b = read_hf_tensors(source), read_hf_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config == json.loads((source / "config.json").read_text())


@pytest.mark.parametrize("features", [{}, {"qkv_bias": True}, {"moe": True}])
def test_export_of_a_fivefold_model_loads_in_transformers(features, tmp_path):
    from fivefold.config import ModelConfig, MoEConfig

    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=96,
                      seq_len=16, tied_embeddings=not features, rope_theta=1e4, norm_eps=1e-5,
                      qkv_bias=bool(features.get("qkv_bias")),
                      moe=MoEConfig(experts=3, top_k=2) if features.get("moe") else None)
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    (tmp_path / "ff").mkdir()
    write_weights_folder(tmp_path / "ff", Pretrained(cfg, model.state_dict(), None, tmp_path))
    _, fmt = convert(tmp_path / "ff", tmp_path / "hf")
    assert fmt == "hf"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    expected = "mixtral" if features.get("moe") else "qwen2" if features else "llama"
    assert config["model_type"] == expected
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits_close(model(tokens), loaded(tokens).logits)


def test_training_checkpoints_export(tiny_overrides, tmp_path):
    """A one-rank run (named tensors) and a ZeRO-1 run (flat units) both export the weights
    the trainer holds, bit for bit."""
    for name, extra in (("plain", []), ("zero1", ["parallel.zero_stage=1"])):
        cfg = load_config(None, tiny_overrides + extra + ["train.steps=2", "train.eval_every=2",
                                                          "train.sample_tokens=0"])
        trainer = Trainer(cfg, CPU, tmp_path / name)
        trainer.run()
        convert(tmp_path / name, tmp_path / f"{name}-hf")
        pre = load_pretrained(tmp_path / f"{name}-hf")
        for key, value in trainer.model.state_dict().items():
            assert torch.equal(pre.state[key], value.detach()), (name, key)


def test_flat_unit_shards_are_joined(tmp_path):
    """Two data-parallel shards of each unit, padded at the end, give back every parameter."""
    from fivefold.config import ModelConfig
    from fivefold.parallel.data_parallel import split_units

    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=40, vocab=67,
                      seq_len=8)
    model = build_model(cfg, seed=5)
    flat = {}
    for unit, params, _ in split_units(model):
        buffer = torch.cat([p.detach().reshape(-1) for _, p in params])
        buffer = torch.cat([buffer, torch.zeros(buffer.numel() % 2)])  # pad to 2 shards
        for r, piece in enumerate(buffer.chunk(2)):
            flat[f"master.{unit}.shard{r}of2"] = piece
    state = _join_flat_units(flat, cfg, tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


def test_init_from_hf_folder_trains_from_those_weights(tiny_overrides, tmp_path):
    """--init-from: the run takes the folder's shape, its weights are loaded exactly, and the
    trainer's validation loss equals that of the transformers model (fp32, rtol 1e-5)."""
    model = hf_model("llama", tie_word_embeddings=False, head_dim=16, vocab_size=512,
                     max_position_embeddings=32)
    folder = save(model, tmp_path / "hf")
    raw: dict = {}
    for assignment in tiny_overrides:
        apply_override(raw, assignment)
    cfg = load_config(None, tiny_overrides + init_from_overrides(folder, raw))
    assert cfg.model.tied_embeddings is False and cfg.model.norm_eps == 1e-6
    trainer = Trainer(cfg, CPU, tmp_path / "run", init_from=folder)
    imported = load_pretrained(folder).state
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, imported[name]), name
    val = trainer.evaluate()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = model

        def forward(self, tokens):
            return self.hf(tokens).logits

    trainer.model = Logits()
    assert val == pytest.approx(trainer.evaluate(), rel=1e-5)

    # the same through the command line: the run starts from those weights; the folder has
    # no tokenizer, so the run names the one the Trainer above trained (a new one is refused)
    tokenizer = tmp_path / "tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir()
    trainer.data.tokenizer.save(str(tokenizer))
    sets = [arg for o in tiny_overrides + [f"data.tokenizer='{tokenizer}'"] for arg in ("--set", o)]
    assert cli.main(["train", "--init-from", str(folder), "--steps", "2", "--run-dir",
                     str(tmp_path / "cli"), *sets]) == 0
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(val, rel=1e-9)


def test_init_from_rejects_disagreeing_model_keys(tmp_path, capsys):
    folder = save(hf_model("llama"), tmp_path / "hf")
    code = cli.main(["train", "--init-from", str(folder), "--set", "model.layers=3",
                     "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "model.layers" in err and "2" in err and "3" in err
    with pytest.raises(ConfigError, match="model.seq_len"):
        init_from_overrides(folder, {"model": {"seq_len": 4096}})
    with pytest.raises(ConfigError, match="model.preset"):
        init_from_overrides(folder, {"model": {"preset": "1B"}})
    assert "model.seq_len=16" not in init_from_overrides(folder, {"model": {"seq_len": 16}})


def test_convert_cli(tmp_path, capsys):
    folder = save(hf_model("qwen2"), tmp_path / "hf")
    assert cli.main(["convert", str(folder), str(tmp_path / "ff")]) == 0
    assert "q/k/v biases" in capsys.readouterr().out
    assert cli.main(["convert", str(tmp_path / "ff"), str(tmp_path / "ff")]) == 2
    assert "already exists" in capsys.readouterr().err


# ------------------------------------------------------------------ bad input

def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     "model_type 'gpt2'.*not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters.*llama3"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.*linear"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"intermediate_size": 100}, r"mlp.w1.weight has shape \(96, 64\).*\(100, 64\)"),
    ({"num_key_value_heads": 3}, "kv_heads"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_bad_hf_config_is_named(change, message, tmp_path):
    folder = save(hf_model("llama", tie_word_embeddings=False, head_dim=None), tmp_path / "hf")
    _edit_config(folder, **change)
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(folder)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        convert(tmp_path, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="does not exist"):
        convert(tmp_path / "missing", tmp_path / "out")
    folder = save(hf_model("mistral"), tmp_path / "hf", shard="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}"):
        load_pretrained(folder)
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(folder / "config.json", only_config / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_pretrained(only_config)


def test_qwen2_sliding_window_only_when_used(tmp_path):
    """Qwen2 slides only with use_sliding_window and only from layer max_window_layers on."""
    for slide, from_layer, seq_len in ((False, 1, 48), (True, 2, 48), (True, 1, 16)):
        folder = save(hf_model("qwen2", sliding_window=16, use_sliding_window=slide,
                               max_window_layers=from_layer), tmp_path / f"{slide}{from_layer}")
        assert load_pretrained(folder).cfg.seq_len == seq_len
        config = json.loads((folder / "config.json").read_text())
        del config["layer_types"]  # as written before transformers 5: the same rule applies
        config["sliding_window"] = 16
        (folder / "config.json").write_text(json.dumps(config))
        assert load_pretrained(folder).cfg.seq_len == seq_len

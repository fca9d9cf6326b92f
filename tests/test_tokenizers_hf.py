"""Any `tokenizers` tokenizer, and the Hugging Face round trip with it
(fivefold.train.special_tokens, fivefold.train.model_source, fivefold.generate_command).

Two tokenizers are built here with HF `tokenizers` (nothing is downloaded), each beside a
tiny random Llama that transformers makes from a LlamaConfig:

* Llama 1/2 style: `<unk> <s> </s>`, tokenizer_config.json saying add_bos_token but naming
  no eos, config.json's eos_token_id = 2 (`</s>`);
* Llama 3 style: `<|begin_of_text|> <|end_of_text|>`, a post-processor that prepends
  `<|begin_of_text|>`, no tokenizer_config.json and no token ids in config.json, so that the
  end-of-document token is found by its name.

The round trip: `fivefold train --init-from` the folder for two steps, `fivefold convert` the
run to a Hugging Face folder, load model and tokenizer with transformers' Auto classes, and
compare transformers' greedy `generate` with `fivefold generate` of the run and of the
converted folder (and of a fivefold weights folder converted from it): the same token ids,
exactly (greedy decoding of the same fp32 function; the logits agree to about 1e-5,
tests/test_hf.py, and the weights are drawn large so that no two top logits are that close).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402
from tokenizers import trainers  # noqa: E402

from fivefold import cli  # noqa: E402
from fivefold.config import ConfigError, load_config  # noqa: E402
from fivefold.generate_command import generate  # noqa: E402
from fivefold.train.corpus import Document  # noqa: E402
from fivefold.train.data import prepare_data  # noqa: E402
from fivefold.train.model_source import convert, init_from_overrides  # noqa: E402
from fivefold.train.special_tokens import (SpecialTokens, special_tokens,  # noqa: E402
                                           write_tokenizer_folder)
from fivefold.train.tokenizer import EOS, train_tokenizer  # noqa: E402

VOCAB = 320
PROMPT = "def main():\n    return"
STYLES = {
    "llama2": dict(specials=["<unk>", "<s>", "</s>"], prepend=None,
                   tokenizer_config={"add_bos_token": True, "bos_token": "<s>",
                                     "tokenizer_class": "PreTrainedTokenizerFast"},
                   ids=dict(bos_token_id=1, eos_token_id=2), bos="<s>", eos="</s>"),
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>"], prepend="<|begin_of_text|>",
                   tokenizer_config=None, ids=dict(bos_token_id=None, eos_token_id=None),
                   bos="<|begin_of_text|>", eos="<|end_of_text|>"),
}


def corpus_text(corpus: Path) -> list[str]:
    return [p.read_text() for p in sorted(corpus.glob("*.py"))[:10]]


def byte_level_bpe(texts: list[str], specials: list[str], prepend: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if prepend is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{prepend} $A", special_tokens=[(prepend, tok.token_to_id(prepend))])
    return tok


def llama_folder(folder: Path, style: str, texts: list[str]) -> Path:
    """A Hugging Face folder: a tiny random Llama and a tokenizer in the given style."""
    s = STYLES[style]
    tok = byte_level_bpe(texts, s["specials"], s["prepend"])
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=48,
                                      tie_word_embeddings=False, **s["ids"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    if s["tokenizer_config"] is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(s["tokenizer_config"]))
    return folder


def run_sets(corpus: Path, cache: Path) -> list[str]:
    sets = [f"data.source='{corpus}'", f"data.cache_dir='{cache}'", "data.val_fraction=0.1",
            "parallel.global_batch=4", "train.tensorboard=false", "train.sample_tokens=0",
            "train.log_every=1000", "train.lr=1e-3", "train.warmup_steps=1"]
    return [arg for s in sets for arg in ("--set", s)]


@pytest.mark.parametrize("style", STYLES)
def test_hf_round_trip_generates_what_transformers_generates(style, small_corpus, tmp_path,
                                                             capsys):
    s = STYLES[style]
    source = llama_folder(tmp_path / "hf", style, corpus_text(small_corpus))
    run, out = tmp_path / "run", tmp_path / "out"
    assert cli.main(["train", "--init-from", str(source), "--steps", "2", "--run-dir", str(run),
                     *run_sets(small_corpus, tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    assert f"parameters from Hugging Face llama folder {source}\n" in printed
    assert f"model from Hugging Face llama folder {source}:" in printed
    assert cli.main(["convert", str(run), str(out)]) == 0
    assert "note" not in capsys.readouterr().out  # the tokenizer went along

    config = json.loads((out / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == (s["bos"], s["eos"])
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id,
                                                                tok.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    hf_prompt = tok(PROMPT)["input_ids"]
    assert hf_prompt[0] == tok.bos_token_id  # both families start a sequence with bos
    with torch.no_grad():
        hf_ids = model.generate(torch.tensor([hf_prompt]), max_new_tokens=12, do_sample=False,
                                pad_token_id=tok.eos_token_id)[0].tolist()
    assert len(hf_ids) > len(hf_prompt)
    for where in (run, out):  # the run's checkpoint and the converted folder
        prompt_ids, ids, _ = generate(where, PROMPT, max_new_tokens=12, device="cpu")
        assert prompt_ids == hf_prompt and ids == hf_ids, where
    assert cli.main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "12",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out == tok.decode(hf_ids, skip_special_tokens=True) + "\n"

    # a fivefold weights folder carries the tokenizer too, and so does its export
    convert(out, tmp_path / "ff")
    assert generate(tmp_path / "ff", PROMPT, max_new_tokens=12, device="cpu")[1] == hf_ids
    convert(tmp_path / "ff", tmp_path / "hf2")
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2")
    assert (again.bos_token, again.eos_token, again(PROMPT)["input_ids"]) == (
        s["bos"], s["eos"], hf_prompt)
    # --init-from the run takes the run's tokenizer
    assert f"data.tokenizer=\"{run / 'tokenizer' / 'tokenizer.json'}\"" in init_from_overrides(
        run, {})


def test_documents_are_laid_out_as_the_family_does(small_corpus, tmp_path):
    """bos (where the family adds it) + the document + eos, whichever file names them."""
    texts = corpus_text(small_corpus)
    for style in STYLES:
        s = STYLES[style]
        folder = llama_folder(tmp_path / style, style, texts)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        special = special_tokens(tok, folder)
        bos, eos = tok.token_to_id(s["bos"]), tok.token_to_id(s["eos"])
        assert special == SpecialTokens(s["eos"], eos, s["bos"], bos, True)
        plain = tok.encode("x = 1", add_special_tokens=False).ids
        assert special.document(plain) == [bos, *plain, eos]
    with pytest.raises(ConfigError, match="data.eos_token"):  # a name it does not have
        special_tokens(tok, folder, "</s>")
    assert special_tokens(tok, folder, "<|begin_of_text|>").eos == "<|begin_of_text|>"
    # tokenizer_config.json's add_bos_token overrules the post-processor, as in transformers
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    special = special_tokens(tok, folder)
    assert special.add_bos is False and special.document(plain) == [*plain, eos]
    write_tokenizer_folder(tmp_path / "out", tok, special, 48, folder)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("x = 1")[
        "input_ids"] == plain


def test_builtin_bpe_streams_are_unchanged():
    """The built-in BPE: no bos, `<|endoftext|>` after each document, the ids `encode` gives."""
    docs = [Document(f"d{i}", f"def f{i}(x):\n    return x * {i}\n") for i in range(30)]
    tok = train_tokenizer(docs, 300, 1.0)
    special = special_tokens(tok, None)
    assert special == SpecialTokens(EOS, tok.token_to_id(EOS), None, None, False)
    for d in docs:
        assert special.document(tok.encode(d.text, add_special_tokens=False).ids) == [
            *tok.encode(d.text).ids, tok.token_to_id(EOS)]


def test_a_tokenizer_without_an_end_of_document_token_is_refused(small_corpus, tmp_path,
                                                                 capsys):
    tok = byte_level_bpe(corpus_text(small_corpus), ["<pad>"], None)
    (tmp_path / "tok").mkdir()
    path = tmp_path / "tok" / "tokenizer.json"
    tok.save(str(path))
    sets = ["model.layers=1", "model.hidden=32", "model.heads=2", "model.ffn_hidden=32",
            f"model.vocab={VOCAB}", "model.seq_len=16", f"data.tokenizer='{path}'",
            f"data.source='{small_corpus}'", f"data.cache_dir='{tmp_path / 'cache'}'"]
    with pytest.raises(ConfigError, match="data.eos_token") as err:
        prepare_data(load_config(None, sets))
    assert "<|endoftext|>" in str(err.value) and "--set data.eos_token=" in str(err.value)
    code = cli.main(["train", "--run-dir", str(tmp_path / "run"),
                     *[arg for s in sets for arg in ("--set", s)]])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err_lines) == 1 and "data.eos_token" in err_lines[0]
    data = prepare_data(load_config(None, sets + ["data.eos_token='<pad>'"]))
    assert data.special.eos == "<pad>" and data.train[-1] == tok.token_to_id("<pad>")


def test_init_from_a_folder_without_a_tokenizer_is_refused(small_corpus, tmp_path, capsys):
    folder = llama_folder(tmp_path / "hf", "llama2", corpus_text(small_corpus))
    (folder / "tokenizer.json").unlink()
    code = cli.main(["train", "--init-from", str(folder), "--run-dir", str(tmp_path / "run"),
                     *run_sets(small_corpus, tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 2 and "data.tokenizer" in err and "--init-from" in err
    assert not (tmp_path / "run").exists()  # refused before anything ran
    assert cli.main(["generate", str(folder), "--prompt", "x"]) == 2  # nothing to encode with
    assert "no tokenizer.json" in capsys.readouterr().err

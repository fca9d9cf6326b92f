"""Corpus, token caches and the data checks (the tokenizer: tests/test_tokenizer.py; the batch
sampler: tests/test_batch_sampler.py)."""

from __future__ import annotations

import json
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError, DataConfig, load_config
from fivefold.train.corpus import (TEXT_CHUNK_CHARS, Document, detect_format, is_validation,
                                   jsonl_documents, load_documents, split_documents,
                                   stdlib_documents, text_documents)
from fivefold.train.data import BatchSampler, TokenData, check_data, prepare_data
from fivefold.train.tokenizer import EOS, eos_id

from text_samples import SAMPLES

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
        "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32"]


def names_in_split(n: int, val: bool, val_fraction: float, prefix: str = "doc") -> list[str]:
    """`n` document names that the hash split puts in validation (val=True) or training."""
    out, i = [], 0
    while len(out) < n:
        name = f"{prefix}{i}.txt"
        if is_validation(Document(name, ""), val_fraction) == val:
            out.append(name)
        i += 1
    return out


def paragraph(i: int) -> str:
    return (f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7} times.\n"
            f"def func_{i}(a, b):\n    return a * {i} + b\n\n")


# ---------------------------------------------------------------- corpus

@pytest.fixture(scope="module")
def stdlib_docs():
    return stdlib_documents()


def test_stdlib_documents(stdlib_docs):
    assert len(stdlib_docs) > 1000
    names = [d.name for d in stdlib_docs]
    assert len(set(names)) == len(names)
    assert not any("site-packages" in Path(n).parts for n in names)
    assert all(n.endswith(".py") and not Path(n).is_absolute() for n in names)
    assert "os.py" in names and "json/__init__.py" in names
    root = Path(sysconfig.get_paths()["stdlib"])
    assert next(d for d in stdlib_docs if d.name == "os.py").text == (root / "os.py").read_text()


def test_split_is_deterministic_disjoint_and_proportional(stdlib_docs):
    train, val = split_documents(stdlib_docs, 0.1)
    train2, val2 = split_documents(list(reversed(stdlib_docs)), 0.1)
    assert {d.name for d in train} == {d.name for d in train2}
    assert {d.name for d in val} == {d.name for d in val2}
    assert not {d.name for d in train} & {d.name for d in val}
    assert len(train) + len(val) == len(stdlib_docs)
    assert len(val) / len(stdlib_docs) == pytest.approx(0.1, abs=0.03)
    # a document's side does not depend on the rest of the corpus
    sub_train, sub_val = split_documents(stdlib_docs[::3], 0.1)
    assert {d.name for d in sub_val} == {d.name for d in val} & {d.name for d in stdlib_docs[::3]}
    # a larger fraction only moves documents into validation
    _, val_big = split_documents(stdlib_docs, 0.3)
    assert {d.name for d in val} <= {d.name for d in val_big}
    assert len(val_big) / len(stdlib_docs) == pytest.approx(0.3, abs=0.04)


@pytest.mark.parametrize("to_val", [True, False])
def test_split_keeps_one_document_on_each_side(to_val):
    docs = [Document(n, "text") for n in names_in_split(3, to_val, 0.2)]
    train, val = split_documents(docs, 0.2)
    assert train and val, (train, val)
    assert len(train) + len(val) == 3
    assert split_documents(docs, 0.2) == (train, val)
    # a single document cannot be split
    assert sum(map(len, split_documents(docs[:1], 0.2))) == 1


def test_text_documents_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "a.txt").write_text("nested alpha")
    (tmp_path / "b.md").write_text("日本語 😀")
    docs = text_documents(tmp_path)
    assert [d.name for d in docs] == ["a.txt", "b.md", str(Path("sub") / "a.txt")]
    assert [d.text for d in docs] == ["alpha", "日本語 😀", "nested alpha"]


def test_text_documents_rejects_non_utf8(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe bytes")
    with pytest.raises(ConfigError) as info:
        text_documents(tmp_path)
    assert info.value.key == "data.source" and "bad.txt" in str(info.value)


def test_text_documents_long_file_is_chunked_at_lines(tmp_path):
    lines = [f"line {i} " + "word " * (i % 23) + "\n" for i in range(40000)]
    text = "".join(lines)
    assert len(text) > 4 * TEXT_CHUNK_CHARS
    path = tmp_path / "big.txt"
    path.write_text(text)
    docs = text_documents(path)
    assert len(docs) == pytest.approx(len(text) / TEXT_CHUNK_CHARS, abs=1.5)
    assert "".join(d.text for d in docs) == text
    assert [d.name for d in docs] == [f"big.txt#{i}" for i in range(len(docs))]
    for d in docs[:-1]:
        assert d.text.endswith("\n")
        assert TEXT_CHUNK_CHARS <= len(d.text) <= TEXT_CHUNK_CHARS + 200
    # a small file is one document; a file with no newline at all stays whole
    (tmp_path / "small.txt").write_text("just one line")
    assert text_documents(tmp_path / "small.txt") == [Document("small.txt#0", "just one line")]
    (tmp_path / "oneline.txt").write_text("x" * (2 * TEXT_CHUNK_CHARS + 5))
    assert len(text_documents(tmp_path / "oneline.txt")) == 1


def test_jsonl_documents_with_custom_field(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"body": "first 😀", "id": 1}, {"body": "second\nline", "meta": {"x": 1}}]
    path.write_text(json.dumps(rows[0]) + "\n\n   \n" + json.dumps(rows[1], ensure_ascii=False)
                    + "\n")
    docs = jsonl_documents(path, "body")
    assert [d.text for d in docs] == ["first 😀", "second\nline"]
    assert [d.name for d in docs] == ["data.jsonl:1", "data.jsonl:4"]
    cfg = DataConfig(source=str(path), text_field="body")
    assert detect_format(cfg) == "jsonl"
    assert load_documents(cfg) == docs


def test_jsonl_folder_reads_only_jsonl_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "A"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "B1"}\n{"text": "B2"}\n')
    (tmp_path / "notes.txt").write_text("not part of the corpus")
    cfg = DataConfig(source=str(tmp_path))
    assert detect_format(cfg) == "jsonl"
    assert [d.text for d in load_documents(cfg)] == ["A", "B1", "B2"]


@pytest.mark.parametrize("line,key", [
    ('{"text": "ok"', "data.source"),  # truncated JSON
    ("not json at all", "data.source"),
    ('{"content": "wrong field"}', "data.text_field"),
    ('{"text": 42}', "data.text_field"),  # not a string
    ('["text"]', "data.text_field"),  # not an object
])
def test_jsonl_errors(tmp_path, line, key):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError) as info:
        jsonl_documents(path, "text")
    assert info.value.key == key
    assert "bad.jsonl:2" in str(info.value)


def test_detect_format(tmp_path):
    (tmp_path / "t.txt").write_text("x")
    (tmp_path / "ids.bin").write_bytes(b"\0\0")
    (tmp_path / "ids.tokens").write_bytes(b"\0\0")
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "textdir").mkdir()
    (tmp_path / "textdir" / "a.txt").write_text("x")
    (tmp_path / "jdir" / "deep").mkdir(parents=True)
    (tmp_path / "jdir" / "deep" / "a.jsonl").write_text('{"text": "x"}\n')

    def fmt(source, format="auto"):
        return detect_format(DataConfig(source=str(source), format=format))

    assert fmt("stdlib") == "stdlib"
    assert fmt(tmp_path / "t.txt") == "text"
    assert fmt(tmp_path / "ids.bin") == "tokens"
    assert fmt(tmp_path / "ids.tokens") == "tokens"
    assert fmt(tmp_path / "d.jsonl") == "jsonl"
    assert fmt(tmp_path / "textdir") == "text"
    assert fmt(tmp_path / "jdir") == "jsonl"
    assert fmt(tmp_path / "t.txt", "jsonl") == "jsonl"  # an explicit format wins
    assert fmt(tmp_path / "ids.bin", "text") == "text"


def test_load_documents_empty_folder(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_documents(DataConfig(source=str(tmp_path)))
    assert info.value.key == "data.source"


# ---------------------------------------------------------------- prepare_data

@pytest.fixture
def text_folder(tmp_path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(30):
        (root / f"doc{i:02d}.txt").write_text("".join(paragraph(i * 10 + j) for j in range(6)))
    (root / "unicode.txt").write_text(SAMPLES["unicode.txt"] * 3)
    return root


def data_cfg(source: Path, cache: Path, *extra: str):
    return load_config(None, TINY + [f"data.source='{source}'", f"data.cache_dir='{cache}'",
                                     "data.val_fraction=0.2", *extra])


def test_prepare_data_builds_and_reuses_caches(text_folder, tmp_path):
    cache = tmp_path / "cache"
    cfg = data_cfg(text_folder, cache)
    logs: list[str] = []
    data = prepare_data(cfg, log=logs.append)
    assert any("training" in m for m in logs) and any("tokenizing" in m for m in logs)
    files = sorted(cache.iterdir())
    names = [f.name for f in files]
    assert len(files) == 3, names
    assert sum(n.startswith("tokenizer-") and n.endswith(".json") for n in names) == 1
    assert sum(n.endswith("-train.npy") for n in names) == 1
    assert sum(n.endswith("-val.npy") for n in names) == 1
    assert not any(n.endswith(".tmp") for n in names)

    assert data.train.dtype == np.uint16 and data.val.dtype == np.uint16
    assert len(data.train) > len(data.val) >= cfg.model.seq_len + 1
    tok = data.tokenizer
    assert tok.get_vocab_size() <= cfg.model.vocab
    # the train stream is exactly the train documents, each followed by EOS
    train_docs, val_docs = split_documents(load_documents(cfg.data), 0.2)
    eos = eos_id(tok)
    assert int((np.asarray(data.train) == eos).sum()) == len(train_docs)
    assert int((np.asarray(data.val) == eos).sum()) == len(val_docs)
    assert data.train[-1] == eos
    decoded = tok.decode(np.asarray(data.train).tolist(), skip_special_tokens=False)
    assert decoded == "".join(d.text + EOS for d in train_docs)

    mtimes = {f: f.stat().st_mtime_ns for f in files}
    time.sleep(0.05)
    logs.clear()
    again = prepare_data(cfg, log=logs.append)
    assert logs == []
    assert sorted(cache.iterdir()) == files
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)
    assert again.tokenizer.to_str() == tok.to_str()


def test_prepare_data_cache_is_keyed_by_corpus_and_vocab(text_folder, tmp_path):
    cache = tmp_path / "cache"
    prepare_data(data_cfg(text_folder, cache), log=lambda m: None)
    assert len(list(cache.iterdir())) == 3
    prepare_data(data_cfg(text_folder, cache, "model.vocab=400"), log=lambda m: None)
    assert len(list(cache.iterdir())) == 6
    (text_folder / "doc00.txt").write_text("changed " + paragraph(99) * 3)
    prepare_data(data_cfg(text_folder, cache), log=lambda m: None)
    assert len(list(cache.iterdir())) == 9


def test_prepare_data_jsonl_source(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"body": paragraph(i) * 2}) + "\n" for i in range(60)))
    cfg = data_cfg(path, tmp_path / "cache", "data.text_field='body'")
    data = prepare_data(cfg, log=lambda m: None)
    assert len(data.train) > len(data.val) > cfg.model.seq_len
    bad = data_cfg(path, tmp_path / "cache", "data.text_field='text'")
    with pytest.raises(ConfigError) as info:
        prepare_data(bad, log=lambda m: None)
    assert info.value.key == "data.text_field"


def test_prepare_data_too_little_validation_data(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    train_name, = names_in_split(1, False, 0.2)
    val_name, = names_in_split(1, True, 0.2)
    (root / train_name).write_text("".join(paragraph(i) for i in range(40)))
    (root / val_name).write_text("tiny")
    with pytest.raises(ConfigError) as info:
        prepare_data(data_cfg(root, tmp_path / "cache"), log=lambda m: None)
    assert info.value.key == "data.val_fraction"
    assert "validation" in str(info.value) and "33" in str(info.value)


def test_prepare_data_too_little_training_data(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    train_name, = names_in_split(1, False, 0.2)
    val_name, = names_in_split(1, True, 0.2)
    (root / train_name).write_text("tiny")
    (root / val_name).write_text("".join(paragraph(i) for i in range(40)))
    with pytest.raises(ConfigError) as info:
        prepare_data(data_cfg(root, tmp_path / "cache"), log=lambda m: None)
    assert info.value.key == "data.source"


def test_prepare_data_single_small_file(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("hello world\n")
    with pytest.raises(ConfigError) as info:
        prepare_data(data_cfg(path, tmp_path / "cache"), log=lambda m: None)
    assert info.value.key in ("data.source", "data.val_fraction")


def test_prepare_data_vocab_too_small(text_folder, tmp_path):
    cfg = data_cfg(text_folder, tmp_path / "cache", "model.vocab=200")  # < 256 bytes + EOS
    with pytest.raises(ConfigError) as info:
        prepare_data(cfg, log=lambda m: None)
    assert info.value.key == "model.vocab"


def test_prepare_data_with_a_given_tokenizer(text_folder, tmp_path):
    cache = tmp_path / "cache"
    first = prepare_data(data_cfg(text_folder, cache), log=lambda m: None)
    tok_file = tmp_path / "my-tokenizer.json"
    first.tokenizer.save(str(tok_file))
    logs: list[str] = []
    data = prepare_data(data_cfg(text_folder, tmp_path / "cache2", f"data.tokenizer='{tok_file}'"),
                        log=logs.append)
    assert not any("training" in m for m in logs)
    assert np.array_equal(data.train, first.train)
    assert not list((tmp_path / "cache2").glob("tokenizer-*"))


def test_prepare_data_raw_tokens_file(tmp_path):
    ids = (np.arange(1000) * 7 % 500).astype("<u2")
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    cfg = data_cfg(path, tmp_path / "cache")
    data = prepare_data(cfg, log=lambda m: None)
    assert data.tokenizer is None
    assert len(data.train) == 800 and len(data.val) == 200
    assert np.array_equal(np.concatenate([data.train, data.val]), ids)
    assert not (tmp_path / "cache").exists()  # nothing to cache
    # explicit format, any suffix
    other = tmp_path / "ids.dat"
    ids.tofile(other)
    data = prepare_data(data_cfg(other, tmp_path / "cache", "data.format='tokens'"),
                        log=lambda m: None)
    assert np.array_equal(data.train, ids[:800])
    # uint32 ids
    path32 = tmp_path / "ids32.bin"
    ids.astype("<u4").tofile(path32)
    data = prepare_data(data_cfg(path32, tmp_path / "cache", "data.token_dtype='uint32'"),
                        log=lambda m: None)
    assert np.array_equal(data.val, ids[800:])


def test_prepare_data_tokens_out_of_vocab_or_too_short(tmp_path):
    path = tmp_path / "ids.bin"
    np.array([1, 2, 600] * 100, dtype="<u2").tofile(path)
    with pytest.raises(ConfigError) as info:
        prepare_data(data_cfg(path, tmp_path / "cache"), log=lambda m: None)
    assert info.value.key == "model.vocab" and "600" in str(info.value)
    np.arange(100, dtype="<u2").tofile(path)  # val part: 20 tokens < seq_len + 1
    with pytest.raises(ConfigError) as info:
        prepare_data(data_cfg(path, tmp_path / "cache"), log=lambda m: None)
    assert info.value.key == "data.val_fraction"


@pytest.mark.parametrize("raw,dtype,key", [
    (b"", "uint16", "data.source"),
    (np.arange(301, dtype="<u2").tobytes() + b"\0", "uint16", "data.token_dtype"),
    (np.arange(301, dtype="<u2").tobytes(), "uint32", "data.token_dtype"),
])
def test_prepare_data_unreadable_tokens_file(tmp_path, raw, dtype, key):
    path = tmp_path / "ids.bin"
    path.write_bytes(raw)
    with pytest.raises(ConfigError) as info:
        prepare_data(data_cfg(path, tmp_path / "cache", f"data.token_dtype='{dtype}'"),
                     log=lambda m: None)
    assert info.value.key == key


def test_check_data():
    cfg = load_config(None, TINY)
    ok = np.arange(33, dtype=np.uint16)
    check_data(cfg, TokenData(ok, ok, None))
    with pytest.raises(ConfigError) as info:
        check_data(cfg, TokenData(ok[:32], ok, None))
    assert info.value.key == "data.source"
    with pytest.raises(ConfigError) as info:
        check_data(cfg, TokenData(ok, ok[:32], None))
    assert info.value.key == "data.val_fraction"


# ---------------------------------------------------------------- BatchSampler

def test_sampler_reads_a_memmapped_cache(text_folder, tmp_path):
    data = prepare_data(data_cfg(text_folder, tmp_path / "cache"), log=lambda m: None)
    assert isinstance(data.train, np.memmap) or data.train.base is not None
    x, y = BatchSampler(data.train, 32, 4, seed=0).rank_batch(0)
    assert x.shape == (4, 32) and int(x.max()) < 512
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert os.path.getsize(next((tmp_path / "cache").glob("*-train.npy"))) > len(data.train) * 2

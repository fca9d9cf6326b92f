"""Weighted data mixtures: the sampler's draw, the config, the prepared streams, and training.

The sampler tests pin what makes a mixture resumable and layout-free: the global batch of a
step is a pure function of (seed, split, step), data-parallel ranks take slices of it, and a
single source still draws exactly as before mixtures existed."""

from __future__ import annotations

import json
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError, load_config
from fivefold.train.corpus import Document
from fivefold.train.data import BatchSampler, prepare_data, weighted_sample
from fivefold.train.mixture import Mixture
from fivefold.validate import validate

from test_train import straight_and_resumed

# two streams whose ids cannot be confused: source 0 in [0, 1000), source 1 in [5000, 5300)
STREAMS = (np.arange(1000, dtype=np.uint16), np.arange(5000, 5300, dtype=np.uint16))


def source_of(row: torch.Tensor) -> int:
    return int(row[0] >= 5000)


def test_one_source_draws_as_the_single_source_sampler_always_has():
    """Bit for bit the pre-mixture formula, so existing runs and README numbers stand."""
    tokens = np.arange(777, dtype=np.uint16)
    sampler = BatchSampler(tokens, 16, 8, seed=5, split=1)
    for step in (0, 3, 90):
        expected = np.random.default_rng([5, 1, step]).integers(0, 777 - 16, size=8)
        assert np.array_equal(sampler.global_offsets(step), expected)
    wrapped = BatchSampler(Mixture((tokens,), (1.0,)), 16, 8, seed=5, split=1)
    assert torch.equal(wrapped.rank_batch(4)[0], sampler.rank_batch(4)[0])


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_mixture_rank_slices_concatenate_to_the_one_rank_batch(dp):
    mix = Mixture(STREAMS, (3.0, 1.0))
    for step in (0, 7, 123):
        x1, y1 = BatchSampler(mix, 16, 8, seed=2).rank_batch(step)
        parts = [BatchSampler(mix, 16, 8, seed=2, dp_rank=r, dp_size=dp).rank_batch(step)
                 for r in range(dp)]
        assert torch.equal(torch.cat([x for x, _ in parts]), x1)
        assert torch.equal(torch.cat([y for _, y in parts]), y1)


def test_mixture_batch_is_a_function_of_the_step_alone():
    """A fresh sampler (a resumed run) draws step s as the one that drew steps 0..s-1."""
    mix = Mixture(STREAMS, (1.0, 2.0))
    used = BatchSampler(mix, 16, 8, seed=4)
    for step in range(6):
        used.rank_batch(step)
    fresh = BatchSampler(mix, 16, 8, seed=4)
    assert torch.equal(fresh.rank_batch(6)[0], used.rank_batch(6)[0])
    assert not torch.equal(fresh.rank_batch(6)[0], fresh.rank_batch(7)[0])
    assert not torch.equal(BatchSampler(mix, 16, 8, seed=4, split=1).rank_batch(6)[0],
                           fresh.rank_batch(6)[0])


def test_mixture_rows_are_whole_windows_of_their_source():
    x, y = BatchSampler(Mixture(STREAMS, (1.0, 1.0)), 16, 64, seed=0).rank_batch(3)
    for row_x, row_y in zip(x, y):
        assert torch.equal(row_y[:-1], row_x[1:])  # targets: inputs shifted by one
        assert torch.equal(row_x, torch.arange(int(row_x[0]), int(row_x[0]) + 16))
        assert (row_x[-1] < 1000) if source_of(row_x) == 0 else (row_y[-1] < 5300)


def test_realized_mix_is_near_the_weights():
    """Weights 3:1, 2000 steps of 8 sequences (16000 draws): source 0's share is 0.75 within
    0.02 (one standard deviation of a multinomial share is sqrt(.75 * .25 / 16000) = 0.0034,
    so 0.02 is about 6); the draw is seeded, so this is deterministic too."""
    sampler = BatchSampler(Mixture(STREAMS, (3.0, 1.0)), 16, 8, seed=0)
    sources = np.concatenate([sampler.global_draw(step)[0] for step in range(2000)])
    assert abs(np.mean(sources == 0) - 0.75) < 0.02
    x, _ = sampler.rank_batch(11)  # the tokens follow the drawn sources
    assert [source_of(row) for row in x] == list(sampler.global_draw(11)[0])


def test_weighted_tokenizer_sample_follows_the_weights():
    """Two sources of 100 x 10 kB documents, weights 3:1, a 0.5 MiB sample: source 0's share
    of the sampled text is 0.75 within 0.1 (every k-th document, k rounded down)."""
    docs = [[Document(f"{s}/{i}", chr(97 + s) * 10_000) for i in range(100)] for s in (0, 1)]
    sample = weighted_sample([(docs[0], 3.0), (docs[1], 1.0)], 0.5)
    share = sum(len(d.text) for d in sample if d.text[0] == "a") / sum(len(d.text)
                                                                      for d in sample)
    assert abs(share - 0.75) < 0.1


# ---------------------------------------------------------------- config

@pytest.fixture
def two_folders(tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x.txt").write_text("hello\n")
    (b / "y.jsonl").write_text('{"text": "hi"}\n')
    return a, b


def test_toml_array_of_tables_and_set_express_the_same_mixture(two_folders, tmp_path):
    a, b = two_folders
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""\
        [[data.sources]]
        path = "{a}"
        weight = 3
        [[data.sources]]
        path = "{b}"
        weight = 0.5
        text_field = "body"
        """))
    from_file = load_config(tmp_path / "run.toml")
    from_set = load_config(None, [f'data.sources=[{{path="{a}", weight=3}}, '
                                  f'{{path="{b}", weight=0.5, text_field="body"}}]'])
    assert from_file.data == from_set.data
    assert [(s.path, s.weight, s.format) for s in from_file.data.sources] == [
        (str(a), 3.0, "auto"), (str(b), 0.5, "auto")]
    validate(from_file)


@pytest.mark.parametrize("sources, extra, key", [
    ('[{path="A", weight=1}, {path="B", weight=0}]', [], "data.sources[1].weight"),
    ('[{path="A", weight=-2}]', [], "data.sources[0].weight"),
    ('[{path="A", weight=nan}]', [], "data.sources[0].weight"),
    ('[{path="A"}, {path="missing"}]', [], "data.sources[1].path"),
    ('[{path="A", format="csv"}]', [], "data.sources[0].format"),
    ('[{path="A", token_dtype="int8"}]', [], "data.sources[0].token_dtype"),
    ('[{path="A", format="tokens"}]', [], "data.sources[0].format"),
    ('[{path="A"}]', ["data.source=B"], "data.source"),
    ('[{path="A"}]', ["data.text_field=body"], "data.text_field"),
    ('[]', [], "data.sources"),
    ('[{path="A", wieght=2}]', [], "data.sources[0].wieght"),
    ('{path="A"}', [], "data.sources"),
])
def test_mixture_config_errors_name_the_key(two_folders, tmp_path, sources, extra, key):
    a, b = two_folders
    text = sources.replace('"A"', f'"{a}"')
    extra = [e.replace("=B", f"={b}") for e in extra]
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, [f"data.sources={text}", *extra]))
    assert err.value.key == key


def test_token_files_mixed_with_text_need_the_token_files_tokenizer(two_folders, tmp_path):
    a, _ = two_folders
    (tmp_path / "t.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    cfg = load_config(None, [f'data.sources=[{{path="{tmp_path / "t.bin"}"}}, {{path="{a}"}}]'])
    validate(cfg)
    with pytest.raises(ConfigError) as err:
        prepare_data(cfg)
    assert err.value.key == "data.tokenizer"


# ---------------------------------------------------------------- relative paths

def test_relative_paths_in_a_config_file_resolve_from_its_folder(tmp_path, monkeypatch):
    """From the file's folder whatever the current directory; --set stays relative to it."""
    folder = tmp_path / "project"
    (folder / "corpus").mkdir(parents=True)
    (folder / "corpus" / "a.txt").write_text("text\n")
    (folder / "run.toml").write_text(textwrap.dedent("""\
        [data]
        source = "corpus"
        tokenizer = "tok/tokenizer.json"
        cache_dir = "../cache"
        """))
    monkeypatch.chdir(tmp_path)
    cfg = load_config("project/run.toml")
    assert cfg.data.source == str(folder / "corpus")
    assert cfg.data.tokenizer == str(folder / "tok" / "tokenizer.json")
    assert cfg.data.cache_dir == str(tmp_path / "cache")
    assert load_config("project/run.toml", ["data.source=corpus"]).data.source == "corpus"
    (folder / "mix.toml").write_text('[[data.sources]]\npath = "corpus"\n'
                                     '[[data.sources]]\npath = "stdlib"\n'
                                     f'[[data.sources]]\npath = "{tmp_path}"\n')
    paths = [s.path for s in load_config(folder / "mix.toml").data.sources]
    assert paths == [str(folder / "corpus"), "stdlib", str(tmp_path)]
    (folder / "source.toml").write_text('[data]\nsource = "corpus"\n')
    validate(load_config("project/source.toml"))  # the path checked is the resolved one


# ---------------------------------------------------------------- prepared streams, training

@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory) -> Path:
    """A JSONL file of 40 standard-library `email` modules: a second, different source."""
    path = tmp_path_factory.mktemp("jsonl") / "email.jsonl"
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "email").rglob("*.py"))[:40]
    path.write_text("".join(json.dumps({"body": f.read_text()}) + "\n" for f in files))
    return path


@pytest.fixture(scope="module")
def mixture_overrides(tiny_overrides, small_corpus, jsonl_corpus) -> list[str]:
    sets = [s for s in tiny_overrides if not s.startswith("data.source=")]
    return sets + [f'data.sources=[{{path="{small_corpus}", weight=3}}, '
                   f'{{path="{jsonl_corpus}", weight=1, text_field="body"}}]']


def test_prepare_mixture_splits_each_source_with_one_tokenizer(mixture_overrides, small_corpus,
                                                              jsonl_corpus, capsys):
    cfg = load_config(None, mixture_overrides)
    validate(cfg)
    data = prepare_data(cfg)
    assert isinstance(data.train, Mixture) and isinstance(data.val, Mixture)
    assert data.train.weights == data.val.weights == (3.0, 1.0)
    assert all(len(s) > 1000 for s in data.train.streams + data.val.streams)
    assert data.tokenizer.get_vocab_size() <= cfg.model.vocab
    documents = ([p.read_text() for p in small_corpus.iterdir()],
                 [json.loads(line)["body"] for line in jsonl_corpus.read_text().splitlines()])
    for mixture in (data.train, data.val):  # each stream starts with a document of its source
        for stream, docs in zip(mixture.streams, documents):
            text = data.tokenizer.decode(np.asarray(stream[:100]).tolist())
            assert any(doc.startswith(text) for doc in docs)
    capsys.readouterr()
    again = prepare_data(cfg)  # cached: nothing trained or tokenized again
    assert "tokeniz" not in capsys.readouterr().out
    assert np.array_equal(again.val.streams[0], data.val.streams[0])


def test_one_source_table_is_data_source(tiny_overrides, small_corpus):
    """A single [[data.sources]] table prepares the very streams `data.source` does."""
    single = prepare_data(load_config(None, tiny_overrides))
    sets = [s for s in tiny_overrides if not s.startswith("data.source=")]
    table = prepare_data(load_config(None, sets + [f'data.sources=[{{path="{small_corpus}"}}]']))
    assert np.array_equal(table.train, single.train) and np.array_equal(table.val, single.val)


def test_mixture_trains_and_resumes_bit_identical(mixture_overrides, tmp_path):
    """fp32 on CPU: a 2-source mixture trains (the loss falls) and a run that crashes after
    its step-4 checkpoint resumes with exactly the losses of the uninterrupted run."""
    sets = mixture_overrides + ["train.steps=8", "train.checkpoint_every=4",
                                "train.eval_every=4", "train.sample_tokens=0"]
    straight, resumed, resumed_from = straight_and_resumed(load_config(None, sets), tmp_path,
                                                           crash_at=6)
    assert resumed_from == "step_00000004"
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(straight, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], a["step"]
        assert a.get("val_loss") == b.get("val_loss")
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.5
